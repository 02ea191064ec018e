"""Every message between the guard process and the telemetry process: one frozen dataclass per kind, one `encode`,
one `decode`, and the limits that keep a misbehaving peer from costing the guard memory or time.

A datagram is one JSON object `{"v": VERSION, "t": <kind>, ...fields}`. `decode` rebuilds the dataclass field by
field with its declared type (common.wiretypes) and raises `BadMessage` for anything else: not JSON, another
version, an unknown kind, a field of the wrong type, or a collection past its limit. The channel drops and counts
those; nothing half-parsed ever reaches a component.

guard → telemetry
- `SettingsMsg`: the whole validated config (config.settings.settings_to_wire; the webhook secret travels here and
  nowhere else), at start and after each good reload (`reload=True`), resent until telemetry answers.
- `StateMsg`: the guard's counters (common.stats) and the guard process's own (RSS, event, journal, notify and channel
  errors, telemetry restarts, watchdog pings), on change: at most once a second far from the floor, four times a
  second near it (guard.supervisor).
- `EventMsg`: an event the guard process made durable in events.jsonl (a kill), for the outbox.

telemetry → guard
- `AppliedMsg`: the answer to a reload: the keys telemetry's components applied live, and their errors.
- `AckMsg`: events telemetry's outbox now holds; the guard resends unacknowledged ones to the next telemetry process.
- `TelMsg` (each telemetry cycle): the engine and compile-job counts for the STATUS= line, per-pid GPU bytes (NVML)
  with the wall-clock time they were read, the (pid, start time) of every GPU holder, and the (kind, root pid) of
  each engine tree (for the flight recorder). The guard treats all of it
  as a hint: a holder is checked again in /proc before it can become a kill candidate (guard.gpuboard).
- `GroupTeardownMsg`: a group spanning nodes (core.kill.raygroup) lost a member: this node's members of it, as
  (pid, start ticks, role), the first death and its cause. The guard checks each member again itself (same start
  time, this node's network namespace, the role's shape) before it signals anything (guard.groupwatch).
- `WedgedMsg` (telemetry/probewatch.py, with `kill_wedged_after_s` set): an engine has failed the serving probe for at
  least that long while its process lives, named by (pid, start ticks), with the progress counter of its own that did
  not move (core.engines.progress: busy is not wedged). The guard checks it again itself (alive with that start time,
  an engine tree by its own rules, may be touched, its own `kill_wedged_after_s` met, a counter named) before the one
  kill path kills it, trigger `wedged` (guard.wedgewatch).
- `PeerBudgetMsg` (telemetry/raywatch.py): this node's Ray ranks of an engine whose launch on another node gave them
  a budget (`--budget worker=SIZE`, told by that node's agent), as (pid, start ticks, uid, budget, group). The guard
  holds an engine tree whose root is that very process to it (guard.budgets, budget source `peer`).
- `GpuSampleMsg` (telemetry/gpufast.py, up to FAST_PERIOD_S apart): NVML's per-process bytes of the pids the guard
  asked to be watched closely (the members of an engine tree at GPU_FAST_RATIO of its budget or more, named in the
  state's budgets, `BudgetStat.gpu_watch`), sent when they changed. The guard overlays them on the last `tel`
  reading and looks at the budget at once (guard.budgets): a GPU runaway that grows in steps is seen within one
  fast period, not the telemetry cycle's second.
- `ContainersMsg` (telemetry/containernotes.py): the containers that hold an engine tree or carry `io.sparkwatch.*`
  labels, at most NOTES_MAX (core.container.ContainerNote: id, name, image, compose service, and the budget,
  protection and kill priority their labels ask), the whole set each time it changes and every CONTAINERS_RESEND_S.
  The guard never talks to Docker: it names a killed tree's container from it, and matches each of its own trees to
  a note by the container id in the tree's own cgroup path (core.containerid), never by anything telemetry names.
  A label is trusted as the Docker socket is (root-equivalent); a note only ever adds a budget, a protection or a
  priority to a tree the guard itself found.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from sparkwatch.common.stats import GuardStats, KernelLogStats
from sparkwatch.common.wiretypes import WireError, from_json, to_json
from sparkwatch.core.container import NOTE_TEXT_MAX, NOTES_MAX, ContainerNote
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import Event

VERSION = 2
# One datagram's limit: a settings message with long cache-dir lists is a few KiB, a state message about 2 KiB.
MAX_MESSAGE_BYTES = 1 << 20
# Collections a peer may send: a box runs a handful of engines and a few thousand processes at most.
MAX_ITEMS = 4096
# Pids sampled fast for GPU bytes at once (telemetry/gpufast.py): the members of near-budget engine trees. A vLLM
# engine is a handful of processes (API server, EngineCore, one worker a GPU); past this the rest wait their turn in
# the telemetry cycle's reading.
MAX_GPU_WATCH_PIDS = 64


class Kind(StrEnum):
    SETTINGS = "settings"
    STATE = "state"
    EVENT = "event"
    APPLIED = "applied"
    ACK = "ack"
    TEL = "tel"
    GROUP_TEARDOWN = "group_teardown"
    GPU_SAMPLE = "gpu_sample"
    WEDGED = "wedged"
    PEER_BUDGET = "peer_budget"
    CONTAINERS = "containers"


class BadMessage(ValueError):
    """A datagram that is not one of our messages (counted and dropped by the channel)."""


@dataclass(frozen=True, slots=True)
class SettingsMsg:
    KIND: ClassVar[Kind] = Kind.SETTINGS
    wire: dict[str, Any]
    public: dict[str, Any]
    reload: bool = False


@dataclass(frozen=True, slots=True)
class StateMsg:
    KIND: ClassVar[Kind] = Kind.STATE
    guard: GuardStats
    kernlog: KernelLogStats
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    rss_bytes: int = 0
    watchdog_pings_total: int = 0
    pid: int = 0


@dataclass(frozen=True, slots=True)
class EventMsg:
    KIND: ClassVar[Kind] = Kind.EVENT
    event: Event


@dataclass(frozen=True, slots=True)
class AppliedMsg:
    KIND: ClassVar[Kind] = Kind.APPLIED
    keys: tuple[str, ...] = ()
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AckMsg:
    KIND: ClassVar[Kind] = Kind.ACK
    ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TelMsg:
    KIND: ClassVar[Kind] = Kind.TEL
    engines: int | None = None
    compile_jobs: int | None = None
    gpu_ts: float | None = None  # wall clock of the NVML reading; None: no fresh reading
    gpu_pids: dict[int, int] = field(default_factory=dict)
    gpu_holders: tuple[tuple[int, int], ...] = ()
    # (kind, root pid) of each engine tree in the census (with `engines`): they change only when trees come and go,
    # so they cost no extra message; the flight recorder names the trees with them far from the floor.
    engine_roots: tuple[tuple[str, int], ...] = ()


# A GroupTeardownMsg is sent again at most this often while a member it names still runs (the guard may have been busy
# or refused it; it checks each member itself every time): the Ray group watch and the --nnodes one alike.
TEARDOWN_RESEND_S = 2.0


@dataclass(frozen=True, slots=True)
class GroupTeardownMsg:
    KIND: ClassVar[Kind] = Kind.GROUP_TEARDOWN
    ASKS: ClassVar[Trigger] = Trigger.GROUP_TEARDOWN  # a kill request: guard.groupwatch verifies it
    group: str  # the group's id (Ray: its placement group; without Ray: the rendezvous, core.kill.mpgroup)
    cause: str  # core.kill.raygroup: rank_died, node_dead; core.kill.mpgroup: rank_died, peer_lost
    first_node: str  # where the first member died (Ray: its node's address)
    first_pid: int | None
    members: tuple[tuple[int, int, str], ...] = ()  # this node's members: (pid, start ticks, role)
    detected_ts: float = 0.0  # wall clock when telemetry saw the death
    # The word of the peer agent on the node where it died, when its guard killed it (telemetry.peerwatch): text only
    peer_word: str | None = None
    # The user whose group it is (Ray: the uid of the raylets that serve its cluster here; without Ray: its members'):
    # the guard touches only that user's processes for it, and none for a message that names no user
    owner_uid: int = -1


@dataclass(frozen=True, slots=True)
class PeerBudgetMsg:
    """This node's Ray ranks of engines launched on another node with `--budget worker=SIZE`, as that node's agent
    declared them (telemetry.raywatch): the whole set each time, resent every PEER_BUDGET_RESEND_S; the guard drops a
    set older than PEER_BUDGET_TTL_S. The guard checks each tree itself (an engine tree whose root is that pid, start
    time and uid) before it holds it to the budget."""

    KIND: ClassVar[Kind] = Kind.PEER_BUDGET
    budgets: tuple[tuple[int, int, int, int, str], ...] = ()  # (pid, start ticks, uid, budget bytes, group)


PEER_BUDGET_RESEND_S = 10.0
PEER_BUDGET_TTL_S = 30.0


@dataclass(frozen=True, slots=True)
class GpuSampleMsg:
    KIND: ClassVar[Kind] = Kind.GPU_SAMPLE
    ts: float  # wall clock of the NVML reading
    # pid -> NVML's bytes, for every watched pid (0: NVML listed it with nothing, or not at all)
    pids: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class WedgedMsg:
    KIND: ClassVar[Kind] = Kind.WEDGED
    ASKS: ClassVar[Trigger] = Trigger.WEDGED  # a kill request: guard.wedgewatch verifies it
    kind: str  # the engine's kind, as telemetry named it
    root_pid: int
    start_ticks: int
    wedged_for_s: float  # since the first failed probe of the run that wedged it
    failures: int  # failed probes in a row
    error: str = ""  # the last failure, in words (never the key)
    counter: str = ""  # the engine's progress counter the probe's look found unmoved (core.engines.progress)
    counter_value: float = 0.0  # its value, as it stayed


# An unchanged set of containers is sent again this often: a datagram the full channel refused is not the end of it.
CONTAINERS_RESEND_S = 30.0


@dataclass(frozen=True, slots=True)
class ContainersMsg:
    KIND: ClassVar[Kind] = Kind.CONTAINERS
    containers: tuple[ContainerNote, ...] = ()


Message = (
    SettingsMsg
    | StateMsg
    | EventMsg
    | AppliedMsg
    | AckMsg
    | TelMsg
    | GpuSampleMsg
    | GroupTeardownMsg
    | WedgedMsg
    | PeerBudgetMsg
    | ContainersMsg
)
_BY_KIND: dict[str, type[Any]] = {
    cls.KIND: cls
    for cls in (
        SettingsMsg,
        StateMsg,
        EventMsg,
        AppliedMsg,
        AckMsg,
        TelMsg,
        GpuSampleMsg,
        GroupTeardownMsg,
        WedgedMsg,
        PeerBudgetMsg,
        ContainersMsg,
    )
}

# The telemetry → guard messages that ask for a kill (an `ASKS` trigger each): the guard's supervisor hands each to its
# verifier (guard.supervisor's `verifiers` table, built in guard.process), which checks it in the guard's own reads of
# /proc and hands what passes to the guard's inbox. A test holds that table covering every one of these.
KILL_ASKS: tuple[type[GroupTeardownMsg | WedgedMsg], ...] = tuple(
    cls for cls in _BY_KIND.values() if hasattr(cls, "ASKS")
)


def encode(msg: Message) -> bytes:
    if isinstance(msg, EventMsg):
        body: dict[str, Any] = {"event": to_json(msg.event.to_json_dict())}
    else:
        body = to_json(msg)
    return json.dumps({"v": VERSION, "t": msg.KIND, **body}, separators=(",", ":"), default=str).encode()


def decode(data: bytes) -> Message:
    """The message in one datagram. Raises BadMessage with a short reason."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"{len(data)} bytes, over {MAX_MESSAGE_BYTES}")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise BadMessage("not JSON") from None
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        raise BadMessage("not a message of this version")
    cls = _BY_KIND.get(str(raw.get("t")))
    if cls is None:
        raise BadMessage(f"unknown kind {raw.get('t')!r}")
    body = {k: v for k, v in raw.items() if k not in ("v", "t")}
    try:
        if cls is EventMsg:
            return EventMsg(event_from_json(body.get("event")))
        msg: Message = from_json(cls, body, cls.KIND.value)
    except WireError as exc:
        raise BadMessage(str(exc)) from None
    _check_sizes(msg)
    return msg


def _check_sizes(msg: Message) -> None:
    sizes: list[int] = []
    if isinstance(msg, TelMsg):
        sizes = [len(msg.gpu_pids), len(msg.gpu_holders), len(msg.engine_roots)]
    elif isinstance(msg, GpuSampleMsg) and len(msg.pids) > MAX_GPU_WATCH_PIDS:
        raise BadMessage(f"{msg.KIND}: more than {MAX_GPU_WATCH_PIDS} pids")
    elif isinstance(msg, AckMsg):
        sizes = [len(msg.ids)]
    elif isinstance(msg, GroupTeardownMsg):
        sizes = [len(msg.members)]
    elif isinstance(msg, PeerBudgetMsg):
        sizes = [len(msg.budgets)]
    elif isinstance(msg, ContainersMsg):
        _check_notes(msg.containers)
    elif isinstance(msg, StateMsg):
        sizes = [len(msg.counters), *(len(c) for c in msg.counters.values())]
    if any(n > MAX_ITEMS for n in sizes):
        raise BadMessage(f"{msg.KIND}: more than {MAX_ITEMS} items")


def _check_notes(notes: tuple[ContainerNote, ...]) -> None:
    if len(notes) > NOTES_MAX:
        raise BadMessage(f"{Kind.CONTAINERS}: more than {NOTES_MAX} containers")
    for n in notes:
        if len(n.id) != 64 or any(len(t) > NOTE_TEXT_MAX for t in (n.name, n.image, n.project, n.service)):
            raise BadMessage(f"{Kind.CONTAINERS}: a container id of other than 64 digits, or a name past the limit")
        if n.budget_bytes is not None and n.budget_bytes <= 0:
            raise BadMessage(f"{Kind.CONTAINERS}: a budget of {n.budget_bytes} bytes")


_EVENT_HEAD = ("id", "ts", "kind", "node", "summary")


def event_from_json(data: object) -> Event:
    """An Event from its events.jsonl form (`Event.to_json_dict`). Raises WireError."""
    if not isinstance(data, Mapping) or not all(isinstance(data.get(k), str) for k in _EVENT_HEAD):
        raise WireError("event: expected an object with id, ts, kind, node and summary")
    try:
        kind = EventKind(data["kind"])
    except ValueError:
        raise WireError(f"event: unknown kind {data['kind']!r}") from None
    return Event(
        id=data["id"],
        ts=data["ts"],
        kind=kind,
        node=data["node"],
        summary=data["summary"],
        fields={k: v for k, v in data.items() if k not in _EVENT_HEAD},
    )
