"""The one list of metric families sparkwatch exports: name, type, labels, when it is present, what it means.

The tests hold the exporter to it both ways (every family it exports is listed with this type and these labels, and
every listed family is exported in the full scenario), hold the dashboard and the alert rules to it (they may only
query names listed here), and check that docs/contract.md's metrics table is `markdown_table()` verbatim.
Add a family here in the same change that makes the exporter publish it.

Names are prefixed `sparkwatch_`, in base units; a counter is listed with its `_total` suffix, as Prometheus sees it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sparkwatch.core.driver.nvmlcodes import meanings_text
from sparkwatch.core.enums import DriverVerdict, JitState, MaxJobsState
from sparkwatch.core.launch.bootphase import BootPhase

MetricType = Literal["gauge", "counter", "histogram"]

# When a family is present. A series that is not known is absent, never 0.
Presence = Literal["always", "meminfo", "guard", "guard_loop", "kill", "events", "outbox", "delivered", "telemetry",
                   "psi", "gpu", "gpu_device", "gpu_field", "driver", "daemon", "launched", "budget",
                   "postmortem", "ray", "ray_group", "peer", "probed", "shm", "gated", "container"]  # fmt: skip
PRESENCE: dict[Presence, str] = {
    "always": "always",
    "meminfo": "once /proc/meminfo was read (the guard's read, else the telemetry's)",
    "guard": "while the guard runs in this process",
    "guard_loop": "once the guard loop has run",
    "kill": "after the first kill",
    "events": "with an event log (the daemon)",
    "outbox": "with a webhook configured",
    "delivered": "after the first delivered alert",
    "telemetry": "once the telemetry has run a cycle",
    "psi": "when the kernel has PSI (/proc/pressure/memory)",
    "gpu": "when the GPU source is on (NVML)",
    "gpu_device": "per GPU, while NVML is up, for each field NVML supports on it (absent on NOT_SUPPORTED, never 0)",
    "gpu_field": "per GPU and field, while that field fails with another code than NOT_SUPPORTED",
    "driver": "once the drift watcher has checked",
    "daemon": "in the daemon (`sparkwatch run`), from both of its processes",
    "launched": "per engine `sparkwatch launch` declared, while its root runs",
    "budget": "per budgeted engine tree, as the guard last measured it (launch --budget, io.sparkwatch.budget or "
    "engine_budgets)",
    "postmortem": "in the daemon once the previous boot was judged (`postmortem = true`, the default)",
    "ray": "in the daemon while a raylet runs on this node and Ray's state API answered once",
    "ray_group": "per engine group over Ray (a live placement group) this node's Ray lists, node and role",
    "peer": "in the daemon, per configured peer (`peers`) once it answered",
    "probed": "per engine whose endpoint the serving probe knows, once it was probed (`probe_interval_s` > 0; an "
    "engine whose socket is out of reach, `not_probed`, has none)",
    "shm": "in the daemon once /dev/shm was scanned (at start, every 60 s, 10 s after an engine tree ended) and every "
    "process could be read (root: the system unit); absent while a process of another user cannot be",
    "gated": "per container the after-kill gate holds paused (`container_after_kill = gate`), while it does",
    "container": "per container holding an engine tree, while the Docker API answers (`docker_host`)",
}


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    type: MetricType
    labels: tuple[str, ...]
    present: Presence
    meaning: str  # docs/contract.md's column: what the series means to someone reading a dashboard
    help: str  # the exposition's `# HELP` line (the golden file holds it): the collector takes it from here


PREFIX = "sparkwatch_"


def _m(
    name: str, type_: MetricType, labels: str, present: Presence, meaning: str, *, help: str | None = None
) -> MetricSpec:
    return MetricSpec(PREFIX + name, type_, tuple(labels.split()), present, meaning, help or meaning)


_GPU = "gpu uuid"  # per-GPU series carry only these; identity is on gpu_info
_JIT = "cache version arch"

METRICS: tuple[MetricSpec, ...] = (
    _m("build_info", "gauge", "version", "always", "sparkwatch version; always 1", help="sparkwatch version, always 1"),
    # the pool (/proc/meminfo) and the guard
    _m("memory_total_bytes", "gauge", "", "meminfo", "MemTotal: the unified CPU+GPU pool"),
    _m("memory_available_bytes", "gauge", "", "meminfo", "MemAvailable: what the guard compares with the floor"),
    _m("memory_free_bytes", "gauge", "", "meminfo", "MemFree"),
    _m("memory_cached_bytes", "gauge", "", "meminfo", "Cached (page cache)"),
    _m(
        "memory_used_bytes", "gauge", "", "meminfo", "MemTotal - MemAvailable: the honest used figure on a unified pool"
    ),
    _m(
        "memory_floor_bytes",
        "gauge",
        "",
        "always",
        "the guard's MemAvailable kill floor",
        help="The guard's MemAvailable kill floor",
    ),
    _m(
        "memory_warn_headroom_bytes",
        "gauge",
        "",
        "always",
        "low_headroom alerts within this of the floor",
        help="low_headroom alerts when MemAvailable is within this of the floor",
    ),
    _m(
        "memory_fill_rate_bytes_per_second",
        "gauge",
        "",
        "guard",
        "smoothed fall rate of MemAvailable (+: filling)",
        help="Smoothed rate at which MemAvailable falls (positive: filling)",
    ),
    _m(
        "memory_pressure_stalled_seconds_total",
        "counter",
        "kind",
        "psi",
        'PSI stall time, kind="some|full"',
        help="Cumulative time tasks stalled on memory (PSI), some or all non-idle tasks",
    ),
    _m(
        "guard_poll_interval_seconds",
        "gauge",
        "",
        "guard",
        "the guard's current poll interval",
        help="The guard's current poll interval",
    ),
    _m(
        "guard_kills_total",
        "counter",
        "trigger",
        "guard",
        "kills of engine trees, by trigger (each exported at 0); never moves in dry run",
        help="Kills of engine trees, by trigger",
    ),
    _m(
        "guard_would_kills_total",
        "counter",
        "trigger",
        "guard",
        "dry run: engine trees the guard chose and did not signal, by trigger (each exported at 0); a dry run moves "
        "no kill counter",
        help="Dry run: engine trees the guard would have killed, by trigger (nothing was signalled)",
    ),
    _m(
        "guard_kills_cancelled_total",
        "counter",
        "",
        "guard",
        "firings cancelled: MemAvailable recovered between the choice of a victim and the signal",
        help="Firings cancelled because MemAvailable recovered between the decision and the signal",
    ),
    _m(
        "guard_kill_loops_total",
        "counter",
        "",
        "guard",
        "kill loops: the same engine killed again and again (a supervisor restarting it into the spike)",
        help="Kill loops detected (an engine restarted into the same spike)",
    ),
    _m(
        "guard_killed_processes_total",
        "counter",
        "",
        "guard",
        "processes SIGKILLed by the guard",
        help="Processes SIGKILLed by the guard",
    ),
    _m(
        "guard_last_kill_timestamp_seconds",
        "gauge",
        "",
        "kill",
        "when the guard last fired",
        help="When the guard last fired",
    ),
    _m(
        "guard_kill_duration_seconds",
        "histogram",
        "",
        "guard",
        "from detection to the last victim reaped",
        help="From detection to the last victim reaped",
    ),
    _m(
        "guard_group_teardown_duration_seconds",
        "histogram",
        "",
        "guard",
        "from a group's lost member in Ray's state to this node's members of it reaped (goal: 5 s)",
        help="From a group's lost member in Ray's state to this node's members of it reaped",
    ),
    _m("guard_dry_run", "gauge", "", "guard", "1 if the guard decides but signals nothing"),
    _m(
        "guard_armed",
        "gauge",
        "",
        "guard",
        "0 while waiting for memory to come back after a kill",
        help="0 during a kill episode (until memory is back above floor + rearm_headroom)",
    ),
    _m("guard_meminfo_errors_total", "counter", "", "guard", "/proc/meminfo reads or parses that failed"),
    _m(
        "guard_loop_age_seconds",
        "gauge",
        "",
        "guard_loop",
        "seconds since the guard loop last ran: a stuck guard grows it",
        help="Seconds since the guard loop last ran (a stuck guard grows this)",
    ),
    # engines that span nodes over Ray (telemetry.raywatch; docs/multinode.md)
    _m(
        "group_members",
        "gauge",
        "group node role",
        "ray_group",
        "members of an engine group Ray lists alive, by node (its IP) and role (driver, rank)",
    ),
    _m(
        "group_dead_members",
        "gauge",
        "group node role",
        "ray_group",
        "members of a live engine group Ray lists dead: above 0 for long, a teardown did not happen",
    ),
    _m("ray_node_up", "gauge", "node", "ray", "1 while Ray marks the node (its IP) alive, 0 once it marks it dead"),
    _m(
        "group_teardown_requests_total",
        "counter",
        "",
        "ray",
        "teardowns of this node's members of a group that lost one, handed to the guard",
    ),
    _m(
        "group_placement_groups_removed_total",
        "counter",
        "",
        "ray",
        "placement groups still held after this node's teardown, removed through Ray",
    ),
    _m(
        "peer_lost",
        "gauge",
        "peer node",
        "peer",
        "1 while the peer is lost: no answer at all for 3 reads (timed out or its host unreachable: the node is "
        "wedged, down or cut off), or no document taken for peer_lost_after_s whatever it answered (refused, an HTTP "
        "error, a bad proof); 0 while it gives documents",
    ),
    _m(
        "peer_proven",
        "gauge",
        "peer node",
        "peer",
        "1 when the peer's documents are proven (peer_key_file, or mutual TLS), 0 when it is display-only: its word "
        "moves nothing (no teardown, worker budget or kill word)",
    ),
    _m(
        "listen_port_taken_seconds",
        "gauge",
        "",
        "daemon",
        "how long another process held this agent's port (listen) before it bound it; 0 when bound at once. Meanwhile "
        "that process answered as this node (sparkwatch doctor names it)",
    ),
    _m(
        "container_gated",
        "gauge",
        "name id",
        "gated",
        "1 while a container (its name, and its id's 12 digits) is held paused: its restart policy started it again "
        "after the guard killed its engine, and it waits for the pool to settle and its peak to fit "
        "(docs/containers.md)",
    ),
    _m(
        "previous_boot_end_timestamp_seconds",
        "gauge",
        "class",
        "postmortem",
        "when the previous boot ended, and how: `class` is clean, kernel_oom, driver_no_memory, xid, sparkwatch_kill, "
        "abrupt or unknown (`sparkwatch postmortem` says why)",
        help="When the previous boot ended (unix seconds), labelled with how it ended",
    ),
    _m(
        "event_log_write_errors_total",
        "counter",
        "",
        "events",
        "events that could not be made durable in events.jsonl",
        help="Events that could not be made durable in events.jsonl (unwritable or full state dir)",
    ),
    # alert delivery
    _m(
        "alerts_pending",
        "gauge",
        "",
        "outbox",
        "alerts spooled and not yet acknowledged by the webhook",
        help="Alerts spooled and not yet acknowledged by the webhook",
    ),
    _m(
        "alerts_delivered_total",
        "counter",
        "",
        "outbox",
        "alerts the webhook acknowledged (2xx)",
        help="Alerts the webhook acknowledged (2xx)",
    ),
    _m(
        "alert_delivery_failures_total",
        "counter",
        "",
        "outbox",
        "failed delivery attempts (refused, timeout, non-2xx)",
        help="Failed delivery attempts (refused, timeout, non-2xx)",
    ),
    _m(
        "alert_spool_errors_total",
        "counter",
        "",
        "outbox",
        "alerts that could not be spooled to disk (kept in memory)",
        help="Alerts that could not be spooled to disk (kept in memory)",
    ),
    _m(
        "alerts_dropped_total",
        "counter",
        "",
        "outbox",
        "undelivered alerts dropped, oldest first, at the outbox cap",
        help="Undelivered alerts dropped, oldest first, at the outbox cap",
    ),
    _m(
        "alert_spool_quarantined_total",
        "counter",
        "",
        "outbox",
        "spool files moved to outbox/bad/ (not an event id, unparseable)",
        help="Spool files moved to outbox/bad/ (not an event id, unparseable)",
    ),
    _m(
        "alert_outbox_restarts_total",
        "counter",
        "",
        "outbox",
        "times the outbox worker crashed and was restarted",
        help="Times the outbox worker crashed and was restarted",
    ),
    _m(
        "alert_last_delivery_timestamp_seconds",
        "gauge",
        "",
        "delivered",
        "when the webhook last acknowledged one",
        help="When the webhook last acknowledged an alert",
    ),
    # engines, compilers, JIT caches (the telemetry)
    _m(
        "engine_processes",
        "gauge",
        "engine",
        "telemetry",
        "processes in engine trees, by engine kind",
        help="Processes in engine trees, by engine",
    ),
    _m("engine_rss_bytes", "gauge", "engine", "telemetry", "RSS of engine trees (GPU memory not included)"),
    _m(
        "engine_gpu_memory_bytes",
        "gauge",
        "engine",
        "gpu",
        'NVML per-process GPU memory summed per engine tree (engine="other": in no tree); while NVML is up',
        help=(
            "GPU memory of engine trees (NVML per-process, summed per tree; 'other' for the rest): the share of the "
            "unified pool that RSS and cgroups cannot see"
        ),
    ),
    _m(
        "compile_processes",
        "gauge",
        "tool",
        "telemetry",
        "live compiler processes by tool (every tool, 0 when none)",
        help="Live compiler processes, by tool",
    ),
    _m(
        "compile_rss_bytes",
        "gauge",
        "",
        "telemetry",
        "total RSS of compiler processes",
        help="Total RSS of compiler processes",
    ),
    _m(
        "compile_parallel_jobs",
        "gauge",
        "",
        "telemetry",
        "nvcc + cicc processes: what MAX_JOBS bounds",
        help="nvcc + cicc processes: the parallelism MAX_JOBS bounds",
    ),
    _m(
        "compile_arch_processes",
        "gauge",
        "arch",
        "telemetry",
        "compiler processes by target CUDA arch (121a: GB10)",
        help="Compiler processes by the CUDA arch they target",
    ),
    _m(
        "compile_engine_processes",
        "gauge",
        "engine pid",
        "telemetry",
        "compiler processes inside each engine tree",
        help="Compiler processes inside each engine tree",
    ),
    _m(
        "compile_max_jobs",
        "gauge",
        "engine pid state",
        "telemetry",
        f"MAX_JOBS in the environment an engine's compilers inherit, a state set: state={'|'.join(MaxJobsState)}",
        help="Whether MAX_JOBS is set in the environment an engine's compilers inherit (state set)",
    ),
    _m(
        "compile_outside_engine_processes",
        "gauge",
        "",
        "telemetry",
        "compiler processes in no engine tree",
        help="Compiler processes in no engine tree (a pip build, a make)",
    ),
    _m(
        "jit_cache_bytes",
        "gauge",
        _JIT,
        "telemetry",
        "bytes in a JIT cache (flashinfer <version>/<arch>, vllm)",
        help="Bytes in a JIT cache",
    ),
    _m("jit_cache_files", "gauge", _JIT, "telemetry", "files in a JIT cache", help="Files in a JIT cache"),
    _m(
        "jit_cache_last_change_timestamp_seconds",
        "gauge",
        _JIT,
        "telemetry",
        "newest mtime in a JIT cache",
        help="Newest mtime in a JIT cache",
    ),
    _m(
        "jit_build_objects",
        "gauge",
        f"{_JIT} state",
        "telemetry",
        'build.ninja object targets, state="done|total"',
        help="Object files built against build.ninja targets",
    ),
    _m(
        "jit_build_modules",
        "gauge",
        f"{_JIT} state",
        "telemetry",
        'JIT modules, state="built|total"',
        help="JIT modules (build.ninja dirs) and those linked",
    ),
    _m(
        "jit_state",
        "gauge",
        "engine pid state",
        "telemetry",
        f"per engine tree, a state set: state={'|'.join(JitState)}",
        help="Per engine: idle, compiling or stalled (state set)",
    ),
    _m(
        "engine_boot_phase",
        "gauge",
        "engine pid model phase",
        "launched",
        f"a launched engine's boot phase, a state set: phase={'|'.join(p for p in BootPhase if p != 'exited')}",
        help="A launched engine's boot phase (state set, from its own log lines)",
    ),
    _m(
        "engine_boot_phase_since_timestamp_seconds",
        "gauge",
        "engine pid model",
        "launched",
        "when the launched engine entered its current boot phase",
        help="When the launched engine entered its current boot phase",
    ),
    _m(
        "engine_ready_seconds",
        "gauge",
        "engine pid model",
        "launched",
        "launch to ready, once the engine is ready",
        help="Seconds from launch to ready",
    ),
    _m(
        "engine_budget_bytes",
        "gauge",
        "engine pid name source",
        "budget",
        "the tree's memory budget (source=launch|peer|label|config; label: its container's io.sparkwatch.budget)",
        help="A budgeted engine tree's memory budget",
    ),
    _m(
        "engine_footprint_bytes",
        "gauge",
        "engine pid name",
        "budget",
        "what the tree holds, counted once: max(RSS, cgroup) + its pids' NVML bytes (never the pool's drop)",
        help="A budgeted engine tree's footprint (RSS or cgroup, plus GPU, or pool drop while it boots alone)",
    ),
    _m(
        "engine_footprint_peak_bytes",
        "gauge",
        "engine pid name",
        "budget",
        "the largest footprint the guard measured for the tree",
        help="A budgeted engine tree's largest measured footprint",
    ),
    _m(
        "engine_serving",
        "gauge",
        "engine pid",
        "probed",
        "1: the last one-token completion got a token, or it waited while the engine's own counters moved (busy); 0: "
        "failing or wedged (absent while booting, not listening, or not probed: its socket out of reach)",
        help="1 if the engine's last one-token completion answered (the serving probe)",
    ),
    _m(
        "engine_probe_latency_seconds",
        "gauge",
        "engine pid",
        "probed",
        "connect to answer of the last good one-token completion",
        help="Seconds the engine's last good one-token completion took",
    ),
    _m(
        "engine_probe_failures",
        "gauge",
        "engine pid",
        "probed",
        "failed probes in a row (engine_wedged at probe_failures_wedged)",
        help="The engine's failed one-token completions in a row",
    ),
    _m(
        "engine_progress_counters",
        "gauge",
        "engine pid",
        "probed",
        "1: the engine served progress counters at the look after a failed probe (a wedge is proven by them before "
        "kill_wedged_after_s acts); 0: it serves none, it is never killed as wedged (absent until a probe failed)",
        help="1 if the engine serves the progress counters that tell busy from wedged",
    ),
    _m(
        "container_info",
        "gauge",
        "id name image compose_project compose_service restart_policy network_mode",
        "container",
        "a container an engine tree runs in, as `docker ps` names it; always 1. id: the full id; compose_project, "
        "compose_service: empty outside compose; restart_policy: no, always, unless-stopped, on-failure "
        "(docs/containers.md)",
        help="A container an engine tree runs in (name, image, compose service, restart policy); always 1",
    ),
    _m("collector_success", "gauge", "collector", "telemetry", "1 if the source worked this cycle"),
    _m(
        "collector_duration_seconds",
        "gauge",
        "collector",
        "telemetry",
        "time the source took this cycle",
        help="Time the source took this cycle",
    ),
    _m(
        "telemetry_last_cycle_timestamp_seconds",
        "gauge",
        "",
        "telemetry",
        "when the cycle served here finished",
        help="When the telemetry cycle served here finished",
    ),
    # the GPU (NVML)
    _m("gpu_up", "gauge", "", "gpu", "1 if NVML answered this cycle", help="1 if NVML answered this cycle, 0 if not."),
    _m(
        "gpu_nvml_return_code",
        "gauge",
        "",
        "gpu",
        f"NVML's code: {meanings_text()}; absent when a call hung",
        help=(
            "NVML return code of the last cycle: 0 success, 9 driver not loaded, 12 library not found, 18 "
            "driver/library version mismatch."
        ),
    ),
    _m(
        "gpu_nvml_call_timeouts_total",
        "counter",
        "",
        "gpu",
        "NVML calls that outlived the timeout (a hung driver)",
        help="NVML calls that did not return within the timeout (a hung driver).",
    ),
    _m(
        "gpu_info",
        "gauge",
        "gpu uuid name driver_version bus_id unified",
        "gpu",
        'GPU identity; always 1. unified="true": no VRAM, the pool is sparkwatch_memory_*',
        help="GPU identity; always 1. unified=true: the GPU shares the system memory pool.",
    ),
    _m("gpu_power_watts", "gauge", _GPU, "gpu_device", "power draw", help="Power draw of the GPU (NVML power usage)."),
    _m(
        "gpu_power_limit_watts",
        "gauge",
        _GPU,
        "gpu_device",
        "enforced power limit (absent on a GB10)",
        help="Enforced power limit of the GPU; absent where NVML has none (GB10).",
    ),
    _m(
        "gpu_utilization_ratio",
        "gauge",
        _GPU,
        "gpu_device",
        "fraction of the sample period a kernel ran (0 to 1)",
        help="Fraction of the last sample period in which a kernel ran on the GPU (0 to 1).",
    ),
    _m("gpu_temperature_celsius", "gauge", _GPU, "gpu_device", "GPU core temperature", help="GPU core temperature."),
    _m("gpu_sm_clock_hertz", "gauge", _GPU, "gpu_device", "current SM clock", help="Current SM clock."),
    _m("gpu_sm_clock_max_hertz", "gauge", _GPU, "gpu_device", "maximum SM clock", help="Maximum SM clock."),
    _m(
        "gpu_memory_total_bytes",
        "gauge",
        _GPU,
        "gpu_device",
        "dedicated VRAM (absent on unified memory)",
        help="Dedicated GPU memory (VRAM); absent on unified memory, where the pool is the sparkwatch_memory_* series.",
    ),
    _m(
        "gpu_memory_used_bytes",
        "gauge",
        _GPU,
        "gpu_device",
        "VRAM in use (absent on unified memory)",
        help="Dedicated GPU memory in use; absent on unified memory.",
    ),
    _m(
        "gpu_energy_joules_total",
        "counter",
        _GPU,
        "gpu_device",
        "energy since the driver loaded",
        help="Energy the GPU used since the driver loaded.",
    ),
    _m(
        "gpu_process_memory_bytes",
        "gauge",
        f"{_GPU} pid",
        "gpu_device",
        "GPU memory of a process (NVML lists)",
        help=(
            "GPU memory used by a process (NVML compute and graphics lists); on unified memory a share of the pool that"
            " RSS and cgroups do not see."
        ),
    ),
    _m(
        "gpu_field_supported",
        "gauge",
        f"{_GPU} field",
        "gpu_device",
        "1 if NVML answers this field, 0: NOT_SUPPORTED",
        help=(
            "1 if NVML answers this field on this GPU, 0 if it says NOT_SUPPORTED (the field's series is then absent)."
        ),
    ),
    _m(
        "gpu_unknown_holders",
        "gauge",
        "",
        "gpu",
        "processes NVML lists as holding GPU memory that match no engine rule: the guard would not kill them",
        help="Processes NVML lists as holding GPU memory that match no engine rule and are in no engine tree",
    ),
    _m(
        "gpu_unknown_holder_memory_bytes",
        "gauge",
        "",
        "gpu",
        "GPU memory those processes hold (where NVML says)",
        help="GPU memory held by processes that match no engine rule (NVML per-process, where it says)",
    ),
    _m(
        "gpu_field_error_code",
        "gauge",
        f"{_GPU} field",
        "gpu_field",
        "NVML code of a field failing this cycle",
        help="NVML return code of a field that failed this cycle for another reason than NOT_SUPPORTED.",
    ),
    # the driver (drift between kernel, next boot and NVIDIA packages)
    _m(
        "driver_stranded",
        "gauge",
        "",
        "driver",
        "1 when the running kernel has no NVIDIA modules",
        help=(
            "1 when the running kernel has no NVIDIA modules left (an update removed them): reboot into the new kernel"
        ),
    ),
    _m(
        "driver_next_boot_ok",
        "gauge",
        "",
        "driver",
        "1 when the kernel that boots next has NVIDIA modules; absent when unknown",
        help="1 when the kernel that boots next has NVIDIA modules",
    ),
    _m("reboot_required", "gauge", "", "driver", "1 when /run/reboot-required exists"),
    _m(
        "driver_version_mismatch",
        "gauge",
        "",
        "driver",
        "1 when the loaded module and the library differ",
        help="1 when the loaded module and the user-space library differ (NVML: version mismatch)",
    ),
    _m(
        "driver_info",
        "gauge",
        "kernel module_version loaded_version library_version verdict",
        "driver",
        f"driver identity and the drift verdict; always 1. verdict={'|'.join(DriverVerdict)}",
        help="Driver identity and the drift verdict; always 1",
    ),
    # the pool as the driver sees it (/proc/buddyinfo) and the kernel log (/dev/kmsg: NVRM and Xid lines)
    _m(
        "memory_free_contiguous_bytes",
        "gauge",
        "min_block",
        "telemetry",
        "bytes free in blocks of at least min_block (2MiB|64KiB), from /proc/buddyinfo",
        help="Free memory in blocks of at least min_block (/proc/buddyinfo): what a large driver allocation can get",
    ),
    # what killed engines left in /dev/shm (core.launch.shmleft): tmpfs pages out of the pool until removed
    _m(
        "shm_orphaned_bytes",
        "gauge",
        "",
        "shm",
        "bytes (allocated blocks) of the files in /dev/shm no process maps or holds open: a killed engine's shared "
        "memory, out of the pool until removed (sparkwatch doctor --fix) or a reboot",
        help="Bytes of /dev/shm files no process maps or holds open: out of MemAvailable until removed",
    ),
    _m(
        "shm_orphaned_files",
        "gauge",
        "",
        "shm",
        "files in /dev/shm no process maps or holds open (sparkwatch doctor names them)",
        help="Files in /dev/shm no process maps or holds open (sparkwatch doctor names them)",
    ),
    _m(
        "kernel_log_readable",
        "gauge",
        "",
        "guard",
        "1 when /dev/kmsg can be read; 0: NVRM and Xid lines are not seen",
        help="1 when sparkwatch can read /dev/kmsg (system unit, or kernel.dmesg_restrict=0); doctor says why not",
    ),
    _m("kernel_log_lines_total", "counter", "", "guard", "kernel log records read", help="Kernel log records read"),
    _m(
        "kernel_log_dropped_lines_total",
        "counter",
        "",
        "guard",
        "kernel log records lost: overwritten in the ring or skipped over the rate bound",
        help="Kernel log records not read: overwritten in the ring, or skipped over the line-rate bound",
    ),
    _m(
        "kernel_log_injected_lines_total",
        "counter",
        "",
        "guard",
        "NVRM lines a process wrote into the kernel log (not the driver), ignored unless kernel_log_accept_injected",
        help=(
            "NVRM lines written into the kernel log by a process, not printed by the driver: ignored (a test, logger, "
            "or someone pretending)"
        ),
    ),
    _m(
        "kernel_nvrm_errors_total",
        "counter",
        "kind",
        "guard",
        "NVRM error lines by kind (no_memory|insufficient_resources|alloc_failed|assertion|other)",
        help="NVRM error lines by kind (no_memory, insufficient_resources, alloc_failed: allocation failures)",
    ),
    _m(
        "kernel_xid_total",
        "counter",
        "code",
        "guard",
        "NVIDIA Xid events by code; catalogued codes exported at 0",
        help="NVIDIA Xid events in the kernel log, by code",
    ),
    # the daemon itself: two processes (the guard, main PID; telemetry, which it supervises)
    _m(
        "internal_errors_total",
        "counter",
        "process component counter",
        "daemon",
        "every error or drop a component counted and survived (journal, notify, events, driver, outbox, channel, "
        "metrics endpoint...)",
        help="Errors and drops a component counted and survived, by process, component and counter",
    ),
    _m(
        "process_resident_bytes",
        "gauge",
        "process",
        "daemon",
        "resident set size of each process (guard, telemetry)",
        help="Resident set size of each process",
    ),
    _m(
        "telemetry_restarts_total",
        "counter",
        "",
        "daemon",
        "times the guard restarted the telemetry process",
        help="Times the guard restarted the telemetry process",
    ),
    _m(
        "metrics_series_dropped_total",
        "counter",
        "",
        "always",
        "series left out of /metrics, summed over scrapes: those past 64 label sets (engine, pid, model, name or JIT "
        "cache) in one family; label values are redacted and cut to 128 characters",
        help="Series left out of /metrics past 64 label sets of one family (engine, pid, model, name, JIT cache), "
        "summed over scrapes",
    ),
    _m("guard_psi_trigger", "gauge", "", "daemon", "1 while the guard also wakes on a PSI memory trigger"),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in METRICS}


def help_of(family: str) -> str:
    """The `# HELP` text of a family as prometheus_client names it (a counter without its `_total`)."""
    spec = BY_NAME.get(family) or BY_NAME[family + "_total"]
    return spec.help


def series_names(spec: MetricSpec) -> tuple[str, ...]:
    """The sample names a family puts in the exposition (a histogram's _bucket/_sum/_count)."""
    if spec.type == "histogram":
        return tuple(spec.name + s for s in ("_bucket", "_sum", "_count"))
    return (spec.name,)


def markdown_table() -> str:
    """The metrics table of docs/contract.md, made from METRICS (a test checks the document holds it verbatim)."""
    rows = ["| metric | type | labels | present | meaning |", "| --- | --- | --- | --- | --- |"]
    for m in METRICS:
        labels = ", ".join(f"`{label}`" for label in m.labels)
        meaning = m.meaning.replace("|", "\\|")
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {m.present} | {meaning} |")
    return "\n".join(rows) + "\n"


def presence_table() -> str:
    rows = ["| present | when |", "| --- | --- |"]
    rows += [f"| {key} | {text} |" for key, text in PRESENCE.items()]
    return "\n".join(rows) + "\n"
