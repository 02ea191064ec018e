"""Gathering what `sparkwatch launch`'s plan needs (sizes, the pool, running engines, learned peaks) and printing it.

All I/O is here; the decision is core.launch.plan's. Reading is cheap by design: stat of each weight file, a bounded
config.json, /proc/meminfo, /proc/buddyinfo, the declarations directory and the state dir's peaks.json. A 40-shard
directory plans in well under 200 ms (bench/launch_bench.py).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkwatch.common import launched, peakstore
from sparkwatch.common.durable import read_regular
from sparkwatch.common.sources.buddyinfo import page_size_bytes, read_buddyinfo
from sparkwatch.common.sources.checkpoint import read_facts
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.sources.procs import read_descendants, read_rss_bytes
from sparkwatch.core.driver.freeblocks import BuddyinfoError, free_bytes_in_blocks
from sparkwatch.core.engines.enginecli import EngineCommand, EngineKind, recognise
from sparkwatch.core.launch import launchenv, peaks
from sparkwatch.core.launch.nodeplan import Role, Span, rank_facts, role_of, role_terms, span_of
from sparkwatch.core.launch.plan import (
    DEFAULT_MARGIN_BYTES,
    FreeSource,
    Learned,
    MemoryView,
    ModelFacts,
    Plan,
    Reservation,
    budget_warning,
    fix_text,
    miss_reasons,
    plan_launch,
)
from sparkwatch.core.launch.rayletenv import uses_ray
from sparkwatch.core.redact import redact
from sparkwatch.core.units import MiB, format_size

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

CONTIGUOUS_BLOCK_BYTES = 2 * MiB
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of a process's start time in /proc/PID/stat


@dataclass(frozen=True)
class PlanInputs:
    argv: tuple[str, ...]
    budget: int | str | Mapping[str, int | str] | None = None  # bytes, "auto", None, or each role's (head=, worker=)
    margin_bytes: int | None = None
    engine_reads: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    view: Any = None  # an engine in a container (cli.launch_docker.Container): its checkpoint seen through its mounts


@dataclass(frozen=True)
class PlanContext:
    cmd: EngineCommand
    facts: ModelFacts
    key: str
    engine_version: tuple[int, ...] | None
    estimate_bytes: int
    declared: tuple[launched.Declaration, ...] = ()
    took_s: float = 0.0
    record: peaks.PeakRecord | None = None  # what earlier runs with this key measured, confirmed or not
    span: Span | None = None  # the nodes the engine spans (core.launch.nodeplan): the plan is then this node's share
    role: Role = Role.HEAD  # this node's role in it (core.launch.nodeplan.role_of)


def memory_view(settings: Settings, margin_bytes: int | None) -> MemoryView:
    with MeminfoReader(settings.proc_root) as reader:
        mem = reader.read()
    contiguous: int | None = None
    try:
        zones = read_buddyinfo(settings.proc_root)
        if zones is not None:
            contiguous = free_bytes_in_blocks(zones, page_size_bytes(), CONTIGUOUS_BLOCK_BYTES)
    except (OSError, BuddyinfoError):
        contiguous = None
    try:
        cpus = len(os.sched_getaffinity(0))
    except OSError:
        cpus = os.cpu_count() or 1
    return MemoryView(
        total_bytes=mem.total_bytes,
        available_bytes=mem.available_bytes,
        free_bytes=mem.free_bytes,
        cached_bytes=mem.cached_bytes,
        floor_bytes=settings.floor,
        margin_bytes=DEFAULT_MARGIN_BYTES if margin_bytes is None else margin_bytes,
        contiguous_free_bytes=contiguous,
        cpus=cpus,
    )


_DIST_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.\-]+)-(?P<version>\d+(?:\.\d+)*)[^/]*\.dist-info$")


def engine_version(argv: tuple[str, ...], package: str) -> tuple[int, ...] | None:
    """The installed version of `package` next to the interpreter the command runs: the console script's shebang (or
    the python named in argv[0]), then its site-packages' `<package>-X.Y.Z.dist-info`. None when it cannot be told."""
    if not argv:
        return None
    exe = shutil.which(argv[0]) or argv[0]
    python = exe
    if not re.search(r"python[\d.]*$", os.path.basename(exe)):
        try:  # never blocks: a FIFO named like the engine is refused (common.durable)
            first = read_regular(Path(exe), 256, follow_symlinks=True).split(b"\n", 1)[0]
        except OSError:
            return None
        if not first.startswith(b"#!"):
            return None
        python = first[2:].decode(errors="replace").strip().split()[0]
    prefix = Path(python).resolve().parent.parent if Path(python).is_absolute() else None
    if prefix is None:
        return None
    for site in sorted(prefix.glob("lib/python3*/site-packages")):
        for entry in site.glob(f"{package}-*.dist-info"):
            m = _DIST_RE.match(entry.name)
            if m and m.group("name").replace("-", "_").lower() == package:
                return tuple(int(x) for x in m.group("version").split(".")[:3])
    return None


def running(
    settings: Settings, env: Mapping[str, str], now: float
) -> tuple[tuple[launched.Declaration, ...], list[Reservation]]:
    """Engines launched and still running, and every other engine tree (named in a fix, reserving nothing: what it
    holds is already out of MemAvailable). What a declared engine reserves is core.launch.plan.reserve's rule over
    what the kernel says of its tree (RSS, its root's age, whether the engine rules see an engine in it) and its
    launch's plan; the declaration's own word decides only whether it is still booting, which lapses at BOOT_MAX_S."""
    from sparkwatch.common.sources.enginetrees import EngineFinder
    from sparkwatch.core.engines.identity import engine_kinds

    watch = launched.LaunchedWatch.of(env, settings.state_dir, settings.proc_root)
    decls = tuple(d for d in watch.poll() if d.exited_at is None and _alive(d.root_pid, d.start_ticks, settings))
    finder = EngineFinder.from_settings(settings, settings.proc_root, any_user=True)
    try:
        procs, trees = finder.scan()
    except OSError:
        procs, trees = (), []
    engines = set(engine_kinds(procs, finder.rules)) if decls else set()  # the rules alone: no declaration's word
    uptime_s = _uptime_s(settings.proc_root) if decls else None
    me = os.geteuid()
    parents = {p.pid: p.ppid for p in procs}
    out = []
    for d in decls:
        pids = read_descendants(settings.proc_root, [d.root_pid])
        age_s = None if uptime_s is None else max(uptime_s - d.start_ticks / CLOCK_TICKS, 0.0)
        out.append(
            Reservation(
                kind=d.kind,
                root_pid=d.root_pid,
                name=redact(f"{d.kind} {d.model}".strip()),  # another user's words, printed in the plan: redacted
                footprint_bytes=read_rss_bytes(settings.proc_root, pids),
                budget_bytes=d.budget_bytes,
                booting=d.booting,
                estimate_bytes=d.estimate_bytes,
                phase=str(d.phase),
                age_s=age_s,
                engine=any(pid in engines for pid in pids),
                other_uid=None if d.uid == me or d.launch_id.startswith(f"{me}-") else d.uid,  # (a container: yours)
                launched=parents.get(d.root_pid) == d.launcher_pid,
            )
        )
    declared = {d.root_pid for d in decls}
    for tree in trees:
        if tree.root.pid in declared:
            continue
        name = redact(f"{tree.kind} {tree.root.display_name}")
        out.append(Reservation(tree.kind, tree.root.pid, name, tree.rss_bytes))
    return decls, out


def _uptime_s(proc_root: Path) -> float | None:
    """Seconds since boot (<proc_root>/uptime: CLOCK_BOOTTIME, the clock of a process's start ticks)."""
    try:
        return float(read_regular(Path(proc_root) / "uptime", 256).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start_ticks: int, settings: Settings) -> bool:
    from sparkwatch.common.sources.procs import read_start_ticks

    return read_start_ticks(settings.proc_root, pid) == start_ticks


def gather(settings: Settings, inputs: PlanInputs) -> tuple[Plan, PlanContext]:
    """The plan for `inputs.argv` now. Raises ValueError, one line naming the field, for a flag value out of range or
    one the engine would refuse, a MAX_JOBS that is not 1 to JOBS_MAX, and a checkpoint file that is not what it must
    be (common.sources.checkpoint.CheckpointError)."""
    started = time.monotonic()
    cmd = recognise(inputs.argv)
    env = inputs.env
    if cmd.kind == EngineKind.OTHER:
        facts = ModelFacts(source="")
    else:
        read = inputs.view.facts if inputs.view else read_facts  # a container's: through its mounts
        facts = read(cmd.model, env, cmd.flag("download_dir"), cmd.flag("revision"))
    version = engine_version(cmd.argv, "vllm") if cmd.kind == EngineKind.VLLM and not inputs.view else None
    view = memory_view(settings, inputs.margin_bytes)
    span = span_of(cmd, uses_ray(inputs.argv, env))
    role = role_of(cmd) if span is not None else Role.HEAD
    budget = inputs.budget.get(role) if isinstance(inputs.budget, Mapping) else inputs.budget  # this node's role's
    explicit = budget if isinstance(budget, int) else None
    jobs = launchenv.user_jobs(env)
    reads = FreeSource(inputs.engine_reads) if inputs.engine_reads else None
    records = peakstore.load(settings.state_dir)
    key_role = None if span is None else str(role)
    key = peaks.peak_key(cmd, explicit, key_role)
    record = records.get(key)

    def learned_for(command: EngineCommand) -> Learned | None:
        """The measured peak for `command` (the command or a fix of it), once two runs agree (core.launch.peaks)."""
        found = records.get(peaks.peak_key(command, explicit, key_role))
        confirmed = found.learned_bytes if found is not None else None
        if found is None or confirmed is None:
            return None
        return Learned(confirmed, found.estimate_bytes or 0, found.runs, found.ready_s)

    decls, reservations = running(settings, env, time.time())
    plan = plan_launch(
        cmd, facts if span is None else rank_facts(facts, span), view, reservations, learned_for=learned_for,
        budget=budget, jobs=jobs, engine_version=version, engine_reads=reads,
        extra=() if span is None else role_terms(role, span),
    )  # fmt: skip
    if plan.learned is not None and not plan.learned.estimate_bytes:
        plan = replace(plan, learned=replace(plan.learned, estimate_bytes=plan.estimate.needs_bytes))
    ctx = PlanContext(
        cmd=cmd,
        facts=facts,
        key=key,
        engine_version=version,
        estimate_bytes=plan.estimate.needs_bytes,
        declared=decls,
        took_s=time.monotonic() - started,
        record=record,
        span=span,
        role=role,
    )
    return plan, ctx


def replan(settings: Settings, inputs: PlanInputs, ctx: PlanContext) -> tuple[Plan, PlanContext]:
    """The plan again after a fix (the pool changed; the checkpoint did not)."""
    plan, new = gather(settings, inputs)
    return plan, replace(new, facts=ctx.facts)


# --- printing


def _learned_line(plan: Plan, ctx: PlanContext) -> str | None:
    learned = plan.learned
    record = ctx.record
    if learned is None and record is not None and record.recent:
        runs = ", ".join(format_size(b) for b in record.recent)
        return (
            f"measured {runs} in {len(record.recent)} run(s), not used yet: the estimate stands until two runs agree "
            f"within {peaks.AGREE_RATIO:.0%} (sparkwatch launch --forget {shlex.quote(ctx.key)} drops them)"
        )
    if learned is None:
        return None
    err = peaks.error_ratio(plan.estimate.needs_bytes, learned.peak_bytes)
    err_text = "" if err is None else f", estimate {format_size(plan.estimate.needs_bytes)} ({err:+.0%})"
    ready = "" if learned.ready_s is None else f", ready in {learned.ready_s:.0f} s"
    return f"measured peak {format_size(learned.peak_bytes)} over {learned.runs} run(s){err_text}{ready}"


def plan_text(plan: Plan, ctx: PlanContext, short: bool = False) -> str:
    est = plan.estimate
    view = plan.view
    verdict = "fits"
    if not plan.fits:  # the reason, never a bare "short by 0 B"; the fix here too, but where the gate's line follows
        verdict = f"does NOT fit: {'; '.join(miss_reasons(plan, figures=False))}"
        verdict += "" if short else f"; fix: {fix_text(plan)}"
    head = f"sparkwatch: plan for {est.kind}" + (f" {est.model}" if est.model else "")
    if ctx.span is not None:
        head += f" ({ctx.span.how}: this node's share, as the {ctx.role})"
    basis = "measured peak" if plan.learned is not None else "estimate"
    summary = (
        f"{head}: {basis} {format_size(plan.needs_bytes)}, {format_size(max(plan.available_bytes, 0))} free above "
        f"floor {format_size(view.floor_bytes)} + margin {format_size(view.margin_bytes)}: {verdict}"
    )
    if short:
        learned = _learned_line(plan, ctx)
        return summary + (f"\nsparkwatch: {learned}" if learned else "")
    lines = [summary, ""]
    width = max(len(t.name) for t in est.terms)
    for term in est.terms:
        lines.append(f"  {term.name:<{width}}  {format_size(term.bytes):>10}  {term.note}")
    lines.append(f"  {'needs':<{width}}  {format_size(est.needs_bytes):>10}  the peak phase")
    learned = _learned_line(plan, ctx)
    if learned:
        lines.append(f"  {learned}")
    lines.append("")
    lines.append(
        f"  MemAvailable {format_size(view.available_bytes)}, MemFree {format_size(view.free_bytes)}, "
        f"page cache {format_size(view.cached_bytes)}, total {format_size(view.total_bytes)}"
    )
    if view.contiguous_free_bytes is not None:
        lines.append(f"  free in blocks of 2 MiB or more: {format_size(view.contiguous_free_bytes)}")
    reserved = [r for r in plan.reservations if r.reserved_bytes]
    for r in reserved:
        whose = "" if r.other_uid is None else f", another user's: uid {r.other_uid}"
        lines.append(f"  reserved for {r.name} (pid {r.root_pid}{whose}): {format_size(r.reserved_bytes)}, {r.why}")
    check = est.check
    if check is not None and check.required_bytes:
        ok = "ok" if check.ok else "FAILS"
        lines.append(
            f"  engine check: {check.source} {format_size(check.value_bytes)} >= "
            f"{format_size(check.required_bytes)}: {ok} ({check.why})"
        )
    if plan.budget_bytes is not None:
        lines.append(f"  budget: {format_size(plan.budget_bytes)} (declared to the guard: its kill limit for the tree)")
    warning = budget_warning(plan)
    if warning:
        lines.append(f"  WARNING: {warning}")
    if ctx.facts.error and est.kind != EngineKind.OTHER:
        lines.append(f"  note: {ctx.facts.error}")
    for note in (*est.notes, *est.problems):
        lines.append(f"  note: {note}")
    for fix in plan.fixes:
        lines.append(f"  fix: {fix.text}" + (" (--fix applies it)" if fix.automatic else ""))
    return "\n".join(lines)


def plan_json(plan: Plan, ctx: PlanContext) -> dict[str, Any]:
    est = plan.estimate
    view = plan.view
    check = est.check
    learned = plan.learned
    return {
        "fits": plan.fits,
        "needs_bytes": plan.needs_bytes,
        "available_bytes": plan.available_bytes,
        "short_bytes": plan.short_bytes,
        "terms": [{"name": t.name, "bytes": t.bytes, "note": t.note} for t in est.terms],
        "estimate_bytes": est.needs_bytes,
        "kind": str(est.kind),
        "model": est.model,
        "model_source": ctx.facts.source,
        "weight_files": ctx.facts.files,
        "key": ctx.key,
        "engine_version": ".".join(map(str, ctx.engine_version)) if ctx.engine_version else None,
        "engine_check": None
        if check is None
        else {
            "reads": str(check.source),
            "required_bytes": check.required_bytes,
            "value_bytes": check.value_bytes,
            "ok": check.ok,
        },
        "fragmented": plan.fragmented,
        "budget_bytes": plan.budget_bytes,
        "budget_warning": budget_warning(plan),
        "learned": None
        if learned is None
        else {
            "peak_bytes": learned.peak_bytes,
            "estimate_bytes": learned.estimate_bytes,
            "runs": learned.runs,
            "ready_s": learned.ready_s,
            "estimate_error": peaks.error_ratio(est.needs_bytes, learned.peak_bytes),
        },
        "measured_peaks_bytes": list(ctx.record.recent) if ctx.record is not None else [],
        "memory": {
            "total_bytes": view.total_bytes,
            "available_bytes": view.available_bytes,
            "free_bytes": view.free_bytes,
            "cached_bytes": view.cached_bytes,
            "floor_bytes": view.floor_bytes,
            "margin_bytes": view.margin_bytes,
            "contiguous_free_bytes": view.contiguous_free_bytes,
        },
        "reserved": [
            {
                "kind": r.kind,
                "root_pid": r.root_pid,
                "name": r.name,
                "reserved_bytes": r.reserved_bytes,
                "why": r.why,
                "uid": r.other_uid,  # another user's declaration; null: the planning user's own, or undeclared
            }
            for r in plan.reservations
        ],
        "fixes": [
            {
                "action": str(f.action),
                "text": f.text,
                "automatic": f.automatic,
                "flags": [list(pair) for pair in f.flags],
                "max_jobs": f.max_jobs,
            }
            for f in plan.fixes
        ],
        "notes": list(est.notes),
        "problems": list(est.problems),
        "plan_seconds": round(ctx.took_s, 4),
    }
