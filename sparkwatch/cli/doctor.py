"""`sparkwatch doctor [--json] [--fix] [--root DIR]`: a one-shot health report. Exit 0 no check fails, 1 one fails,
2 usage. `--fix` applies the one fix that needs no guessing: a killed engine's files in /dev/shm (cli.shm_fix).

With --root other than /, everything comes from files under DIR (DIR/proc included) and the live probes of this
machine (NVML) are skipped, so a fixture root is judged the same on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkwatch.core.enums import CheckStatus
from sparkwatch.core.model import Check

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings
    from sparkwatch.core.report.guardstate import GuardState
    from sparkwatch.core.report.peerchecks import PeerView

_STATUS_STYLE: dict[CheckStatus, tuple[str, str]] = {
    CheckStatus.OK: ("ok", "32"),
    CheckStatus.WARN: ("WARN", "33"),
    CheckStatus.FAIL: ("FAIL", "1;31"),
    CheckStatus.SKIP: ("skip", "2"),
}
_SHOW_FIX = (CheckStatus.FAIL, CheckStatus.WARN)


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "doctor",
        parents=[parent],
        help="one-shot health report: driver, swap, MAX_JOBS, Ray, floor, /dev/shm leftovers, guard, kernel log, Xids",
        description="A one-shot health report of this node: a stranded NVIDIA driver (with the commands that fix "
        "it), the kernel that boots next, swap, MAX_JOBS in the engines' environments, Ray's memory monitor, the "
        "floor, the files a killed engine left in /dev/shm (--fix removes them), whether a guard runs and is armed, "
        "whether the kernel log is readable, recent Xids. Exit 1 when a check fails.",
    )
    p.add_argument("--json", action="store_true", help='print {"ok": …, "checks": […]}')
    p.add_argument(
        "--fix",
        action="store_true",
        help="first remove the /dev/shm files a killed engine left (orphaned, yours or any as root, named like an "
        "engine's); stderr says what went",
    )
    p.set_defaults(handler=handle)


def run_checks(args: argparse.Namespace) -> tuple[list[Check], Path, bool]:
    from sparkwatch.cli import settings_from
    from sparkwatch.common.enginerules import engine_rules
    from sparkwatch.common.guardfile import read_guards, reader_paths
    from sparkwatch.common.sources.environ import read_environ
    from sparkwatch.common.sources.kmsg import read_kmsg_ring
    from sparkwatch.common.sources.meminfo import MeminfoError, parse_meminfo
    from sparkwatch.common.sources.procs import ProcScanner
    from sparkwatch.config.defaults import default_config_file
    from sparkwatch.config.settings import config_file_in_use
    from sparkwatch.core.driver.drift import driver_checks, judge
    from sparkwatch.core.report.doctorchecks import (
        env_targets,
        floor_check,
        guard_check,
        kernel_log_check,
        max_jobs_check,
        ray_monitor_check,
        swap_check,
        xid_check,
    )
    from sparkwatch.telemetry.sources.driverfacts import read_driver_facts
    from sparkwatch.telemetry.sources.nvml import probe_nvml

    settings = settings_from(args)
    root = settings.root
    live = root.resolve() == Path("/")
    # --root DIR reads DIR/proc for doctor (a fixture root carries its own proc); an explicit --proc-root still wins.
    proc_root = args.proc_root if args.proc_root is not None else (settings.proc_root if live else root / "proc")

    from sparkwatch.core.model import NvmlFacts
    from sparkwatch.telemetry.sources.nvml_preflight import nvml_hang_reason

    # A hung libnvidia-ml load would freeze this process (it holds the GIL): check in a child first.
    nvml_off = nvml_hang_reason() if live else None
    probe = None if not live else (probe_nvml if nvml_off is None else (lambda: NvmlFacts(error=nvml_off)))
    facts = read_driver_facts(root, probe)
    report = judge(facts)
    checks = list(driver_checks(report, facts, nvml_asked=live))

    try:
        mem = parse_meminfo((proc_root / "meminfo").read_bytes())
    except (OSError, MeminfoError):
        mem = None
    checks.append(swap_check(mem))

    rules = engine_rules(settings)
    procs = ProcScanner(proc_root).scan().procs if proc_root.is_dir() else ()
    targets = env_targets(procs, rules)
    environ = {t.proc.pid: read_environ(proc_root, t.proc.pid) for t in targets}
    checks.append(max_jobs_check(targets, environ, settings.compile_jobs_alert))
    checks.append(ray_monitor_check(targets, environ))
    in_use = config_file_in_use(args.config)
    checks.append(floor_check(settings.floor, settings.warn_headroom, mem, str(in_use or default_config_file())))
    checks.append(shm_leftovers(root, proc_root, args.fix))
    # The running guard's own word (common.guardfile); only this machine's: a fixture root has no processes to ask.
    guards = read_guards(reader_paths(os.environ, settings.state_dir)) if live else None
    checks.append(guard_check(guards.states if guards else (), guards.notes if guards else (), live))
    # The kernel log: this machine's /dev/kmsg (kernel_log_path), or DIR/dev/kmsg (a file of records) under --root.
    kmsg = settings.kernel_log_path if live else root / "dev" / "kmsg"
    records, why_not = read_kmsg_ring(kmsg, records_file=not live)
    checks.append(kernel_log_check(records, why_not))
    checks.append(xid_check(records, why_not))
    checks += pair_checks(settings, proc_root, guards.states if guards else (), live)
    return checks, root, live


def shm_leftovers(root: Path, proc_root: Path, fix: bool) -> Check:
    """The files a killed engine left in DIR/dev/shm; with --fix the engine-named ones go first (stderr says which),
    and the check tells what is left."""
    from sparkwatch.cli import shm_fix
    from sparkwatch.core.report.doctorchecks import shm_check
    from sparkwatch.telemetry.sources.shmfiles import shm_dir

    if fix:
        shm_fix.say(root, proc_root, True, "sparkwatch doctor")
    where = shm_dir(root)
    try:
        return shm_check(shm_fix.look(where, proc_root), str(where), None, os.geteuid())
    except OSError as exc:
        return shm_check(None, str(where), exc.strerror or str(exc), os.geteuid())


def pair_checks(settings: Settings, proc_root: Path, guards: Sequence[GuardState], live: bool) -> list[Check]:
    """The peers' trust in one line and each peer's state, read once now (cli.peerread: each within a second, all at
    once), and whether the agent's port is its agent's (issues 37, 39; docs/multinode.md)."""
    from sparkwatch.common.peerproof import settings_line
    from sparkwatch.core.report.peerchecks import listen_check, listen_skipped, peers_check
    from sparkwatch.telemetry.sources.portholder import describe, port_holders

    peers: tuple[PeerView, ...] = ()
    if settings.peers:
        from sparkwatch.cli.peerread import read_peers, views

        peers = views(read_peers(settings))
    out = [peers_check(*settings_line(settings), peers)]
    if not live:
        out.append(listen_skipped(settings.listen))
    else:
        listening, holders = port_holders(proc_root, settings.listen_port)
        pids = {g.pid for g in guards}
        agent = any(h.pid in pids or h.ppid in pids for h in holders) if holders else None
        out.append(listen_check(settings.listen, listening, describe(holders), agent, bool(pids)))
    return out


def handle(args: argparse.Namespace) -> int:
    if args.root is not None and not args.root.is_dir():
        print(f"sparkwatch doctor: --root {args.root} is not a directory", file=sys.stderr)
        return 2
    checks, root, live = run_checks(args)
    ok = not any(c.status == CheckStatus.FAIL for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [c.to_json_dict() for c in checks]}, indent=2))
    else:
        print_human(checks, root, live)
    return 0 if ok else 1


def print_human(checks: list[Check], root: Path, live: bool) -> None:
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    width = max(len(c.id) for c in checks)
    where = "this machine" if live else f"root {root} (live probes skipped)"
    print(f"sparkwatch doctor: {where}")
    for c in checks:
        label, code = _STATUS_STYLE[c.status]
        shown = f"\033[{code}m{label:<4}\033[0m" if color else f"{label:<4}"
        print(f"  {shown}  {c.id:<{width}}  {c.summary}")
        pad = " " * (width + 10)
        if c.fix and c.status in _SHOW_FIX:
            print(f"{pad}fix:")
            for line in c.fix.splitlines():
                print(f"{pad}  {line}")
        if c.detail and c.status in _SHOW_FIX:
            for line in c.detail.splitlines():
                print(f"{pad}· {line}")
    fails = sum(c.status == CheckStatus.FAIL for c in checks)
    warns = sum(c.status == CheckStatus.WARN for c in checks)
    verdict = "FAIL" if fails else "ok"
    print(f"{verdict}: {fails} failing, {warns} warnings, {len(checks)} checks")
