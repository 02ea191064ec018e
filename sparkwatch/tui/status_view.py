"""`sparkwatch status`: one frame of the live view, from records to rich renderables. No I/O here.

The frame answers, top to bottom: how close is the pool to the floor and how fast is it moving; does a guard run,
and would it kill (armed) or only record (dry run); which engines hold it, and where each launched one is in its
boot; is a compiler burst running and is MAX_JOBS bounding it; is each JIT build moving (objects done / total, rate,
ETA: the answer to "is it hung?" during a 15-minute first boot); what the GPU and the driver say; and the last kill.

Bars are drawn from characters, not rich's progress widgets, so a frame is the same text on a terminal, in a pipe
and in a bug report, and costs a few KiB a second over SSH.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sparkwatch.core.enums import DriverVerdict, JitState, MaxJobsState
from sparkwatch.core.model import (
    BootState,
    CompileCensus,
    DriverReport,
    EngineServing,
    EngineTree,
    GpuHolder,
    GpuReport,
    JitCacheState,
    JitEngineState,
    MemInfo,
    Snapshot,
)
from sparkwatch.core.redact import redact
from sparkwatch.core.report.gates import GatedView
from sparkwatch.core.report.guardstate import GuardState, describe, describe_all
from sparkwatch.core.report.peerchecks import PeerView, peer_line
from sparkwatch.core.report.trend import BuildRate, PoolTrend
from sparkwatch.core.timestamps import parse_rfc3339
from sparkwatch.core.units import GiB, MiB, format_size
from sparkwatch.core.words import plural
from sparkwatch.tui.events_view import local_time

USED, CACHE, FREE, FLOOR_MARK, WARN_MARK = "█", "▒", "░", "┃", "│"
BAR_DONE, BAR_TODO = "█", "░"
LABEL_WIDTH = 10
MAX_JIT_ROWS = 6  # most recently changed caches first; a box with many versions and archs gets "+N more"
# Below this rate the pool is "steady": 0.05 GiB/s is ~250 MiB per 5 s, above the ~100 MiB per 5 s noise.
STEADY_BYTES_PER_S = 0.05 * GiB
# A finished cache untouched this long is history, not a build: shown on one short line.
QUIET_CACHE_S = 600.0


@dataclass(frozen=True, slots=True)
class BuildView:
    cache: JitCacheState
    rate: BuildRate


@dataclass(frozen=True, slots=True)
class StatusFrame:
    snapshot: Snapshot
    host: str
    floor_bytes: int
    warn_headroom_bytes: int
    compile_jobs_alert: int
    trend: PoolTrend
    builds: tuple[BuildView, ...]
    last_kill: Mapping[str, Any] | None
    events_path: str
    driver_error: str | None = None  # the driver check itself failed (Snapshot.driver is then the last good one)
    live: bool = False
    # Wall time of the viewer's first snapshot: a state "since" then may be older; the view says "for ≥ …".
    started_ts: float = 0.0
    # The running guards' published state (common.guardfile), and why any other state file found was not taken.
    guards: tuple[GuardState, ...] = ()
    guard_notes: tuple[str, ...] = ()
    # Containers the after-kill gate holds paused, from the event log (core.report.gates.gated_now).
    gated: tuple[GatedView, ...] = ()
    # Root pid -> the line naming the engine's container (the Docker API's names; its parent is the runtime's shim),
    # and why they are named by id only (the socket could not be read), said once.
    containers: Mapping[int, str] = field(default_factory=dict)
    containers_note: str | None = None
    # The other nodes' agents as this viewer read them (cli.peerread): None without peers (no section).
    peers: tuple[PeerView, ...] | None = None


# --- small formatters


def fmt_duration(seconds: float) -> str:
    """4 s, 3m12s, 2h05m, 3d04h."""
    s = max(int(seconds), 0)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / GiB:.2f} GiB/s" if abs(bytes_per_s) >= 0.01 * GiB else f"{bytes_per_s / MiB:.0f} MiB/s"


def text_bar(fraction: float, width: int) -> str:
    done = min(max(round(fraction * width), 0), width)
    return BAR_DONE * done + BAR_TODO * (width - done)


# --- sections


def pool_bar(mem: MemInfo, floor_bytes: int, warn_headroom_bytes: int, width: int) -> Text:
    """used | page cache | rest of available, with the kill floor and the warn line marked where `used` would hit them.

    The marks sit at MemTotal - floor and MemTotal - floor - warn_headroom: when the used part reaches the floor mark,
    MemAvailable is at the floor and the guard kills.
    """
    total = max(mem.total_bytes, 1)
    used = mem.used_bytes
    cache = min(mem.cached_bytes + mem.buffers_bytes, mem.available_bytes)
    used_cells = min(round(used / total * width), width)
    cache_cells = min(round(cache / total * width), width - used_cells)
    free_cells = width - used_cells - cache_cells
    floor_at = min(max(round((total - floor_bytes) / total * width), 0), width - 1)
    warn_at = min(max(round((total - floor_bytes - warn_headroom_bytes) / total * width), 0), width - 1)
    near = mem.available_bytes <= floor_bytes + warn_headroom_bytes
    used_style = "bold red" if mem.available_bytes <= floor_bytes else ("yellow" if near else "green")
    cells = [(USED, used_style)] * used_cells + [(CACHE, "cyan")] * cache_cells + [(FREE, "dim")] * free_cells
    cells[warn_at] = (WARN_MARK, "yellow")
    cells[floor_at] = (FLOOR_MARK, "bold red")
    bar = Text()
    for char, style in cells:
        bar.append(char, style=style)
    return bar


def pool_lines(frame: StatusFrame, width: int) -> list[Text]:
    mem = frame.snapshot.mem
    if mem is None:
        return [Text("meminfo could not be read this cycle", style="red")]
    bar_width = max(min(width - LABEL_WIDTH - 2, 72), 20)
    numbers = Text(
        f"used {format_size(mem.used_bytes)} · page cache {format_size(mem.cached_bytes + mem.buffers_bytes)} · "
        f"available {format_size(mem.available_bytes)} of {format_size(mem.total_bytes)}"
    )
    headroom = mem.available_bytes - frame.floor_bytes
    marks = Text(
        f"{FLOOR_MARK} floor {format_size(frame.floor_bytes)} ({format_size(headroom)} above)  "
        f"{WARN_MARK} warn at {format_size(frame.floor_bytes + frame.warn_headroom_bytes)}  "
        f"{USED} used {CACHE} cache {FREE} free"
    )
    return [pool_bar(mem, frame.floor_bytes, frame.warn_headroom_bytes, bar_width), numbers, marks, trend_line(frame)]


def trend_line(frame: StatusFrame) -> Text:
    rate = frame.trend.fill_rate_bytes_per_s
    if rate is None:
        return Text("fill rate: measuring (needs a few seconds of samples)", style="dim")
    if abs(rate) < STEADY_BYTES_PER_S:
        return Text(f"fill rate: steady ({fmt_rate(-rate)})")
    if rate < 0:
        return Text(f"fill rate: rising {fmt_rate(-rate)} (memory coming back)")
    eta = frame.trend.seconds_to_floor
    line = Text(f"fill rate: falling {fmt_rate(rate)}", style="yellow")
    if eta is not None:
        line.append(f" · floor in {fmt_duration(eta)}", style="bold red" if eta < 30 else "yellow")
    return line


def guard_lines(guards: Sequence[GuardState], notes: Sequence[str]) -> list[Text]:
    """One line per running guard: armed in green, dry run in yellow; none running in yellow, and why a file found
    was not taken (a dead guard's, another user's) dimmed below it."""
    if not guards:
        out = [Text(f"{describe_all(guards)}: nothing is killed before the pool runs out", style="yellow")]
    else:
        out = [Text(describe(g), style="yellow" if g.dry_run else "green") for g in guards]
    out += [Text(note, style="dim") for note in notes]
    return out


def _boot_for(tree: EngineTree, boots: Sequence[BootState]) -> BootState | None:
    return next((b for b in boots if b.root_pid == tree.root.pid), None)


def boot_text(boot: BootState, now: float) -> str:
    """`launched: phase jit_compile for 3m12s, budget 60.0 GiB` (ready: `ready after 41 s`)."""
    since = fmt_duration(now - boot.phase_since_ts) if boot.phase_since_ts else "?"
    text = f"launched: phase {boot.phase} for {since}"
    if boot.phase == "ready" and boot.ready_s is not None:
        text += f" (ready after {fmt_duration(boot.ready_s)})"
    if boot.budget_bytes:
        text += f", budget {format_size(boot.budget_bytes)}"
    return text


_SERVING_STYLE = {"serving": "green", "busy": "green", "failing": "yellow", "wedged": "bold red", "not_probed": "dim"}


def serving_text(e: EngineServing) -> str:
    """`serving (token in 41 ms)`, `busy: its counters moved, 6 running, …`, `failing: 2 probes (no answer within 10
    s)`, `WEDGED for 1m30s: …`."""
    if e.state == "serving":
        return "serving" + (f" (token in {e.latency_s * 1000:.0f} ms)" if e.latency_s is not None else "")
    if e.state == "not_probed":  # its own socket cannot be reached for certain: no word either way
        return f"not probed: {e.error}" if e.error else "not probed"
    why = f" ({e.error})" if e.error else ""
    if e.state == "busy":  # core.engines.progress: the probe waited, its own counters moved
        running = f", {e.running:.0f} running" if e.running is not None else ""
        return f"busy: its counters moved{running}, the probe waits{why}"
    # An engine with no progress counters is never killed as wedged (kill_wedged_after_s refused for it).
    uncounted = "; no progress counters: never killed as wedged" if e.counted is False else ""
    if e.state == "wedged":
        lasted = f" for {fmt_duration(e.wedged_for_s)}" if e.wedged_for_s is not None else ""
        return f"WEDGED{lasted}: up but not serving, {plural(e.failures, 'probe')} failed{why}{uncounted}"
    return f"failing: {plural(e.failures, 'probe')} failed{why}{uncounted}"


def _jit_state_for(tree: EngineTree, states: Sequence[JitEngineState]) -> JitEngineState | None:
    for state in states:
        if state.root_pid == tree.root.pid:
            return state
    return None


def engine_lines(frame: StatusFrame) -> list[Text]:
    snap = frame.snapshot
    if not snap.engines and not snap.boots:
        return [Text("no engine processes", style="dim")]
    out = []
    roots = {tree.root.pid for tree in snap.engines}
    for tree in snap.engines:
        count = len(tree.members)
        name = redact(tree.root.display_name)
        line = Text(
            f"{tree.kind} {tree.root.pid} · {name} · {plural(count, 'process')} · RSS {format_size(tree.rss_bytes)}"
        )
        boot = _boot_for(tree, snap.boots)
        if boot is not None:
            line.append(f" · {boot_text(boot, snap.ts)}", style="green" if boot.phase == "ready" else "cyan")
        serving = next((e for e in snap.serving if e.root_pid == tree.root.pid), None)
        if serving is not None and serving.state != "unknown":
            line.append(f" · {serving_text(serving)}", style=_SERVING_STYLE.get(serving.state, ""))
        container = frame.containers.get(tree.root.pid)
        if container is not None:
            line.append(f" · {container}", style="cyan")
        state = _jit_state_for(tree, snap.jit_states)
        if state is not None:
            style = {JitState.COMPILING: "cyan", JitState.STALLED: "bold red"}.get(state.state, "")
            since = ""
            if state.since_ts:
                lasted = snap.ts - state.since_ts
                at_least = state.since_ts <= frame.started_ts + 0.5  # began before we looked
                if not (at_least and lasted < 1):
                    since = f" for {'≥ ' if at_least else ''}{fmt_duration(lasted)}"
            line.append(f" · JIT {state.state}{since}", style=style)
            if state.state != JitState.IDLE and state.reason:
                line.append(f": {state.reason}", style="dim")
        out.append(line)
    if frame.containers_note:
        out.append(Text(frame.containers_note, style="dim"))
    for boot in snap.boots:
        if boot.root_pid not in roots:  # declared, but not (yet) an engine tree in this cycle's scan
            out.append(Text(f"{boot.kind} {boot.root_pid} · {redact(boot.model)} · {boot_text(boot, snap.ts)}"))
    return out


def compile_lines(census: CompileCensus | None, jobs_alert: int) -> list[Text]:
    if census is None:
        return [Text("compiler census unavailable this cycle", style="red")]
    live = {tool: n for tool, n in census.tools.items() if n}
    if not live:
        return [Text("no compiler processes", style="dim")]
    total = sum(live.values())
    tools = " · ".join(f"{tool} {n}" for tool, n in live.items())
    head = Text(f"{plural(total, 'process')}, {format_size(census.rss_bytes)} RSS: {tools}")
    jobs = Text(
        f"{census.parallel_jobs} parallel nvcc/cicc jobs", style="bold red" if census.parallel_jobs > jobs_alert else ""
    )
    if census.archs:
        jobs.append(" · arch " + ", ".join(census.archs))
    if census.outside_engines:
        jobs.append(f" · {census.outside_engines} outside any engine")
    out = [head, jobs]
    for eng in census.engines:
        if not eng.tools:
            # Only trees compiling now: without a compiler the answer comes from the engine's own environ, which
            # setproctitle (the VLLM::EngineCore title) overwrites with NULs: "unset" there would be a false alarm.
            continue
        tools_here = " · ".join(f"{tool} {n}" for tool, n in eng.tools.items())
        text = Text(f"{eng.kind} {eng.root_pid}: {tools_here} · ")
        if eng.max_jobs_state == MaxJobsState.SET:
            text.append(f"MAX_JOBS={eng.max_jobs} (from the {eng.max_jobs_source}'s environment)")
        elif eng.max_jobs_state == MaxJobsState.UNSET:
            text.append(
                f"MAX_JOBS unset in the {eng.max_jobs_source}'s environment: ninja runs one job per core; "
                "set MAX_JOBS=4 (with Ray, in every raylet's environment)",
                style="yellow" if eng.tools else "",
            )
        else:
            text.append("MAX_JOBS unknown (environment not readable)", style="dim")
        out.append(text)
    return out


def _cache_name(cache: JitCacheState) -> str:
    name = " ".join(part for part in (cache.cache, cache.version, cache.arch) if part)
    return f"{name} ({cache.where})" if cache.where else name  # a container's own cache: whose


def jit_lines(builds: Sequence[BuildView], now: float, width: int) -> list[Text]:
    if not builds:
        return [Text("no JIT caches found", style="dim")]
    ordered = sorted(builds, key=lambda b: -b.cache.last_change_ts)
    out = []
    name_width = max(len(_cache_name(b.cache)) for b in ordered[:MAX_JIT_ROWS])
    for build in ordered[:MAX_JIT_ROWS]:
        c = build.cache
        age = now - c.last_change_ts if c.last_change_ts else None
        changed = f" · changed {fmt_duration(age)} ago" if age is not None else ""
        line = Text(f"{_cache_name(c):<{name_width}}  ")
        if c.objects_total == 0:
            line.append(f"{format_size(c.bytes)} in {c.files} files", style="dim")
            line.append(changed, style="dim")
        elif c.objects_done >= c.objects_total and (age is None or age > QUIET_CACHE_S):
            line.append(
                f"complete: {c.objects_total} objects, {c.modules_built} modules, {format_size(c.bytes)}", style="dim"
            )
            line.append(changed, style="dim")
        else:
            counts = f" {c.objects_done}/{c.objects_total} objects · {c.modules_built}/{c.modules_total} modules"
            tail = counts + _rate_text(build.rate, c) + changed
            # The bar takes what the row leaves, 10 to 30 cells, so the row fits on one line where it can.
            bar_width = min(max(width - LABEL_WIDTH - 2 - len(line.plain) - len(tail), 10), 30)
            line.append(text_bar(c.objects_done / c.objects_total, bar_width), style="cyan")
            line.append(counts + _rate_text(build.rate, c))
            line.append(changed, style="dim")
        if c.error:
            line.append(f" · partly unreadable: {c.error}", style="red")
        out.append(line)
    if len(ordered) > MAX_JIT_ROWS:
        out.append(Text(f"+{len(ordered) - MAX_JIT_ROWS} more caches", style="dim"))
    return out


def _rate_text(rate: BuildRate, cache: JitCacheState) -> str:
    if cache.objects_done >= cache.objects_total:
        return " · done"
    if rate.objects_per_s is None:
        return " · rate: measuring"
    if rate.objects_per_s <= 0:
        return f" · no object finished for {fmt_duration(rate.idle_s)}"
    per_min = rate.objects_per_s * 60
    eta = f" · ETA {fmt_duration(rate.eta_s)}" if rate.eta_s is not None else ""
    return f" · {per_min:.1f} objects/min{eta}"


# GPU holders listed by name in the status view; the rest are counted (`sparkwatch engines --all` lists them all).
MAX_UNKNOWN_HOLDER_LINES = 3


def gpu_lines(gpu: GpuReport | None, unknown: Sequence[GpuHolder] = ()) -> list[Text]:
    """Fields NVML does not support on a GB10 are None and left out, never shown as 0. GPU holders no engine rule
    names are listed after the devices: the guard would not kill them (unless guard_gpu_holders is on)."""
    if gpu is None:
        return [Text("no GPU source", style="dim")]
    if not gpu.up:
        code = gpu.nvml_return_code
        why = gpu.error or (f"NVML error {code}" if code is not None else "NVML not answering")
        return [Text(f"GPU not available: {why}", style="yellow")]
    if not gpu.devices:
        return [Text("NVML is up but lists no GPU", style="yellow")]
    out = []
    for dev in gpu.devices:
        parts = [dev.name]
        if dev.power_watts is not None:
            parts.append(f"{dev.power_watts:.0f} W")
        if dev.utilization_ratio is not None:
            parts.append(f"{dev.utilization_ratio * 100:.0f} % util")
        if dev.temperature_celsius is not None:
            parts.append(f"{dev.temperature_celsius:.0f} °C")
        if dev.sm_clock_hertz is not None:
            parts.append(f"SM {dev.sm_clock_hertz / 1e9:.2f} GHz")
        if gpu.driver_version:
            parts.append(f"driver {gpu.driver_version}")
        out.append(Text(" · ".join(parts)))
    for holder in unknown[:MAX_UNKNOWN_HOLDER_LINES]:
        used = "" if holder.used_gpu_memory_bytes is None else f" {format_size(holder.used_gpu_memory_bytes)}"
        name = redact(holder.proc.display_name)
        out.append(Text(f"not an engine: {holder.proc.pid} {name}{used} (the guard does not kill it)", style="yellow"))
    if len(unknown) > MAX_UNKNOWN_HOLDER_LINES:
        out.append(Text(f"… and {len(unknown) - MAX_UNKNOWN_HOLDER_LINES} more: sparkwatch engines --all", style="dim"))
    return out


def driver_lines(driver: DriverReport | None, error: str | None = None) -> list[Text]:
    """The drift verdict (core.driver.drift) and its sentence."""
    out = []
    if driver is None and error is None:
        out.append(Text("not checked yet", style="dim"))
    if driver is not None:
        styles = {
            DriverVerdict.OK: "green",
            DriverVerdict.ABSENT: "dim",
            DriverVerdict.STRANDED: "bold red",
            DriverVerdict.WILL_STRAND: "bold red",
        }
        style = styles.get(driver.verdict, "yellow")
        out.append(Text(f"{driver.verdict}: {driver.summary}" if driver.summary else driver.verdict, style=style))
    if error is not None:
        out.append(Text(f"driver check failed: {error}", style="red"))
    return out


def kill_lines(
    last_kill: Mapping[str, Any] | None, events_path: str, now: float, tz: tzinfo | None = None
) -> list[Text]:
    if last_kill is None:
        return [Text(f"none recorded in {events_path}", style="dim")]
    when = local_time(last_kill.get("ts"), tz)
    age = ""
    ts = last_kill.get("ts")
    if isinstance(ts, str):
        try:
            age = f" ({fmt_duration(now - datetime.fromisoformat(ts).timestamp())} ago)"
        except ValueError:
            age = ""
    dry = " [dry run]" if last_kill.get("dry_run") else ""
    return [Text(f"{when}{age}{dry}  {last_kill.get('summary', '')}", style="red")]


def gated_lines(gated: Sequence[GatedView], now: float, tz: tzinfo | None = None) -> list[Text]:
    """`vllm-qwen (nvcr.io/nvidia/vllm:25.09, 3f2a9c1b7d4e) paused since 14:02:11 (40 s): restarted after a guard
    kill; unpaused once the pool has settled and 61.0 GiB (kill footprint) fits`"""
    out = []
    for g in gated:
        image = f"{g.image}, " if g.image else ""
        since = parse_rfc3339(g.since)
        age = f" ({fmt_duration(now - since)})" if since is not None else ""
        need = f" and {format_size(g.need_bytes)} ({g.need_source}) fits" if g.need_bytes else ""
        out.append(
            Text(
                f"{g.name} ({image}{g.container_id[:12]}) paused since {local_time(g.since, tz)}{age}: restarted "
                f"after a guard kill; unpaused once the pool has settled{need}",
                style="yellow",
            )
        )
    return out


def peer_lines(peers: Sequence[PeerView]) -> list[Text]:
    """One line a peer (core.report.peerchecks.peer_line): proven and answering in green, display-only in yellow,
    silent in red."""
    if not peers:
        return [Text("reading…", style="dim")]
    out = []
    for v in peers:
        style = "red" if v.error is not None else ("green" if v.proof is not None else "yellow")
        out.append(Text(peer_line(v), style=style))
    return out


def collector_lines(snapshot: Snapshot) -> list[Text]:
    return [Text(f"{c.name}: {c.error or 'failed'}", style="red") for c in snapshot.collectors if not c.success]


def render(frame: StatusFrame, width: int, tz: tzinfo | None = None) -> RenderableType:
    snap = frame.snapshot
    grid = Table.grid(padding=(0, 1))
    grid.add_column(width=LABEL_WIDTH, no_wrap=True, style="bold")
    grid.add_column(overflow="fold")

    def section(label: str, lines: Sequence[Text]) -> None:
        for i, line in enumerate(lines):
            grid.add_row(label if i == 0 else "", line)

    stamp = datetime.fromtimestamp(snap.ts, tz).strftime("%Y-%m-%d %H:%M:%S")
    hint = " · q or Ctrl-C quits" if frame.live else ""
    header = Text(f"sparkwatch status · {frame.host} · {stamp}{hint}", style="bold")
    section("POOL", pool_lines(frame, width))
    section("GUARD", guard_lines(frame.guards, frame.guard_notes))
    if frame.peers is not None:
        section("PEERS", peer_lines(frame.peers))
    section("ENGINES", engine_lines(frame))
    section("COMPILERS", compile_lines(snap.compile, frame.compile_jobs_alert))
    section("JIT", jit_lines(frame.builds, snap.ts, width))
    section("GPU", gpu_lines(snap.gpu, snap.gpu_unknown))
    section("DRIVER", driver_lines(snap.driver, frame.driver_error))
    section("LAST KILL", kill_lines(frame.last_kill, frame.events_path, snap.ts, tz))
    if frame.gated:
        section("GATED", gated_lines(frame.gated, snap.ts, tz))
    errors = collector_lines(snap)
    if errors:
        section("ERRORS", errors)
    return Group(header, grid)
