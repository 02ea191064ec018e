"""The non-driver checks of `sparkwatch doctor`: swap, MAX_JOBS and Ray's memory monitor in running engines, floor,
/dev/shm's leftovers, the guard (running, armed or dry run), the kernel log and the Xids in it.

Pure: processes, their environments and meminfo come in as data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from sparkwatch.core.driver.nvrm import KmsgRecord, NvrmError, XidLine, is_from_kernel, parse_nvrm, xid_info
from sparkwatch.core.engines.identity import EngineRules, engine_kind
from sparkwatch.core.enums import CheckStatus
from sparkwatch.core.launch.shmleft import file_line, fix_command, summary
from sparkwatch.core.model import Check, MemInfo, Proc, ShmLeft
from sparkwatch.core.redact import redact
from sparkwatch.core.report.guardstate import GuardState, describe, describe_all
from sparkwatch.core.words import plural

GiB = 1 << 30
# Below 2 GiB the guard cannot win the race: a start-up spike went 34.0 -> 12.7 GiB in ~1.5 s on a Spark.
FLOOR_MIN_BYTES = 2 * GiB
FLOOR_MAX_FRACTION = 0.25  # above a quarter of the pool the guard kills engines that would have fit
SUGGESTED_FLOOR_GIB = 8  # what the field used (oom-guard: "MemAvailable=4726 MiB < 8192 MiB")
MAX_JOBS_SUGGESTED = 4  # each nvcc/cicc holds 3-8 GiB; ninja's default (one per core, 20) is a ~70 GiB burst
RAY_MONITOR_VAR = "RAY_memory_monitor_refresh_ms"


@dataclass(frozen=True, slots=True)
class EnvTarget:
    proc: Proc
    role: Literal["engine", "raylet"]
    kind: str | None = None  # the engine kind, for role "engine"


def is_raylet(proc: Proc) -> bool:
    return proc.comm == "raylet" or bool(proc.argv and proc.argv[0].rsplit("/", 1)[-1] == "raylet")


def env_targets(procs: Sequence[Proc], rules: EngineRules) -> tuple[EnvTarget, ...]:
    """Engine roots (an engine whose ancestors are not engines) and every raylet: whose environment matters.

    Ray actors inherit the raylet's environment, not the shell's that ran `vllm serve`, so raylets count too.
    """
    by_pid = {p.pid: p for p in procs}
    kinds = {p.pid: k for p in procs if (k := engine_kind(p, rules)) is not None}
    out = []
    for p in sorted(procs, key=lambda p: p.pid):
        if is_raylet(p):
            out.append(EnvTarget(p, "raylet"))
            continue
        kind = kinds.get(p.pid)
        if kind is None or kind == "ray":  # ray:: workers inherit from their raylet, checked there
            continue
        parent, seen = by_pid.get(p.ppid), {p.pid}
        inner = False
        while parent is not None and parent.pid not in seen:
            if parent.pid in kinds:
                inner = True
                break
            seen.add(parent.pid)
            parent = by_pid.get(parent.ppid)
        if not inner:
            out.append(EnvTarget(p, "engine", kind))
    return tuple(out)


def _who(t: EnvTarget) -> str:
    return f"{t.kind if t.role == 'engine' else 'raylet'} pid {t.proc.pid} ({redact(t.proc.display_name)})"


def max_jobs_check(
    targets: Sequence[EnvTarget], environ: Mapping[int, Mapping[str, str] | None], jobs_alert: int
) -> Check:
    if not targets:
        return Check("max-jobs", CheckStatus.SKIP, "no engine or raylet running")
    unreadable = [t for t in targets if environ.get(t.proc.pid) is None]
    readable = [t for t in targets if environ.get(t.proc.pid) is not None]
    if not readable:
        return Check(
            "max-jobs",
            CheckStatus.SKIP,
            f"cannot read the environment of {plural(len(unreadable), 'engine/raylet process')} (another user's?)",
            detail="\n".join(_who(t) for t in unreadable),
        )
    missing = [t for t in readable if not (environ[t.proc.pid] or {}).get("MAX_JOBS")]
    wide = []
    for t in readable:
        value = (environ[t.proc.pid] or {}).get("MAX_JOBS", "")
        if value and (not value.isdigit() or int(value) > jobs_alert):
            wide.append((t, value))
    fix = (
        f"export MAX_JOBS={MAX_JOBS_SUGGESTED} TORCHINDUCTOR_COMPILE_THREADS=2   "
        "# in the shell or unit that starts the engine, then restart it\n"
        f"# with Ray, in every raylet's environment (actors inherit the raylet's, not the shell's):\n"
        f"ray stop && MAX_JOBS={MAX_JOBS_SUGGESTED} ray start …   # on every node, with your usual ray start flags"
    )
    lines = [f"{_who(t)}: MAX_JOBS unset" for t in missing]
    lines += [f"{_who(t)}: MAX_JOBS={v}" for t, v in wide]
    lines += [f"{_who(t)}: environment unreadable" for t in unreadable]
    # The summary counts what the detail lists, line for line: every target is unset, too wide, unreadable or fine.
    of = plural(len(targets), "engine/raylet process")
    unread = f"; environment unreadable in {len(unreadable)}" if unreadable else ""
    if missing or wide:
        parts = [f"unset in {len(missing)}"] if missing else []
        parts += [f"above {jobs_alert} in {len(wide)}"] if wide else []
        return Check(
            "max-jobs",
            CheckStatus.WARN,
            f"MAX_JOBS {', '.join(parts)} of {of}{unread}: the first JIT compile runs one nvcc per core (3-8 GiB each)",
            fix=fix,
            detail="\n".join(lines),
        )
    good = (
        f"{len(readable)} of {of}" if unreadable else f"all {of}" if len(targets) > 1 else "its engine/raylet process"
    )
    return Check("max-jobs", CheckStatus.OK, f"MAX_JOBS set in {good}{unread}", detail="\n".join(lines) or None)


def ray_monitor_check(targets: Sequence[EnvTarget], environ: Mapping[int, Mapping[str, str] | None]) -> Check:
    raylets = [t for t in targets if t.role == "raylet"]
    if not raylets:
        return Check("ray-memory-monitor", CheckStatus.SKIP, "no raylet running")
    readable = [t for t in raylets if environ.get(t.proc.pid) is not None]
    if not readable:
        return Check("ray-memory-monitor", CheckStatus.SKIP, f"cannot read the environment of {len(raylets)} raylets")
    bad = [t for t in readable if (environ[t.proc.pid] or {}).get(RAY_MONITOR_VAR, "").strip() != "0"]
    if bad:
        detail = "\n".join(
            f"raylet pid {t.proc.pid}: {RAY_MONITOR_VAR}="
            f"{(environ[t.proc.pid] or {}).get(RAY_MONITOR_VAR, 'unset (Ray default 250)')}"
            for t in bad
        )
        return Check(
            "ray-memory-monitor",
            CheckStatus.WARN,
            f"Ray's memory monitor is on in {len(bad)} of {len(readable)} raylets: it counts GPU weights as system "
            "RAM on a unified pool and kills workers after the model loads",
            fix=f"ray stop && {RAY_MONITOR_VAR}=0 ray start …   # on EVERY node (the head alone is not enough), "
            "with your usual ray start flags",
            detail=detail,
        )
    return Check("ray-memory-monitor", CheckStatus.OK, f"{RAY_MONITOR_VAR}=0 on all {len(readable)} raylets")


def swap_check(mem: MemInfo | None) -> Check:
    if mem is None:
        return Check("swap", CheckStatus.SKIP, "meminfo unreadable")
    if mem.swap_total_bytes > 0:
        return Check("swap", CheckStatus.OK, f"{mem.swap_total_bytes / GiB:.1f} GiB swap")
    return Check(
        "swap",
        CheckStatus.WARN,
        "no swap: an overshoot past the floor goes straight to the kernel OOM killer, which can wedge a Spark",
        fix=(
            "sudo fallocate -l 16G /swapfile && sudo chmod 600 /swapfile\n"
            "sudo mkswap /swapfile && sudo swapon /swapfile\n"
            "echo '/swapfile none swap sw 0 0' | sudo tee -a /etc/fstab"
        ),
        detail="a small swapfile is a shock absorber for page cache and stray processes, not room for engines "
        "(GPU allocations on the unified pool never swap)",
    )


def _suggested_floor_gib(total_bytes: int) -> int:
    """8 GiB (what the field used on 121.7 GiB Sparks), within [2 GiB, a quarter of the pool]."""
    return max(FLOOR_MIN_BYTES // GiB, min(SUGGESTED_FLOOR_GIB, int(FLOOR_MAX_FRACTION * total_bytes) // GiB))


def floor_check(floor_bytes: int, warn_headroom_bytes: int, mem: MemInfo | None, config_file: str) -> Check:
    """`config_file`: the file the fix goes in, the one in use (--config, SPARKWATCH_CONFIG), else the default one."""
    if mem is None or mem.total_bytes <= 0:
        return Check("floor", CheckStatus.SKIP, "meminfo unreadable: cannot judge the floor")
    total = mem.total_bytes
    shown = f"floor {floor_bytes / GiB:.1f} GiB of {total / GiB:.1f} GiB MemTotal"
    suggested = _suggested_floor_gib(total)
    fix = f'floor = "{suggested}GiB"   # in {config_file}, then restart sparkwatch'
    if floor_bytes >= total:
        return Check("floor", CheckStatus.FAIL, f"{shown}: the guard would kill every engine at once", fix=fix)
    if floor_bytes < FLOOR_MIN_BYTES:
        return Check(
            "floor",
            CheckStatus.WARN,
            f"{shown}: under 2 GiB the guard cannot beat a start-up spike (34 -> 12.7 GiB in 1.5 s)",
            fix=fix,
        )
    if floor_bytes > FLOOR_MAX_FRACTION * total:
        return Check(
            "floor",
            CheckStatus.WARN,
            f"{shown}: over a quarter of the pool; engines that would fit get killed",
            fix=fix,
        )
    if floor_bytes + warn_headroom_bytes > total:
        return Check(
            "floor", CheckStatus.WARN, f"{shown}: floor + warn_headroom exceeds MemTotal; always warning", fix=fix
        )
    return Check("floor", CheckStatus.OK, shown)


def shm_check(left: ShmLeft | None, where: str, why_not: str | None, euid: int) -> Check:
    """Files in /dev/shm no process holds (core.launch.shmleft): a killed engine's shared memory, out of the pool until
    removed or a reboot. A warning: the node works, with less memory."""
    if left is None:
        return Check("shm-leftovers", CheckStatus.SKIP, f"cannot read {where}: {why_not}")
    if not left.orphans:
        return Check("shm-leftovers", CheckStatus.OK, summary(left, where))
    fix = fix_command(left, euid, "sparkwatch doctor")
    return Check(
        "shm-leftovers",
        CheckStatus.WARN,
        summary(left, where),
        fix=f"{fix[0]}   # {fix[1]}" if fix else f"ls -l {where}   # no engine's names: remove one once you know whose",
        detail="\n".join(file_line(f, left, euid) for f in left.orphans),
    )


def guard_check(states: Sequence[GuardState], notes: Sequence[str], live: bool) -> Check:
    """Whether a guard runs (its published state, common.guardfile) and would kill. Not running or in dry run is a
    warning, not a failure: the node itself is healthy, only unguarded."""
    if not live:
        return Check("guard", CheckStatus.SKIP, "not this machine's root: no running guard to ask")
    detail = "\n".join(notes) or None
    if not states:
        return Check(
            "guard",
            CheckStatus.WARN,
            f"{describe_all(states)}: nothing kills an engine before the pool runs out, and no budget is enforced",
            fix="sparkwatch install-service   # the user unit; engines of other users or in Docker: "
            "sudo sparkwatch install-service --system",
            detail=detail,
        )
    dry = [s for s in states if s.dry_run]
    if dry and len(dry) == len(states):
        return Check(
            "guard",
            CheckStatus.WARN,
            f"{describe_all(states)}: it records what it would kill and signals nothing",
            fix="sparkwatch run without --dry-run (or dry_run = false in the config), then restart sparkwatch",
            detail=detail,
        )
    return Check("guard", CheckStatus.OK, "; ".join(describe(s) for s in states), detail=detail)


# --- the kernel log (core.driver.nvrm)

RECENT_XIDS_SHOWN = 10


def kernel_log_check(records: Sequence[KmsgRecord], why_not: str | None) -> Check:
    """Whether NVRM and Xid lines can be seen at all; a blind guard still runs, so this warns, never fails."""
    if why_not is not None:
        return Check(
            "kernel-log",
            CheckStatus.WARN,
            f"kernel log not readable: {why_not}",
            fix="sudo sparkwatch install-service --system   # or: sudo sysctl kernel.dmesg_restrict=0",
            detail="without it sparkwatch sees no NV_ERR_NO_MEMORY and no Xid: the guard watches MemAvailable alone",
        )
    nvrm = [r for r in records if "NVRM" in r.text and is_from_kernel(r)]
    injected = sum(1 for r in records if "NVRM" in r.text and not is_from_kernel(r))
    alloc = [r for r in nvrm if isinstance((p := parse_nvrm(r.text, r.level)), NvrmError) and p.is_alloc_failure]
    summary = f"readable: {len(records)} records in the ring, {len(nvrm)} NVRM lines"
    if injected:
        summary += f" ({injected} more written by processes, not the driver: ignored)"
    if alloc:
        return Check(
            "kernel-log",
            CheckStatus.WARN,
            f"{summary}, {len(alloc)} driver allocation failures (NV_ERR_NO_MEMORY and the like)",
            detail="\n".join(r.text[:200] for r in alloc[-RECENT_XIDS_SHOWN:]),
        )
    return Check("kernel-log", CheckStatus.OK, summary)


def xid_check(records: Sequence[KmsgRecord], why_not: str | None) -> Check:
    """The Xids still in the kernel's ring (since boot, or as far back as the ring reaches), newest last."""
    if why_not is not None:
        return Check("recent-xids", CheckStatus.SKIP, "kernel log not readable: cannot list Xids")
    xids: list[tuple[KmsgRecord, XidLine]] = [
        (r, line)
        for r in records
        if "Xid" in r.text and is_from_kernel(r) and isinstance((line := parse_nvrm(r.text, r.level)), XidLine)
    ]
    if not xids:
        return Check("recent-xids", CheckStatus.OK, "no Xid in the kernel log")
    lines = []
    for record, xid in xids[-RECENT_XIDS_SHOWN:]:
        info = xid_info(xid)
        who = f" pid {xid.pid} ({xid.process or '?'})" if xid.pid is not None else ""
        when = f"[{record.ts_us / 1e6:.1f} s after boot]"
        lines.append(f"{when} Xid {xid.code} {xid.device}: {info.name}{who} -> {info.action}")
    paging = sorted({x.code for _r, x in xids if xid_info(x).pages})
    codes = ", ".join(str(c) for c in sorted({x.code for _r, x in xids}))
    if paging:
        return Check(
            "recent-xids",
            CheckStatus.FAIL,
            f"{len(xids)} Xids (codes {codes}); {', '.join(map(str, paging))} need a GPU reset or a reboot",
            fix="stop the engines, then: sudo nvidia-smi -r   # or: sudo reboot (Xid 79 always needs the reboot)",
            detail="\n".join(lines),
        )
    summary = f"{len(xids)} Xids (codes {codes}): usually the application's"
    return Check("recent-xids", CheckStatus.WARN, summary, detail="\n".join(lines))
