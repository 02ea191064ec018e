#!/usr/bin/env python3
"""Generate sparkwatch/data/grafana/dashboards/sparkwatch-node.json, the dashboard users import (shipped in the wheel).

Plain Python and the standard library on purpose (docs/grafana.md says why): `python3 grafana/build.py` rewrites the
JSON, `python3 grafana/build.py --check` exits 1 when the committed JSON is not what this file generates.

Every query filters on `job=~"$job",instance=~"$instance"` and keeps the `instance` label, so two Sparks of a
tensor-parallel pair show side by side: the pool picture repeats per instance, every other panel draws one line per
node with `{{instance}}` in the legend.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUTPUT = HERE.parent / "sparkwatch" / "data" / "grafana" / "dashboards" / "sparkwatch-node.json"  # package data

UID = "sparkwatch-node"
# Grafana 10.0 writes schemaVersion 38; later versions migrate it forward on load, earlier ones cannot read panels
# such as state-timeline with these options.
SCHEMA_VERSION = 38
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job",instance=~"$instance"'
# The config default of warn_headroom (4 GiB): used only for an exporter older than
# sparkwatch_memory_warn_headroom_bytes, so the warn line is drawn either way.
DEFAULT_WARN_HEADROOM_BYTES = 4 * 1024**3

Json = dict[str, Any]


def m(name: str, extra: str = "") -> str:
    """A selector for sparkwatch_<name> on the chosen job(s) and instance(s)."""
    return f"sparkwatch_{name}{{{SEL}{',' + extra if extra else ''}}}"


WARN_HEADROOM = f"({m('memory_warn_headroom_bytes')} or {m('memory_floor_bytes')} * 0 + {DEFAULT_WARN_HEADROOM_BYTES})"
GPU_PROCESS_BYTES = (
    f"(sum by (job, instance) ({m('gpu_process_memory_bytes')}) or {m('memory_used_bytes')} * 0)"  # 0 without NVML
)


class Target:
    def __init__(self, expr: str, legend: str, *, instant: bool = False, table: bool = False) -> None:
        self.expr = expr
        self.legend = legend
        self.instant = instant
        self.table = table

    def to_json(self, ref_id: str) -> Json:
        out: Json = {
            "datasource": DS,
            "editorMode": "code",
            "expr": self.expr,
            "legendFormat": self.legend,
            "range": not self.instant,
            "instant": self.instant,
            "refId": ref_id,
        }
        if self.table:
            out["format"] = "table"
        return out


def targets(items: Sequence[Target]) -> list[Json]:
    return [t.to_json(chr(ord("A") + i)) for i, t in enumerate(items)]


def thresholds(*steps: tuple[float | None, str]) -> Json:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in steps]}


def value_map(mapping: dict[int, tuple[str, str]]) -> list[Json]:
    return [
        {
            "type": "value",
            "options": {
                str(value): {"text": text, "color": color, "index": i}
                for i, (value, (text, color)) in enumerate(mapping.items())
            },
        }
    ]


def override(matcher_id: str, matcher_value: str, props: dict[str, Any]) -> Json:
    return {
        "matcher": {"id": matcher_id, "options": matcher_value},
        "properties": [{"id": key, "value": value} for key, value in props.items()],
    }


# A reference line in a stacked chart: not stacked, dashed, no fill.
def line_override(ref_id: str, color: str) -> Json:
    return override(
        "byFrameRefID",
        ref_id,
        {
            "custom.stacking": {"mode": "none", "group": "A"},
            "custom.fillOpacity": 0,
            "custom.lineWidth": 2,
            "custom.lineStyle": {"fill": "dash", "dash": [10, 10]},
            "color": {"mode": "fixed", "fixedColor": color},
        },
    )


def timeseries(
    title: str,
    description: str,
    unit: str,
    items: Sequence[Target],
    *,
    w: int = 8,
    h: int = 8,
    stack: bool = False,
    fill: int = 10,
    draw: str = "line",
    overrides: Iterable[Json] = (),
    min_value: float | None = None,
    max_value: float | None = None,
    steps: Json | None = None,
    threshold_style: str = "off",
    mappings: list[Json] | None = None,
    repeat: str | None = None,
) -> Json:
    defaults: Json = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": draw,
            "lineWidth": 1,
            "fillOpacity": 60 if stack else fill,
            "gradientMode": "none",
            "lineInterpolation": "stepAfter" if draw == "bars" else "linear",
            "showPoints": "never",
            "spanNulls": False,
            "axisPlacement": "auto",
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": threshold_style},
        },
        "thresholds": steps or thresholds((None, "green")),
        "mappings": mappings or [],
    }
    if min_value is not None:
        defaults["min"] = min_value
    if max_value is not None:
        defaults["max"] = max_value
    panel: Json = {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets(items),
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "_size": (w, h),
    }
    if repeat:
        panel.update({"repeat": repeat, "repeatDirection": "h", "maxPerRow": 2})
    return panel


def stat(
    title: str,
    description: str,
    unit: str,
    items: Sequence[Target],
    *,
    w: int = 4,
    h: int = 4,
    steps: Json | None = None,
    mappings: list[Json] | None = None,
    color_mode: str = "background",
    no_value: str | None = None,
) -> Json:
    defaults: Json = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": steps or thresholds((None, "green")),
        "mappings": mappings or [],
    }
    if no_value is not None:
        defaults["noValue"] = no_value
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets(items),
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": color_mode,
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": "value_and_name",
        },
        "_size": (w, h),
    }


def state_timeline(
    title: str, description: str, items: Sequence[Target], mappings: list[Json], *, w: int = 24, h: int = 5
) -> Json:
    return {
        "type": "state-timeline",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets(items),
        "fieldConfig": {
            "defaults": {
                "unit": "none",
                "color": {"mode": "thresholds"},
                "thresholds": thresholds((None, "green")),
                "mappings": mappings,
                "custom": {"fillOpacity": 80, "lineWidth": 0},
            },
            "overrides": [],
        },
        "options": {
            "mergeValues": True,
            "showValue": "auto",
            "alignValue": "left",
            "rowHeight": 0.9,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "single", "sort": "none"},
        },
        "_size": (w, h),
    }


def table(title: str, description: str, items: Sequence[Target], *, w: int = 12, h: int = 5) -> Json:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets(items),
        "fieldConfig": {
            "defaults": {"unit": "none", "color": {"mode": "thresholds"}, "thresholds": thresholds((None, "green"))},
            "overrides": [],
        },
        "options": {"showHeader": True, "cellHeight": "sm"},
        # Instant table queries carry Time and Value columns that say nothing here.
        "transformations": [
            {"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True, "__name__": True}}}
        ],
        "_size": (w, h),
    }


def row(title: str) -> Json:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


OK_BAD = thresholds((None, "green"), (1, "red"))
BAD_OK = thresholds((None, "red"), (1, "green"))


def pool_row() -> list[Json]:
    return [
        row("Unified memory pool (CPU and GPU share it: there is no VRAM)"),
        timeseries(
            "Unified pool: $instance",
            "The whole 121.7 GiB pool of one node as one stack, from the bottom: available beyond page cache, page "
            "cache (reclaimable, so part of available), other used, and memory held by GPU processes (from NVML; "
            "GPU allocations never show in RSS). The top of the page-cache band is MemAvailable: when it sinks to "
            "the red floor line the guard kills the engine trees, the orange line is where the headroom alert "
            "fires. A flat GPU band with a growing 'other used' band during a boot is the compiler burst.",
            "bytes",
            [
                Target(f"clamp_min({m('memory_available_bytes')} - {m('memory_cached_bytes')}, 0)", "available"),
                # Page cache, but never above MemAvailable (Cached includes shmem, which is not reclaimable). The
                # outer max keeps one series whichever side of the `or` answers, so the band never splits in two.
                Target(
                    f"max by (job, instance) (({m('memory_cached_bytes')} <= on (job, instance) "
                    f"{m('memory_available_bytes')}) or on (job, instance) {m('memory_available_bytes')})",
                    "page cache",
                ),
                Target(
                    f"clamp_min({m('memory_used_bytes')} - on (job, instance) {GPU_PROCESS_BYTES}, 0)", "other used"
                ),
                Target(GPU_PROCESS_BYTES, "GPU processes"),
                Target(m("memory_floor_bytes"), "floor (kill)"),
                Target(f"{m('memory_floor_bytes')} + on (job, instance) {WARN_HEADROOM}", "warn"),
            ],
            w=24,  # repeated per instance: Grafana splits the row, two Sparks side by side
            h=10,
            stack=True,
            min_value=0,
            overrides=[
                line_override("E", "red"),
                line_override("F", "orange"),
                override("byFrameRefID", "A", {"color": {"mode": "fixed", "fixedColor": "green"}}),
                override("byFrameRefID", "B", {"color": {"mode": "fixed", "fixedColor": "blue"}}),
                override("byFrameRefID", "C", {"color": {"mode": "fixed", "fixedColor": "yellow"}}),
                override("byFrameRefID", "D", {"color": {"mode": "fixed", "fixedColor": "purple"}}),
            ],
            repeat="instance",
        ),
        timeseries(
            "Headroom above the floor",
            "MemAvailable minus the kill floor, per node. Zero is a kill. Under the dashed warn line (warn_headroom) "
            "the headroom alert fires. During engine start-up profiling it can fall by 20-30 GiB in under 10 s, so "
            "the guard, not this graph, is what saves the box.",
            "bytes",
            [
                Target(f"{m('memory_available_bytes')} - on (job, instance) {m('memory_floor_bytes')}", "{{instance}}"),
                Target(WARN_HEADROOM, "{{instance}} warn headroom"),
            ],
            overrides=[line_override("B", "orange")],
            steps=thresholds((None, "red"), (0, "transparent")),
            threshold_style="line",
        ),
        timeseries(
            "Fill rate",
            "How fast the pool fills (bytes per second; positive means MemAvailable is falling), smoothed the way the "
            "guard smooths it. The guard fires early when this rate would reach the floor within its kill budget. "
            "Spikes of several GiB/s are an engine profiling or a compiler burst.",
            "binBps",
            [Target(m("memory_fill_rate_bytes_per_second"), "{{instance}}")],
        ),
        timeseries(
            "Memory pressure (PSI)",
            "Share of wall time tasks stalled waiting for memory (from /proc/pressure/memory). 'some': at least one "
            "task stalled; 'full': all non-idle tasks stalled at once. Without swap PSI rises late: sustained 'full' "
            "above a few percent means reclaim is thrashing the page cache a model needs.",
            "percentunit",
            [Target(f"rate({m('memory_pressure_stalled_seconds_total')}[$__rate_interval])", "{{instance}} {{kind}}")],
            min_value=0,
        ),
    ]


def guard_row() -> list[Json]:
    return [
        row("Guard"),
        stat(
            "Guard mode",
            "ARMED: the guard will SIGKILL engine trees at the floor. DRY RUN: it decides and records, signals "
            "nothing; its decisions show below as would-kills, never as kills.",
            "none",
            [Target(m("guard_dry_run"), "{{instance}}")],
            w=6,
            mappings=value_map({0: ("ARMED", "green"), 1: ("DRY RUN", "orange")}),
            steps=thresholds((None, "green"), (1, "orange")),
        ),
        stat(
            "Last kill",
            "When the guard last killed on each node; 'never' since the daemon started (the series appears with "
            "the first kill). After a silent engine death, a recent time here is the cause: run `sparkwatch events` "
            "on that node.",
            "dateTimeFromNow",
            [Target(f"{m('guard_last_kill_timestamp_seconds')} * 1000", "{{instance}}")],
            w=6,
            color_mode="none",
            no_value="never",
        ),
        stat(
            "Kill duration p50 / p99 (time range)",
            "Detection to the last victim reaped, over the dashboard's time range. Target: median under 150 ms. "
            "Empty (NaN) when no kill happened in the range.",
            "s",
            [
                Target(
                    "histogram_quantile(0.5, sum by (instance, le) "
                    f"(increase({m('guard_kill_duration_seconds_bucket')}[$__range])))",
                    "{{instance}} p50",
                    instant=True,
                ),
                Target(
                    "histogram_quantile(0.99, sum by (instance, le) "
                    f"(increase({m('guard_kill_duration_seconds_bucket')}[$__range])))",
                    "{{instance}} p99",
                    instant=True,
                ),
            ],
            w=12,
            steps=thresholds((None, "green"), (0.15, "orange"), (1, "red")),
        ),
        timeseries(
            "Poll interval and loop age",
            "How long the guard sleeps between meminfo reads: 1 s with lots of headroom, 50-100 ms near the floor. "
            "A node sitting at the fast end for long is living close to the floor. The loop age (dashed) is the "
            "time since the guard last ran: it stays under the poll interval; a growing one is a stuck guard.",
            "s",
            [
                Target(m("guard_poll_interval_seconds"), "{{instance}} poll interval"),
                Target(m("guard_loop_age_seconds"), "{{instance}} loop age"),
            ],
            min_value=0,
            overrides=[
                override(
                    "byFrameRefID",
                    "B",
                    {"custom.lineStyle": {"fill": "dash", "dash": [10, 10]}, "custom.fillOpacity": 0},
                )
            ],
        ),
        timeseries(
            "Kills",
            "Engine-tree kills per interval, by trigger ('floor': MemAvailable at the floor; 'predicted': the fill "
            "rate would reach it within the kill budget), and the processes they took. Each kill is also an "
            "annotation on every time graph. In dry run the guard's decisions are would-kills: nothing was signalled.",
            "short",
            [
                Target(
                    f"sum by (instance, trigger) (increase({m('guard_kills_total')}[$__rate_interval]))",
                    "{{instance}} kills ({{trigger}})",
                ),
                Target(
                    f"sum by (instance) (increase({m('guard_killed_processes_total')}[$__rate_interval]))",
                    "{{instance}} processes killed",
                ),
                Target(
                    f"sum by (instance, trigger) (increase({m('guard_would_kills_total')}[$__rate_interval]))",
                    "{{instance}} would kill, dry run ({{trigger}})",
                ),
            ],
            draw="bars",
            fill=80,
            min_value=0,
        ),
        timeseries(
            "Kill duration quantiles",
            "p50 and p99 of detection-to-reaped time, over a sliding 10-minute window: a line appears only around "
            "kills. Rising values mean the killer waits on processes stuck in the driver.",
            "s",
            [
                Target(
                    "histogram_quantile(0.5, sum by (instance, le) "
                    f"(rate({m('guard_kill_duration_seconds_bucket')}[10m])))",
                    "{{instance}} p50",
                ),
                Target(
                    "histogram_quantile(0.99, sum by (instance, le) "
                    f"(rate({m('guard_kill_duration_seconds_bucket')}[10m])))",
                    "{{instance}} p99",
                ),
            ],
            min_value=0,
        ),
    ]


# Per engine tree: 0 idle, 1 compiling, 2 stalled (3 cannot happen in a state set; shown as stalled all the same).
JIT_COMPILING = m("jit_state", 'state="compiling"')
JIT_STALLED = m("jit_state", 'state="stalled"')
BY_ENGINE = "max by (instance, engine, pid)"
JIT_STATE_CODE = f"{BY_ENGINE} ({JIT_COMPILING}) + 2 * {BY_ENGINE} ({JIT_STALLED})"
# 1 set, 2 unset, 3 unknown: compile_max_jobs is a state set per engine tree holding compilers.
MAX_JOBS_CODE = " + ".join(
    f"{weight} * {BY_ENGINE} ({m('compile_max_jobs', 'state=' + json.dumps(state))})"
    for weight, state in ((1, "set"), (2, "unset"), (3, "unknown"))
)
JIT_DONE = m("jit_build_objects", 'state="done"')
JIT_TOTAL = m("jit_build_objects", 'state="total"')
JIT_STATE_MAP = value_map(
    {0: ("idle", "green"), 1: ("compiling", "blue"), 2: ("stalled", "red"), 3: ("stalled", "red")}
)


def boot_row() -> list[Json]:
    return [
        row("Long boot: compiling, not hung"),
        timeseries(
            "GPU power and utilization during boot",
            "Power (left axis) and utilization (right axis) on the same time axis as the compiler census below. "
            "The first boot of a model shape reads 12-13 W and 0 % GPU for 10-20 minutes while flashinfer "
            "JIT-compiles on the CPU: that is not a hang if compilers run and the JIT cache grows. Decoding reads "
            "36-42 W. Empty without an NVIDIA GPU.",
            "watt",
            [
                Target(f"sum by (instance) ({m('gpu_power_watts')})", "{{instance}} power"),
                Target(f"avg by (instance) ({m('gpu_utilization_ratio')})", "{{instance}} utilization"),
            ],
            w=24,
            h=7,
            min_value=0,
            overrides=[
                override(
                    "byFrameRefID",
                    "B",
                    {"unit": "percentunit", "custom.axisPlacement": "right", "min": 0, "max": 1},
                )
            ],
        ),
        timeseries(
            "Compiler census by tool",
            "Compiler processes by tool (ninja, nvcc, cicc, ptxas, fatbinary, cc1plus). Healthy with MAX_JOBS=4: "
            "7-9 in total. 20 or more is the default one-job-per-core burst: each nvcc/cicc holds 3-8 GiB, so it "
            "can drain 70 GiB (the red line, right axis, is their total RSS). Set MAX_JOBS=4 in the raylet's "
            "environment, not just the shell.",
            "short",
            [
                Target(f"sum by (instance, tool) ({m('compile_processes')})", "{{instance}} {{tool}}"),
                Target(f"sum by (instance) ({m('compile_rss_bytes')})", "{{instance}} compiler RSS"),
            ],
            w=12,
            stack=True,
            min_value=0,
            steps=thresholds((None, "transparent"), (10, "orange")),
            threshold_style="dashed",
            overrides=[
                # What the burst costs the pool, on the right axis, as a line over the stacked counts.
                override(
                    "byFrameRefID",
                    "B",
                    {
                        "unit": "bytes",
                        "custom.axisPlacement": "right",
                        "custom.stacking": {"mode": "none", "group": "A"},
                        "custom.fillOpacity": 0,
                        "custom.lineWidth": 2,
                        "color": {"mode": "fixed", "fixedColor": "red"},
                    },
                )
            ],
        ),
        timeseries(
            "Engine processes",
            "Processes in each engine tree (vLLM, Ray workers, llama.cpp, ...). A drop to zero with no kill on this "
            "node while the peer shows a kill is the tensor-parallel peer dying from the other node's kill.",
            "short",
            [Target(f"sum by (instance, engine) ({m('engine_processes')})", "{{instance}} {{engine}}")],
            w=12,
            min_value=0,
        ),
        table(
            "Engines in containers",
            "The containers engine trees run in, as `docker ps` names them: name, image, compose project and "
            "service, restart policy (always, unless-stopped and on-failure start an engine the guard killed again) "
            "and network mode, per node. Empty where every engine runs bare or no Docker API answers "
            "(docs/containers.md).",
            [
                Target(
                    f"max by (instance, name, image, compose_project, compose_service, restart_policy, network_mode, "
                    f"id) ({m('container_info')})",
                    "",
                    instant=True,
                    table=True,
                )
            ],
            w=12,
        ),
        state_timeline(
            "MAX_JOBS per engine tree",
            "For each engine tree that holds compilers: whether MAX_JOBS is set in the environment its compilers "
            "inherit. UNSET means ninja starts one job per core (20 on a Spark) and the burst can drain the pool. "
            "With Ray the raylet's environment is what counts: export MAX_JOBS=4 before `ray start` on every node. "
            "unknown: the environment is unreadable (another user's or a container's process).",
            [Target(MAX_JOBS_CODE, "{{instance}} {{engine}} {{pid}}")],
            value_map({1: ("set", "green"), 2: ("UNSET", "red"), 3: ("unknown", "orange")}),
            w=6,
            h=5,
        ),
        timeseries(
            "JIT cache size",
            "Bytes in the flashinfer JIT cache(s), per node, version and arch. During a first boot it must grow: "
            "growth while GPU reads 0 % is the proof the engine is compiling, not hung. A version bump starts a "
            "new (cold) series.",
            "bytes",
            [Target(f"sum by (instance, version, arch) ({m('jit_cache_bytes')})", "{{instance}} {{version}}/{{arch}}")],
            w=9,
            h=5,
            min_value=0,
        ),
        timeseries(
            "JIT build progress",
            "Finished objects over the targets in build.ninja, per node. It climbs in steps through a first boot "
            "(about 15 of 25 minutes) and sits at 100 % when the cache is warm.",
            "percentunit",
            [
                Target(
                    f"sum by (instance) ({JIT_DONE}) / sum by (instance) ({JIT_TOTAL})",
                    "{{instance}}",
                )
            ],
            w=9,
            h=5,
            min_value=0,
            max_value=1,
        ),
        state_timeline(
            "JIT state",
            "idle: no compile; compiling: compilers run or the cache grows; stalled: an engine waits, no compiler "
            "runs and the cache has not changed for jit_stall_s (default 5 min). Stalled is the only state worth "
            "acting on: look for a stale lock under cached_ops/tmp/.",
            [Target(JIT_STATE_CODE, "{{instance}} {{engine}} {{pid}}")],
            JIT_STATE_MAP,
        ),
    ]


# Per launched engine: its boot phase as a code (sparkwatch launch; engine_boot_phase is a state set).
BOOT_PHASES = ("starting", "loading_weights", "jit_compile", "profiling", "cuda_graphs", "ready")
BY_LAUNCHED = "max by (instance, engine, pid, model)"
BOOT_PHASE_CODE = " + ".join(
    f"{i} * {BY_LAUNCHED} ({m('engine_boot_phase', 'phase=' + json.dumps(phase))})"
    for i, phase in enumerate(BOOT_PHASES)
)
BOOT_PHASE_COLOURS = ("purple", "blue", "orange", "yellow", "light-blue", "green")
BOOT_PHASE_MAP = value_map({i: (p, c) for i, (p, c) in enumerate(zip(BOOT_PHASES, BOOT_PHASE_COLOURS, strict=True))})


def launch_row() -> list[Json]:
    return [
        row("Launched engines: boot phases and budgets"),
        state_timeline(
            "Boot timeline",
            "Each engine started with `sparkwatch launch`, phase by phase, from the engine's own log lines: "
            "starting, loading_weights, jit_compile (torch.compile or flashinfer's JIT), profiling (the run that "
            "sizes the KV cache: where a Spark's boot overshoots), cuda_graphs, ready. A first boot takes 15 "
            "minutes or more; the annotations mark each phase change.",
            [Target(BOOT_PHASE_CODE, "{{instance}} {{engine}} {{model}} {{pid}}")],
            BOOT_PHASE_MAP,
            w=24,
            h=6,
        ),
        timeseries(
            "Footprint against budget",
            "What each budgeted engine tree holds in the unified pool, counted once (RSS or its scope's "
            "memory.current, plus NVML's per-process GPU bytes; the pool's drop since launch while it boots "
            "alone), against its budget (dashed). Past the budget by max(2 %, 256 MiB) the guard kills that tree "
            "alone, however far the pool is from the floor.",
            "bytes",
            [
                Target(
                    f"max by (instance, engine, pid, name) ({m('engine_footprint_bytes')})",
                    "{{instance}} {{engine}} {{name}} footprint",
                ),
                Target(
                    f"max by (instance, engine, pid, name) ({m('engine_budget_bytes')})",
                    "{{instance}} {{engine}} {{name}} budget",
                ),
            ],
            w=12,
            min_value=0,
            overrides=[override("byFrameRefID", "B", {"custom.lineStyle": {"fill": "dash", "dash": [10, 10]}})],
        ),
        timeseries(
            "Time to ready",
            "Seconds from launch to ready per launched engine: a warm restart of the same model takes a fraction "
            "of the first boot (compiled kernels and graphs are cached).",
            "s",
            [Target(f"max by (instance, engine, model) ({m('engine_ready_seconds')})", "{{instance}} {{model}}")],
            w=12,
            min_value=0,
        ),
        state_timeline(
            "Serving",
            "Whether each engine gives a token: sparkwatch sends a one-token completion to the engine's own port "
            "every 30 s (5 s after a failure). NOT SERVING while the process lives is the failure a health check "
            "misses (it answers 200 for dead engines): three in a row is engine_wedged. Empty while an engine boots.",
            [Target(f"max by (instance, engine, pid) ({m('engine_serving')})", "{{instance}} {{engine}} {{pid}}")],
            value_map({0: ("NOT SERVING", "red"), 1: ("serving", "green")}),
            w=12,
            h=6,
        ),
        timeseries(
            "Time to a token",
            "The serving probe's last good one-token completion per engine, connect to answer: what a client's "
            "shortest request waits for now.",
            "s",
            [
                Target(
                    f"max by (instance, engine, pid) ({m('engine_probe_latency_seconds')})",
                    "{{instance}} {{engine}} {{pid}}",
                )
            ],
            w=12,
            h=6,
            min_value=0,
        ),
    ]


GROUP_TRIGGER = 'trigger="group_teardown"'


def group_row() -> list[Json]:
    return [
        row("Two Sparks, one engine: groups over Ray"),
        table(
            "Groups over Ray",
            "Each engine that spans nodes over Ray (its placement group, driver and ranks), as each node's agent "
            "reads it from Ray's state: members alive and dead per node and role. A dead member with others still "
            "alive is a group the teardown did not reach; each node's agent stops its own members within 5 s "
            "(docs/multinode.md). Empty on a node without Ray.",
            [
                Target(f"max by (instance, group, node, role) ({m('group_members')})", "", instant=True, table=True),
                Target(
                    f"max by (instance, group, node, role) ({m('group_dead_members')})", "", instant=True, table=True
                ),
            ],
            w=12,
            h=6,
        ),
        timeseries(
            "Ray nodes",
            "1 while Ray marks the node alive, 0 once it marks it dead (its raylet missed the GCS health check, "
            "about 15 s): a lost node stops every engine that spans it.",
            "none",
            [Target(f"min by (instance, node) ({m('ray_node_up')})", "{{instance}} sees {{node}}")],
            w=6,
            h=6,
            min_value=0,
            max_value=1,
        ),
        timeseries(
            "Group teardowns",
            "This node's members of a group stopped after the group lost a member elsewhere (guard kills with "
            "trigger group_teardown), and the time from the death in Ray's state to this node's members reaped.",
            "s",
            [
                Target(
                    f"sum by (instance) (increase({m('guard_kills_total', GROUP_TRIGGER)}[$__rate_interval]))",
                    "{{instance}} teardowns",
                ),
                Target(
                    "histogram_quantile(0.5, sum by (instance, le) "
                    f"(increase({m('guard_group_teardown_duration_seconds_bucket')}[1h])))",
                    "{{instance}} median time (1 h)",
                ),
            ],
            w=6,
            h=6,
            min_value=0,
        ),
    ]


def gpu_row() -> list[Json]:
    return [
        row("GPU (GB10: no memory clock, no VRAM; used memory is in the pool above)"),
        stat(
            "NVML",
            "Whether sparkwatch reads the GPU through NVML. DOWN on a Spark means the driver is not loaded or "
            "mismatched: see the driver row.",
            "none",
            [Target(m("gpu_up"), "{{instance}}")],
            w=4,
            h=7,
            mappings=value_map({0: ("DOWN", "red"), 1: ("up", "green")}),
            steps=BAD_OK,
        ),
        timeseries(
            "GPU power",
            "Board power draw. Idle in P0: 11-16 W; JIT compiling: 12-13 W; decoding: 36-42 W.",
            "watt",
            [Target(m("gpu_power_watts"), "{{instance}} gpu {{gpu}}")],
            w=10,
            h=7,
            min_value=0,
        ),
        timeseries(
            "GPU utilization",
            "Share of time a kernel ran. 0 % during a first boot's JIT compile is expected; 0 % with no compiler "
            "and no JIT cache growth is a stall.",
            "percentunit",
            [Target(m("gpu_utilization_ratio"), "{{instance}} gpu {{gpu}}")],
            w=10,
            h=7,
            min_value=0,
            max_value=1,
        ),
        timeseries(
            "GPU temperature",
            "GPU die temperature. Compare the two nodes: a node much hotter than its peer under the same load "
            "throttles its SM clock and slows the whole tensor-parallel pair.",
            "celsius",
            [Target(m("gpu_temperature_celsius"), "{{instance}} gpu {{gpu}}")],
        ),
        timeseries(
            "SM clock",
            "Streaming-multiprocessor clock (GB10 max: 3003 MHz). A clock well under the peer's at equal load is "
            "thermal or power throttling.",
            "hertz",
            [Target(m("gpu_sm_clock_hertz"), "{{instance}} gpu {{gpu}}")],
            min_value=0,
        ),
        timeseries(
            "GPU energy rate",
            "Rate of the GPU's total-energy counter, in joules per second (watts): it cross-checks the power "
            "reading, and integrates over spikes the 1 s power samples miss.",
            "watt",
            [Target(f"rate({m('gpu_energy_joules_total')}[$__rate_interval])", "{{instance}} gpu {{gpu}}")],
            min_value=0,
        ),
    ]


def kernel_row() -> list[Json]:
    return [
        row("The driver's view: free memory by block size, NVRM and Xid lines from the kernel log"),
        timeseries(
            "Free memory the driver can get",
            "MemAvailable and MemFree beside the free memory in blocks of at least 2 MiB and 64 KiB "
            "(/proc/buddyinfo). The GPU driver allocates large blocks: a fragmented pool can have GiBs free "
            "while the 2 MiB line is low, and the driver then fails (NV_ERR_NO_MEMORY) before MemAvailable says so.",
            "bytes",
            [
                Target(m("memory_available_bytes"), "{{instance}} MemAvailable"),
                Target(m("memory_free_bytes"), "{{instance}} MemFree"),
                Target(m("memory_free_contiguous_bytes"), "{{instance}} free in blocks >= {{min_block}}"),
            ],
            w=12,
            h=8,
            min_value=0,
        ),
        timeseries(
            "NVRM errors",
            "NVIDIA driver error lines per minute, by kind. no_memory / alloc_failed are allocation failures: "
            "within warn_headroom of the floor the guard counts one as a floor crossing (kill trigger "
            "driver_alloc_failed); above it, it alerts.",
            "short",
            [
                Target(
                    f"sum by (instance, kind) (increase({m('kernel_nvrm_errors_total')}[1m]))", "{{instance}} {{kind}}"
                )
            ],
            w=6,
            h=8,
            draw="bars",
            min_value=0,
        ),
        timeseries(
            "GPU Xid events",
            "Xid events per minute by code. 48, 63, 64, 74, 79, 95, 119, 120 and friends mean the GPU needs a reset "
            "or the box a reboot (the SparkwatchGpuXidNeedsReset alert pages); 13, 31, 43 are usually the "
            "application's. `sparkwatch doctor` lists the recent ones.",
            "short",
            [
                Target(
                    f"sum by (instance, code) (increase({m('kernel_xid_total')}[1m])) > 0", "{{instance}} Xid {{code}}"
                )
            ],
            w=6,
            h=8,
            draw="bars",
            min_value=0,
        ),
        stat(
            "Kernel log",
            "Whether sparkwatch can read /dev/kmsg. BLIND: a user unit on a box with kernel.dmesg_restrict=1 (the "
            "Ubuntu default) sees no NVRM or Xid line; run the system unit or set dmesg_restrict=0. "
            "`sparkwatch doctor` says which.",
            "none",
            [Target(m("kernel_log_readable"), "{{instance}}")],
            w=6,
            h=5,
            mappings=value_map({0: ("BLIND", "orange"), 1: ("readable", "green")}),
            steps=thresholds((None, "orange"), (1, "green")),
        ),
        timeseries(
            "Kernel-log lines dropped",
            "Kernel-log records per second that sparkwatch did not read: overwritten in the kernel's ring, or "
            "skipped over its 2000 lines/s bound during a flood. Non-zero only under a log storm.",
            "short",
            [Target(f"rate({m('kernel_log_dropped_lines_total')}[$__rate_interval])", "{{instance}}")],
            w=18,
            h=5,
            min_value=0,
        ),
    ]


def driver_row() -> list[Json]:
    return [
        row("Driver and sparkwatch itself"),
        stat(
            "Driver stranded",
            "STRANDED: the running kernel has no NVIDIA modules (a DGX OS update removed them) or the loaded module "
            "does not match user space. GPU work fails until a human runs `sudo apt full-upgrade` and reboots; "
            "`sparkwatch doctor` prints the exact commands.",
            "none",
            [Target(m("driver_stranded"), "{{instance}}")],
            w=4,
            h=5,
            mappings=value_map({0: ("ok", "green"), 1: ("STRANDED", "red")}),
            steps=OK_BAD,
        ),
        stat(
            "Next boot",
            "Whether the kernel that boots next has NVIDIA modules. WILL STRAND: do not reboot until "
            "`sudo apt full-upgrade` installed linux-modules-nvidia for it.",
            "none",
            [Target(m("driver_next_boot_ok"), "{{instance}}")],
            w=4,
            h=5,
            mappings=value_map({0: ("WILL STRAND", "red"), 1: ("ok", "green")}),
            steps=BAD_OK,
        ),
        stat(
            "Reboot required",
            "/run/reboot-required exists: an update waits for a reboot. Check 'Next boot' before rebooting.",
            "none",
            [Target(m("reboot_required"), "{{instance}}")],
            w=4,
            h=5,
            mappings=value_map({0: ("no", "green"), 1: ("REBOOT", "orange")}),
            steps=thresholds((None, "green"), (1, "orange")),
        ),
        table(
            "Driver and sparkwatch versions",
            "Running kernel, the NVIDIA module version on disk and the one loaded, and the sparkwatch version, per "
            "node. Two nodes of a tensor-parallel pair should match row for row.",
            [
                Target(m("driver_info"), "", instant=True, table=True),
                Target(m("build_info"), "", instant=True, table=True),
            ],
            w=12,
        ),
        stat(
            "Scrape up",
            "Whether Prometheus reaches each node's sparkwatch. DOWN on a node that still pings is the signature of "
            "a wedged Spark (SSH times out during banner exchange).",
            "none",
            [Target(f"up{{{SEL}}}", "{{instance}}")],
            w=6,
            h=6,
            mappings=value_map({0: ("DOWN", "red"), 1: ("up", "green")}),
            steps=BAD_OK,
        ),
        state_timeline(
            "Collectors",
            "Each source of the telemetry, per node: ok or FAILING. A failing collector never stops the guard; the "
            "daemon's journal (`journalctl --user -u sparkwatch`) says why.",
            [Target(m("collector_success"), "{{instance}} {{collector}}")],
            value_map({0: ("FAILING", "red"), 1: ("ok", "green")}),
            w=9,
            h=6,
        ),
        timeseries(
            "Collector duration",
            "Time each collector took per cycle. The telemetry cycle is about 1 s: a collector near that (NVML "
            "under a hung driver) is one to look at; the guard does not wait on any of them.",
            "s",
            [Target(m("collector_duration_seconds"), "{{instance}} {{collector}}")],
            w=9,
            h=6,
            min_value=0,
        ),
    ]


def layout(panels: list[Json]) -> list[Json]:
    """Give each panel an id and a gridPos: left to right, wrapping at 24 columns, rows full width."""
    x = y = line_h = 0
    out: list[Json] = []
    for panel_id, panel in enumerate(panels, start=1):
        if panel["type"] == "row":
            y += line_h
            x = line_h = 0
            w, h = 24, 1
        else:
            w, h = panel.pop("_size")
            if x + w > 24:
                y += line_h
                x = line_h = 0
        placed = {"id": panel_id, "gridPos": {"h": h, "w": w, "x": x, "y": y}, **panel}
        out.append(placed)
        if panel["type"] == "row":
            y += 1
        else:
            x += w
            line_h = max(line_h, h)
    return out


def variables() -> list[Json]:
    def query_var(name: str, label: str, query: str) -> Json:
        return {
            "type": "query",
            "name": name,
            "label": label,
            "datasource": DS,
            "definition": query,
            "query": {"query": query, "refId": f"PrometheusVariableQueryEditor-{name}", "qryType": 1},
            "refresh": 2,  # on time range change: a node that joins shows up
            "multi": True,
            "includeAll": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
            "regex": "",
            "hide": 0,
            "options": [],
        }

    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Prometheus",
            "query": "prometheus",
            "current": {},
            "refresh": 1,
            "regex": "",
            "hide": 0,
            "options": [],
        },
        query_var("job", "Job", "label_values(sparkwatch_build_info, job)"),
        query_var("instance", "Node", 'label_values(sparkwatch_build_info{job=~"$job"}, instance)'),
    ]


def annotation_queries() -> list[Json]:
    return [
        {
            "builtIn": 1,
            "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True,
            "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts",
            "type": "dashboard",
        },
        {
            "name": "Guard kills",
            "datasource": DS,
            "enable": True,
            "hide": False,
            "iconColor": "red",
            # The kills counter (exported at 0 from the start) sees the first kill; the timestamp gauge, which appears
            # with the first kill, marks later ones even across a counter reset. Step 15 s: within 15 s of the kill.
            "expr": f"sum by (job, instance) (increase({m('guard_kills_total')}[1m])) > 0"
            f" or changes({m('guard_last_kill_timestamp_seconds')}[1m]) > 0",
            "step": "15s",
            "titleFormat": "sparkwatch killed engines on {{instance}}",
            "textFormat": "run `sparkwatch events` on {{instance}} for victims and numbers",
            "tagKeys": "instance,job",
            "useValueForTime": False,
        },
        {
            "name": "Boot phases",
            "datasource": DS,
            "enable": True,
            "hide": False,
            "iconColor": "blue",
            # The phase a launched engine is in, at the step where it entered it (its since-timestamp changed).
            "expr": f"({m('engine_boot_phase')} == 1) and on (job, instance, engine, pid, model) "
            f"(changes({m('engine_boot_phase_since_timestamp_seconds')}[1m]) > 0)",
            "step": "15s",
            "titleFormat": "{{engine}} {{model}}: {{phase}}",
            "textFormat": "pid {{pid}} on {{instance}}",
            "tagKeys": "instance,engine,phase",
            "useValueForTime": False,
        },
        {
            "name": "Previous boot",
            "datasource": DS,
            "enable": True,
            "hide": False,
            "iconColor": "purple",
            # The gauge's value is when the previous boot ended (unix seconds); with useValueForTime Grafana takes
            # the value as the annotation's time, in milliseconds (its Prometheus AnnotationQueryEditor.tsx, "Series
            # value as timestamp"): the mark sits where the box went down, not where sparkwatch came back. A clean
            # shutdown is not marked.
            "expr": m("previous_boot_end_timestamp_seconds", 'class!="clean"') + " * 1000",
            "step": "60s",
            "titleFormat": "previous boot ended: {{class}} on {{instance}}",
            "textFormat": "run `sparkwatch postmortem` on {{instance}}: the evidence and the last minute",
            "tagKeys": "instance,job,class",
            "useValueForTime": True,
        },
    ]


def dashboard() -> Json:
    panels = layout(
        [*pool_row(), *guard_row(), *kernel_row(), *boot_row(), *launch_row(), *group_row(), *gpu_row(), *driver_row()]
    )
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "stat", "name": "Stat", "version": ""},
            {"type": "panel", "id": "state-timeline", "name": "State timeline", "version": ""},
            {"type": "panel", "id": "table", "name": "Table", "version": ""},
        ],
        "uid": UID,
        "title": "sparkwatch: DGX Spark nodes",
        "description": "The unified memory pool, the OOM guard, long engine boots, the GPU and the driver, for one "
        "or more DGX Spark nodes side by side. Built by grafana/build.py from the sparkwatch repository.",
        "tags": ["sparkwatch", "dgx-spark", "gpu"],
        "editable": True,
        "graphTooltip": 1,  # shared crosshair: power, compilers and the pool line up in time
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "refresh": "10s",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "id": None,
        "links": [],
        "templating": {"list": variables()},
        "annotations": {"list": annotation_queries()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs from the output")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text(encoding="utf-8") if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is stale: run python3 grafana/build.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.parent.mkdir(parents=True, exist_ok=True)
    OUTPUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
