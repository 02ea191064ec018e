"""`sparkwatch doctor [--json] [--root DIR]`: a one-shot health report. Exit 0 no check fails, 1 one fails, 2 usage.

With --root other than /, everything comes from files under DIR (DIR/proc included) and the live probes of this
machine (NVML) are skipped, so a fixture root is judged the same on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from sparkwatch.model import Check

_STATUS_STYLE = {"ok": ("ok", "32"), "warn": ("WARN", "33"), "fail": ("FAIL", "1;31"), "skip": ("skip", "2")}


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser("doctor", parents=[parent], help="one-shot health report: driver, swap, MAX_JOBS, Ray, floor")
    p.add_argument("--json", action="store_true", help='print {"ok": …, "checks": […]}')
    p.set_defaults(handler=handle)


def run_checks(args: argparse.Namespace) -> tuple[list[Check], Path, bool]:
    from sparkwatch.cli import settings_from
    from sparkwatch.core.doctor import env_targets, floor_check, max_jobs_check, ray_monitor_check, swap_check
    from sparkwatch.core.drift import driver_checks, judge
    from sparkwatch.core.engines import rules_for
    from sparkwatch.sources.environ import read_environ
    from sparkwatch.sources.meminfo import MeminfoError, parse_meminfo
    from sparkwatch.sources.procs import ProcScanner
    from sparkwatch.sources.system import probe_nvml, read_driver_facts

    settings = settings_from(args)
    root = settings.root
    live = root.resolve() == Path("/")
    # DESIGN: --root DIR reads DIR/proc for doctor; an explicit --proc-root still wins.
    proc_root = args.proc_root if args.proc_root is not None else (settings.proc_root if live else root / "proc")

    facts = read_driver_facts(root, probe_nvml if live else None)
    report = judge(facts)
    checks = list(driver_checks(report, facts, nvml_asked=live))

    try:
        mem = parse_meminfo((proc_root / "meminfo").read_bytes())
    except (OSError, MeminfoError):
        mem = None
    checks.append(swap_check(mem))

    rules = rules_for(settings.engine_patterns, settings.protect_patterns, settings.guard_gpu_holders)
    procs = ProcScanner(proc_root).scan().procs if proc_root.is_dir() else ()
    targets = env_targets(procs, rules)
    environ = {t.proc.pid: read_environ(proc_root, t.proc.pid) for t in targets}
    checks.append(max_jobs_check(targets, environ, settings.compile_jobs_alert))
    checks.append(ray_monitor_check(targets, environ))
    checks.append(floor_check(settings.floor, settings.warn_headroom, mem))
    return checks, root, live


def handle(args: argparse.Namespace) -> int:
    if args.root is not None and not args.root.is_dir():
        print(f"sparkwatch doctor: --root {args.root} is not a directory", file=sys.stderr)
        return 2
    checks, root, live = run_checks(args)
    ok = not any(c.status == "fail" for c in checks)
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
        label, code = _STATUS_STYLE.get(c.status, (c.status, "0"))
        shown = f"\033[{code}m{label:<4}\033[0m" if color else f"{label:<4}"
        print(f"  {shown}  {c.id:<{width}}  {c.summary}")
        pad = " " * (width + 10)
        if c.fix and c.status in ("fail", "warn"):
            print(f"{pad}fix:")
            for line in c.fix.splitlines():
                print(f"{pad}  {line}")
        if c.detail and c.status in ("fail", "warn"):
            for line in c.detail.splitlines():
                print(f"{pad}· {line}")
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    verdict = "FAIL" if fails else "ok"
    print(f"{verdict}: {fails} failing, {warns} warnings, {len(checks)} checks")
