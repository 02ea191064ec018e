"""Which events alert, their dedup keys, and the episode and rate-limit rules. Pure: state in, state out.

A stranded driver is checked every minute for as long as it lasts (hours, until someone reboots): it must alert once
when the episode starts and once when it ends, not sixty times an hour. Low headroom alerts when MemAvailable enters
the warning band and again only after it has left it by a margin. Kills always alert; each kill is its own event.
A dry run's `would_kill` alerts the same way, at warning level (journal priority 4, a :warning: icon): nothing died.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sparkwatch.core.enums import DriverProblem, DriverVerdict
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import DriverReport

# Event kind -> minimum seconds between two alerts with the same dedup key. 0: every event alerts.
ALERT_MIN_INTERVAL_S: Mapping[EventKind, float] = {
    EventKind.KILL: 0.0,
    # A dry run's would-kill: a warning (nothing died), each one, so the first week of a dry run shows every decision.
    # The guard decides a tree once per episode (once per budget breach), so these do not repeat per tick.
    EventKind.WOULD_KILL: 0.0,
    EventKind.NO_VICTIM: 0.0,  # the guard fired and found no engine to kill: the box is on its own, a human must look
    EventKind.GROUP_TEARDOWN: 0.0,  # one per group and node: a rank died elsewhere and this node stopped its half
    EventKind.PEER_LOST: 0.0,  # once per episode upstream (telemetry.peerwatch): the other Spark went quiet
    EventKind.PEER_BACK: 0.0,
    # one event per loop is decided upstream (core.kill.killloop): something restarts the engine
    EventKind.KILL_LOOP: 0.0,
    # one event per loop is decided upstream (core.containerpolicy): a restart policy undid two kills; it is stopped
    EventKind.CONTAINER_KILL_LOOP: 0.0,
    EventKind.DRIVER_STRANDED: 0.0,  # episodes are cut upstream (driver_step): one event per episode
    EventKind.DRIVER_WILL_STRAND: 0.0,
    EventKind.DRIVER_VERSION_MISMATCH: 0.0,
    EventKind.DRIVER_NOT_LOADED: 0.0,
    EventKind.DRIVER_RECOVERED: 0.0,
    # Xids: per code and GPU; a warp exception repeats per faulting warp, one alert per 5 min says enough. Codes
    # that need a GPU reset or a reboot carry "page": true (core.driver.nvrm.XID_CATALOGUE).
    EventKind.XID: 300.0,
    # Episodes are cut upstream (core.driver.nvrm.corroborate: one event per failure episode, lines 5 s apart).
    EventKind.DRIVER_ALLOC_FAILED: 300.0,
    EventKind.LOW_HEADROOM: 900.0,
    EventKind.COMPILE_BURST: 900.0,
    EventKind.MAX_JOBS_MISSING: 3600.0,
    EventKind.JIT_STALLED: 1800.0,
    # One per wedge episode upstream (core.engines.serving: wedged once, serving again once); this caps an engine
    # that flaps between the two.
    EventKind.ENGINE_WEDGED: 900.0,
    EventKind.ENGINE_SERVING_AGAIN: 900.0,
    EventKind.BUDGET_NEAR: 900.0,  # once per approach upstream (core.kill.budget); this caps an engine hovering at 90 %
    EventKind.OUTBOX_DROPPED: 3600.0,  # the outbox alerts once per run itself; this caps a restart loop
    EventKind.OUTBOX_QUARANTINED: 3600.0,
    # Once per boot is decided upstream (telemetry.postmortemtask remembers the boot it judged); a clean end is quiet.
    EventKind.PREVIOUS_BOOT: 0.0,
}

# Driver problems, worst first, and the event kind each one opens an episode with.
DRIVER_PROBLEM_KINDS: Mapping[DriverProblem, EventKind] = {
    DriverProblem.STRANDED: EventKind.DRIVER_STRANDED,
    DriverProblem.WILL_STRAND: EventKind.DRIVER_WILL_STRAND,
    DriverProblem.VERSION_MISMATCH: EventKind.DRIVER_VERSION_MISMATCH,
    DriverProblem.NOT_LOADED: EventKind.DRIVER_NOT_LOADED,
}


def is_alerting(kind: EventKind) -> bool:
    return kind in ALERT_MIN_INTERVAL_S


def is_quiet(kind: EventKind, fields: Mapping[str, object]) -> bool:
    """An event of an alerting kind that says nothing is wrong: a previous boot that ended in an orderly shutdown."""
    return kind == EventKind.PREVIOUS_BOOT and fields.get("class") == "clean"


def dedup_key(kind: EventKind, fields: Mapping[str, object]) -> str:
    """Events with the same key are one alert stream for rate limiting. A kill is never folded into another."""
    if kind in (EventKind.KILL, EventKind.WOULD_KILL):
        return f"{kind}:{fields.get('id', '')}"
    if kind == EventKind.XID:
        return f"xid:code={fields.get('code')}:device={fields.get('device')}"
    for name in ("engine_root_pid", "root_pid", "pid", "cache", "kernel"):
        value = fields.get(name)
        if value is not None:
            return f"{kind}:{name}={value}"
    return kind


@dataclass(frozen=True, slots=True)
class RateState:
    last_sent_s: Mapping[str, float] = field(default_factory=dict)


RATE_KEYS_MAX = 1024  # alert streams remembered for rate limiting; the oldest is forgotten first


def rate_limit(state: RateState, kind: EventKind, key: str, now_s: float) -> tuple[RateState, bool]:
    """Whether an alerting event goes out now, and the new state. Unknown kinds never alert."""
    interval = ALERT_MIN_INTERVAL_S.get(kind)
    if interval is None:
        return state, False
    last = state.last_sent_s.get(key)
    if interval > 0 and last is not None and now_s - last < interval:
        return state, False
    sent = {k: v for k, v in state.last_sent_s.items() if interval == 0 or now_s - v < 24 * 3600}
    if interval > 0:
        sent[key] = now_s
    if len(sent) > RATE_KEYS_MAX:  # keys carry pids: under churn they must not pile up for a day
        sent = dict(sorted(sent.items(), key=lambda kv: kv[1])[-RATE_KEYS_MAX:])
    return RateState(sent), True


# --- driver episodes


@dataclass(frozen=True, slots=True)
class DriverAlert:
    kind: EventKind
    summary: str
    fields: Mapping[str, object]


def driver_problems(report: DriverReport) -> frozenset[DriverProblem]:
    """The open problems in one report. 'reboot_pending' alone is not an alert: apt sets it for every kernel update."""
    out: set[DriverProblem] = set()
    if report.stranded:
        out.add(DriverProblem.STRANDED)
    if report.next_boot_ok is False and report.next_boot_kernel != report.running_kernel:
        out.add(DriverProblem.WILL_STRAND)
    if report.version_mismatch:
        out.add(DriverProblem.VERSION_MISMATCH)
    if report.loaded is False and not report.stranded:
        out.add(DriverProblem.NOT_LOADED)
    return frozenset(out)


def driver_fields(report: DriverReport) -> dict[str, object]:
    return {
        "verdict": report.verdict,
        "kernel": report.running_kernel,
        "next_boot_kernel": report.next_boot_kernel,
        "loaded_version": report.loaded_version,
        "library_version": report.library_version,
        "reboot_required": report.reboot_required,
    }


def driver_step(
    open_problems: frozenset[DriverProblem], report: DriverReport
) -> tuple[frozenset[DriverProblem], tuple[DriverAlert, ...]]:
    """Episode transitions: one alert per problem when it appears, one `driver_recovered` when all have cleared.

    'unknown' and 'absent' verdicts carry no evidence, so they change nothing (a root that cannot be read for a
    moment must not announce a recovery).
    """
    if report.verdict in (DriverVerdict.UNKNOWN, DriverVerdict.ABSENT):
        return open_problems, ()
    now = driver_problems(report)
    if report.running_kernel is None:
        # Without the running kernel "stranded" cannot be judged either way: an open episode stays open.
        now |= open_problems & {DriverProblem.STRANDED, DriverProblem.NOT_LOADED}
    alerts: list[DriverAlert] = []
    fields = driver_fields(report)
    for problem, kind in DRIVER_PROBLEM_KINDS.items():
        if problem in now and problem not in open_problems:
            alerts.append(DriverAlert(kind, _problem_summary(problem, report), {**fields, "problem": problem}))
    if open_problems and not now:
        alerts.append(
            DriverAlert(
                EventKind.DRIVER_RECOVERED,
                f"driver recovered: {report.summary} (was: {', '.join(sorted(open_problems))})",
                {**fields, "cleared": sorted(open_problems)},
            )
        )
    return now, tuple(alerts)


def _problem_summary(problem: DriverProblem, report: DriverReport) -> str:
    if problem == DriverProblem.STRANDED:
        return (
            f"NVIDIA driver stranded: running kernel {report.running_kernel} has no NVIDIA modules. "
            "Run: sudo apt full-upgrade && sudo reboot, then check uname -r and nvidia-smi"
        )
    if problem == DriverProblem.WILL_STRAND:
        return (
            f"the next boot ({report.next_boot_kernel}) has no NVIDIA modules: do not reboot before "
            "sudo apt full-upgrade installs them (sparkwatch doctor shows the commands)"
        )
    if problem == DriverProblem.VERSION_MISMATCH:
        return (
            f"NVIDIA driver/library version mismatch: loaded {report.loaded_version or '?'}, "
            f"library {report.library_version or '?'}; a reboot loads the matching module"
        )
    return f"NVIDIA modules installed for {report.running_kernel} but the driver is not loaded"


# --- low headroom


def headroom_step(
    in_band: bool, available_bytes: int, floor_bytes: int, warn_headroom_bytes: int, hysteresis_bytes: int
) -> tuple[bool, bool]:
    """(in_band, alert now). Enters the band at floor + warn_headroom, leaves it only above that + hysteresis.

    MemAvailable wobbles by ~100 MiB per 5 s with excursions over 1 GiB, so leaving needs a margin or one boot
    would page someone a dozen times.
    """
    enter = floor_bytes + warn_headroom_bytes
    if not in_band and available_bytes <= enter:
        return True, True
    if in_band and available_bytes > enter + hysteresis_bytes:
        return False, False
    return in_band, False


def alert_text(kind: str, node: str, summary: str) -> str:
    """The one `text` line Slack-compatible receivers show as is."""
    icons: Mapping[str, str] = {
        EventKind.KILL: ":skull:",
        EventKind.WOULD_KILL: ":warning:",
        EventKind.NO_VICTIM: ":rotating_light:",
        EventKind.DRIVER_STRANDED: ":rotating_light:",
        EventKind.DRIVER_WILL_STRAND: ":warning:",
        EventKind.DRIVER_VERSION_MISMATCH: ":warning:",
        EventKind.DRIVER_NOT_LOADED: ":rotating_light:",
        EventKind.DRIVER_RECOVERED: ":white_check_mark:",
        EventKind.LOW_HEADROOM: ":warning:",
        EventKind.XID: ":warning:",
        EventKind.DRIVER_ALLOC_FAILED: ":rotating_light:",
        EventKind.PREVIOUS_BOOT: ":boom:",
    }
    icon = icons.get(kind, ":information_source:")
    return f"{icon} sparkwatch on {node}: {summary}"
