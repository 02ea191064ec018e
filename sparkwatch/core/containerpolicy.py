"""A kill is not undone by a restart policy: what telemetry does when a container whose engine the guard killed is
started again by dockerd (`container_after_kill`, label `io.sparkwatch.after-kill`; docs/containers.md). Pure: the
caller (telemetry.afterkill) passes the kills it heard of, the container's start, the pool, and wall-clock times.

Why it is needed: dockerd restarts a container whose PID 1 died of a signal it did not send (`always`,
`unless-stopped`, `on-failure`), and moby's restartmanager returns its delay to 100 ms after any run of 10 s or more.
An engine always runs longer than that before its spike, so an outside SIGKILL never slows the restarts down:
kill, restart, reload the weights, spike, kill. The API's kill (`docker kill`, POST /containers/{id}/kill) marks the
container stopped by its owner and cancels a pending restart: that is `stop`.

- A restart answers a kill when the container's `start` comes after the kill's signal, within RESTART_WINDOW_S, with
  a restart count above 0 (moby counts the policy's restarts and resets the count on an owner's `docker start`).
- Its policy: the label when it parses, else the config. A container killed CONTAINER_LOOP_KILLS times within
  LOOP_WINDOW_S (the guard's kill-loop window) ends in `stop` whatever its policy, with one alert per loop.
- `gate`: paused at once; released when the pool has settled (core.launch.settle: no engine process still letting
  go, MemAvailable steady, Shmem not falling, for the quiet period) and what it needs fits MemAvailable minus the floor.
  What it needs: its learned peak (core.launch.peaks), else its plan's estimate (a `sparkwatch launch` declaration),
  else the footprint its kill recorded (victim_rss_bytes + victim_gpu_bytes, or the budget's footprint when larger);
  with none known, settled alone releases it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from sparkwatch.core.container import AfterKill, ContainerFacts, label_asks
from sparkwatch.core.kill.killloop import LOOP_WINDOW_S
from sparkwatch.core.launch.settle import SettleParams, SettleState, settle_step
from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural

# moby's restart delay doubles from 100 ms to at most one minute while runs stay under 10 s; a start later than this
# after a kill is no restart of it.
RESTART_WINDOW_S = 75.0
# The same container killed this often within LOOP_WINDOW_S is a loop: its restart policy keeps undoing the guard.
CONTAINER_LOOP_KILLS = 2
SETTLE = SettleParams()  # wait-settled's and launch's own quiet period and tolerance
KILLS_KEPT = 8  # per container, the newest
CONTAINERS_KEPT = 64  # containers whose kills are remembered, the most recent kept


@dataclass(frozen=True, slots=True)
class ContainerKill:
    """One guard kill of an engine tree in a container: first from the guard's state (at the signal, its pids), then
    confirmed by its `kill` event (after the reap and settle) with what the tree held."""

    container_id: str
    root_pid: int
    ts: float  # wall clock of the signal (or, known only from the event, estimated back from it)
    trigger: str
    exact: bool = True  # `ts` is the signal's own (the guard's state), not estimated back from the event
    footprint_bytes: int | None = None  # what the tree held at the signal, from the kill event
    confirmed: bool = False  # its kill event came
    answered: bool = False  # a restart after it was acted on


@dataclass(frozen=True, slots=True)
class Decision:
    action: AfterKill
    source: str  # label, config, or loop (CONTAINER_LOOP_KILLS within the window)
    kills: int  # the container's kills within LOOP_WINDOW_S, this one included
    problems: tuple[str, ...] = ()  # a label that did not parse (named; the config decided)

    @property
    def loop(self) -> bool:
        return self.source == "loop"


@dataclass(frozen=True, slots=True)
class Need:
    """What a gated container's engine will take of the pool, and where the figure comes from."""

    bytes: int
    source: str  # learned peak, plan, kill footprint


@dataclass(frozen=True, slots=True)
class Gate:
    """A container held paused after its restart."""

    container_id: str
    name: str
    image: str
    since_ts: float  # wall clock of the pause
    kill_ts: float
    root_pid: int  # the killed tree's
    need: Need | None = None
    settle: SettleState = field(default_factory=SettleState)
    steady_for_s: float = 0.0
    settled: bool = False
    available_bytes: int | None = None


def policy_for(labels: Mapping[str, str], configured: AfterKill) -> tuple[AfterKill, str, tuple[str, ...]]:
    """The container's after-kill policy: its label when it parses, else the config. Returns (policy, source,
    problems)."""
    asks = label_asks(labels)
    problems = tuple(p for p in asks.problems if p.startswith("io.sparkwatch.after-kill"))
    if asks.after_kill is not None:
        return asks.after_kill, "label", problems
    return configured, "config", problems


def note_kill(
    kills: Mapping[str, tuple[ContainerKill, ...]], kill: ContainerKill, *, same_within_s: float = 30.0
) -> dict[str, tuple[ContainerKill, ...]]:
    """Remember one kill. The same kill heard twice (the guard's state, then its event: same container and root pid,
    within `same_within_s`) is merged: the event's footprint is added and it is marked confirmed, the signal's own
    time kept over an estimate."""
    out = dict(kills)
    mine = list(out.pop(kill.container_id, ()))
    for i, old in enumerate(mine):
        # the event's root is the killed tree's; the state's is the tree telemetry saw that pid in (the same one),
        # else the container's init: one heard from each side, close in time, is the same kill
        either = old.exact != kill.exact and not (old.confirmed and kill.confirmed)
        if (old.root_pid == kill.root_pid or either) and abs(old.ts - kill.ts) <= same_within_s:
            mine[i] = replace(
                old,
                ts=kill.ts if kill.exact and not old.exact else old.ts,
                exact=old.exact or kill.exact,
                footprint_bytes=kill.footprint_bytes if kill.footprint_bytes is not None else old.footprint_bytes,
                confirmed=old.confirmed or kill.confirmed,
            )
            break
    else:
        mine.append(kill)
    mine.sort(key=lambda k: k.ts)
    out[kill.container_id] = tuple(mine[-KILLS_KEPT:])
    if len(out) > CONTAINERS_KEPT:  # the containers killed longest ago go first
        newest = sorted(out, key=lambda cid: out[cid][-1].ts)[-CONTAINERS_KEPT:]
        out = {cid: out[cid] for cid in newest}
    return out


def answered_kill(kills: Sequence[ContainerKill], start_ts: float, restart_count: int) -> ContainerKill | None:
    """The kill this start of the container answers: the newest kill not yet answered whose signal came before the
    start, within RESTART_WINDOW_S. None for an owner's `docker start` (restart count 0) or no such kill."""
    if restart_count <= 0:
        return None
    for kill in reversed(kills):
        if not kill.answered and kill.ts < start_ts and start_ts - kill.ts <= RESTART_WINDOW_S:
            return kill
    return None


def decide(
    kills: Sequence[ContainerKill], start_ts: float, labels: Mapping[str, str], configured: AfterKill
) -> Decision:
    """What to do with a container started again after a guard kill."""
    recent = sum(1 for k in kills if k.ts < start_ts and start_ts - k.ts <= LOOP_WINDOW_S)
    policy, source, problems = policy_for(labels, configured)
    if recent >= CONTAINER_LOOP_KILLS:
        return Decision(AfterKill.STOP, "loop", recent, problems)
    return Decision(policy, source, recent, problems)


def need_of(learned_bytes: int | None, estimate_bytes: int | None, footprint_bytes: int | None) -> Need | None:
    """What a gated engine needs: its learned peak, else its plan, else what its kill recorded."""
    if learned_bytes:
        return Need(learned_bytes, "learned peak")
    if estimate_bytes:
        return Need(estimate_bytes, "plan")
    if footprint_bytes:
        return Need(footprint_bytes, "kill footprint")
    return None


def kill_footprint(fields: Mapping[str, object]) -> int | None:
    """What a `kill` event says the victims held: RSS plus GPU bytes, or the budget's footprint when larger."""

    def num(name: str) -> int:
        value = fields.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    held = num("victim_rss_bytes") + num("victim_gpu_bytes")
    return max(held, num("footprint_bytes")) or None


def gate_step(
    gate: Gate,
    t: float,
    *,
    letting_go: int,
    available_bytes: int,
    floor_bytes: int,
    shmem_bytes: int | None = None,
    params: SettleParams = SETTLE,
) -> tuple[Gate, bool]:
    """One look at the pool (monotonic `t`) for a gated container. Returns the gate and whether to release it now:
    the pool settled and its need fits MemAvailable minus the floor."""
    settle, verdict = settle_step(gate.settle, params, t, letting_go, available_bytes, shmem_bytes=shmem_bytes)
    gate = replace(
        gate,
        settle=settle,
        steady_for_s=verdict.steady_for_s,
        settled=verdict.settled,
        available_bytes=available_bytes,
    )
    return gate, verdict.settled and fits(gate.need, available_bytes, floor_bytes)


def fits(need: Need | None, available_bytes: int, floor_bytes: int) -> bool:
    return need is None or need.bytes <= available_bytes - floor_bytes


def waiting_for(gate: Gate, floor_bytes: int, params: SettleParams = SETTLE) -> str:
    """What a gate waits for, in words (status, the log)."""
    if not gate.settled:
        return f"the pool to settle (steady {gate.steady_for_s:.0f}/{params.quiet_for_s:g} s)"
    if gate.need is not None and gate.available_bytes is not None:
        room = max(gate.available_bytes - floor_bytes, 0)
        return f"room for {format_size(gate.need.bytes)} ({gate.need.source}); {format_size(room)} above the floor"
    return "nothing: being released"


# --- records -------------------------------------------------------------------------------------------------------


def container_fields(facts: ContainerFacts | None, container_id: str) -> dict[str, object]:
    """How every after-kill event names its container: as `docker ps` shows it."""
    service = None
    if facts is not None and facts.compose_service:
        service = f"{facts.compose_project}/{facts.compose_service}" if facts.compose_project else facts.compose_service
    return {
        "container_id": container_id,
        "container_name": facts.name if facts is not None else container_id[:12],
        "image": facts.image if facts is not None else None,
        "compose_service": service,
        "restart_policy": facts.restart_policy if facts is not None else None,
    }


def named(fields: Mapping[str, object]) -> str:
    """`container vllm-qwen (nvcr.io/nvidia/vllm:25.09, 3f2a9c1b7d4e)`"""
    cid = str(fields.get("container_id", ""))[:12]
    image = fields.get("image")
    return f"container {fields.get('container_name')} ({f'{image}, ' if image else ''}{cid})"


FIX = (
    "raise its budget (label io.sparkwatch.budget or engine_budgets) or lower its --gpu-memory-utilization, then "
    "`docker start {name}`; with the label io.sparkwatch.after-kill=stop its restart is cancelled at the first kill"
)


def loop_fix(name: str) -> str:
    return FIX.format(name=name)


def loop_summary(fields: Mapping[str, object], kills: int, error: str | None) -> str:
    done = f"could not stop it ({error})" if error else "stopped it through the API's kill"
    return (
        f"{named(fields)}: the guard killed its engine {plural(kills, 'time')} within {LOOP_WINDOW_S / 60:.0f} min "
        f"and its restart policy ({fields.get('restart_policy')}) started it again each time; sparkwatch {done}. "
        f"Fix: {loop_fix(str(fields.get('container_name')))}"
    )


def gated_summary(fields: Mapping[str, object], kill: ContainerKill, need: Need | None, error: str | None) -> str:
    if error:
        return f"{named(fields)} restarted after a guard kill ({kill.trigger}); could not pause it: {error}"
    wants = f" and {format_size(need.bytes)} ({need.source}) fits" if need is not None else ""
    return (
        f"{named(fields)} restarted after a guard kill ({kill.trigger}): paused until the pool has settled{wants}, "
        "then unpaused"
    )
