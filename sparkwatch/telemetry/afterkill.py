"""A kill is not undone by a restart policy, telemetry's half: a container whose engine the guard killed and that its
restart policy starts again is paused (`gate`), stopped through the API's kill (`stop`) or let run (`allow`), as its
label `io.sparkwatch.after-kill` or `container_after_kill` says; a second kill within the loop window stops it whatever
its policy, with one alert. core.containerpolicy decides; this module hears and acts (docs/containers.md).

The guard's kill stays the guard's: dockerd is never on its path. What this module hears:
- the guard's state (`recent_kills`, remembered at the signal; a kill opens an episode, which the guard's next tick
  tells the supervisor at once, guard.poolwatch `on_news`) and its `kill` event (after the reap and kill_settle_s,
  with the footprint and the container ids): the kills, each by container;
- the container watch (telemetry.containerwatch): each container's `start` (a restart when its restart count is
  above 0), `die`, `unpause`, …, and the init pid of each running container (a killed pid's container);
- telemetry's cycle: the engine trees in containers (their pids, and a launch declaration's peak key and plan), and,
  while a gate holds, MemAvailable, Shmem and the engine processes still letting go (core.launch.settle's inputs);
- the container watch's word that the API answers (`containers_up`): the gates a previous telemetry process left.

One worker thread does everything in order, the Docker API calls included, so no caller blocks: the inputs come from
the watch's thread, the channel's and the telemetry loop's, through a queue. Between inputs it sleeps without a
timeout: a node without Docker never wakes it (it looked once a second for the watch to come up, for two minutes
after each start, before the watch said so itself). A restart is answered as soon as both the
kill and the start are known: dockerd starts a container again 0.3-0.4 s after its PID 1 died (its 100 ms delay and
runc), and the guard's state with the kill comes before that, so the pause follows the `start` event by one inspect
and one POST: 15 ms median, 48 ms worst of 20 (bench/RESULTS-afterkill.md). The kill event alone would come ~0.6 s
after the start, past the 500 ms target. A failure of the API (no daemon, 409 conflict) is counted and logged; the
guard runs on.

A gate is recorded (`container_gated`) and so is its end (`container_released`): `status` shows the gated containers
from the event log (core.report.gates.gated_now), and a telemetry process that restarts takes up the gates the log
shows on a container still paused.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sparkwatch.common import logs, peakstore
from sparkwatch.common.eventlog import EventLog, EventLogError, make_event, read_events
from sparkwatch.common.launched import Declaration
from sparkwatch.common.stats import RecentKill
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core import containerpolicy as policy
from sparkwatch.core.container import AfterKill, ContainerFacts
from sparkwatch.core.containerpolicy import ContainerKill, Gate
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill.killloop import LOOP_WINDOW_S
from sparkwatch.core.model import EngineTree, Event
from sparkwatch.core.report.gates import gated_now
from sparkwatch.core.timestamps import parse_rfc3339
from sparkwatch.core.units import format_size
from sparkwatch.telemetry.sources.dockerapi import DockerApi, DockerApiError, DockerEvent

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings
    from sparkwatch.telemetry.containerwatch import ContainerStore

log = logs.get("afterkill")

PIDS_KEPT = 4096  # pid -> container of engine trees and init processes seen lately
PLANS_KEPT = 256  # root pid -> a launch declaration's peak key and estimate
RECOVER_EVENTS = 500  # events read back at start for gates a previous telemetry process left


@dataclass(frozen=True, slots=True)
class _Docker:
    event: DockerEvent
    facts: ContainerFacts | None


@dataclass(frozen=True, slots=True)
class _Recent:
    kills: tuple[RecentKill, ...]


@dataclass(frozen=True, slots=True)
class _Killed:
    event: Event


@dataclass(frozen=True, slots=True)
class _Cycle:
    t: float  # monotonic
    available_bytes: int | None
    shmem_bytes: int | None
    letting_go: int
    pids: Mapping[int, tuple[str, int]]  # pid -> (container id, its tree's root pid)
    plans: Mapping[int, tuple[str, int | None]]  # root pid -> (peak key, plan estimate)


@dataclass(frozen=True, slots=True)
class _Up:
    """The container watch's word that the Docker API answers."""


_Item = _Docker | _Recent | _Killed | _Cycle | _Up | None
# After a cycle, while a gate holds: (MemAvailable, Shmem, engine processes still letting go) from its snapshot.
Look = Callable[[], tuple[int | None, int | None, int]]


def container_pids(trees: Sequence[EngineTree]) -> dict[int, tuple[str, int]]:
    """Every process of the engine trees that run in a container: pid -> (container id, root pid)."""
    out: dict[int, tuple[str, int]] = {}
    for tree in trees:
        ref = tree.container
        if ref is not None:
            for p in tree.members:
                out[p.pid] = (ref.id, tree.root.pid)
    return out


class AfterKillWatch:
    """A component of the telemetry process (common.lifecycle): `start`, `stop`, `apply`, `counters`; the inputs
    (`container_event`, `containers_up`, `guard_state`, `guard_event`, `cycle`) never block."""

    name = "afterkill"
    LIVE_KEYS = frozenset({"container_after_kill"})

    def __init__(
        self,
        settings: Settings,
        events: EventLog,
        *,
        containers: ContainerStore | None,
        socket_path: str | None,
        where: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.configured = AfterKill(settings.container_after_kill)
        self.events = events
        self.containers = containers
        self.where = where
        self.clock = clock
        self.api = DockerApi(socket_path) if socket_path else None
        self.errors: dict[str, int] = {
            "unreachable": 0,
            "refused": 0,
            "timeout": 0,
            "broken": 0,
            "status": 0,
            "no_api": 0,
            "events": 0,
            "bugs": 0,
        }
        self._inbox: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._published: tuple[Gate, ...] = ()  # the gates, for the metrics (under _lock)
        self._recent_seen = 0.0  # the newest guard kill handed on (channel thread)
        # the worker's own
        self._kills: dict[str, tuple[ContainerKill, ...]] = {}
        self._starts: dict[str, tuple[float, ContainerFacts]] = {}  # restarts not answered yet: (start ts, facts)
        self._pids: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._plans: OrderedDict[int, tuple[str, int | None]] = OrderedDict()
        self._gates: dict[str, Gate] = {}
        self._recovered = False
        self._status = 0  # the HTTP status of the last act that failed with one (0: none)

    # --- lifecycle ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = daemon_thread(self._run, "sparkwatch-afterkill")
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join(5)
        if self.api is not None:
            self.api.close()

    def apply(self, settings: Settings) -> frozenset[str]:
        self.settings = settings
        self.configured = AfterKill(settings.container_after_kill)
        return self.LIVE_KEYS

    def counters(self) -> dict[str, int]:
        return {
            **{f"api_errors_{k}": n for k, n in self.errors.items() if k not in ("events", "bugs")},
            "event_errors": self.errors["events"],
            "errors": self.errors["bugs"],
        }

    def gated(self) -> tuple[Gate, ...]:
        """The containers held paused now (any thread)."""
        with self._lock:
            return self._published

    # --- inputs (any thread; never block) ----------------------------------------------------------------------

    def container_event(self, event: DockerEvent, facts: ContainerFacts | None) -> None:
        """A subscriber of the container watch (its thread)."""
        self._inbox.put(_Docker(event, facts))

    def containers_up(self) -> None:
        """The container watch's word that the API answers (its thread, on_up): the gates left held are taken up."""
        self._inbox.put(_Up())

    def guard_state(self, recent: Sequence[RecentKill]) -> None:
        """The guard's last kills, from each state it sends (the channel's thread): only new ones are handed on."""
        if recent and recent[-1].ts > self._recent_seen:
            fresh = tuple(k for k in recent if k.ts > self._recent_seen)
            self._recent_seen = recent[-1].ts
            self._inbox.put(_Recent(fresh))

    def guard_event(self, event: Event) -> None:
        """A guard event (the channel's thread): its kills that name containers."""
        if event.kind == EventKind.KILL and event.fields.get("containers"):
            self._inbox.put(_Killed(event))

    def cycle(self, trees: Sequence[EngineTree], declarations: Sequence[Declaration], look: Look) -> None:
        """After each telemetry cycle (its thread): the trees in containers; while a gate holds, the pool's look."""
        pids = container_pids(trees)
        gating = bool(self._published)
        if not pids and not gating:
            return
        roots = {root for _cid, root in pids.values()}
        plans = {d.root_pid: (d.key, d.estimate_bytes) for d in declarations if d.root_pid in roots}
        available = shmem = None
        letting_go = 0
        if gating:
            available, shmem, letting_go = look()
        self._inbox.put(_Cycle(time.monotonic(), available, shmem, letting_go, pids, plans))

    # --- the worker --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        # The gates a previous telemetry process left held are taken up once the container watch is up: at once when
        # it already is, else at its word (`containers_up`, queued like any input) or at the first input after it
        # came up. Then the worker sleeps until an input comes, with no timeout: no Docker, no wake-up.
        while True:
            if not self._recovered and self.containers is not None and self.containers.up:
                self._recovered = True
                self._recover()
            item = self._inbox.get()
            if item is None:
                return
            if isinstance(item, _Up):
                continue
            try:
                self._handle(item)
            except Exception as exc:  # a bug: counted and said; the worker and the guard run on
                self.errors["bugs"] += 1
                log.error("after-kill: %s failed: %s: %s", type(item).__name__, type(exc).__name__, exc)

    def _handle(self, item: _Docker | _Recent | _Killed | _Cycle) -> None:
        if isinstance(item, _Docker):
            self._on_docker(item.event, item.facts)
        elif isinstance(item, _Recent):
            self._on_recent(item.kills)
        elif isinstance(item, _Killed):
            self._on_killed(item.event)
        else:
            self._on_cycle(item)

    def _remember_pid(self, pid: int, owner: tuple[str, int]) -> None:
        self._pids[pid] = owner
        self._pids.move_to_end(pid)
        while len(self._pids) > PIDS_KEPT:
            self._pids.popitem(last=False)

    def _on_docker(self, event: DockerEvent, facts: ContainerFacts | None) -> None:
        cid = event.id
        if event.action == "start":
            if facts is not None and facts.pid:
                self._remember_pid(facts.pid, (cid, facts.pid))
            if facts is not None and facts.restart_count > 0:
                start_ts = event.time_ns / 1e9 if event.time_ns else self.clock()
                self._starts[cid] = (start_ts, facts)
                self._answer(cid)
            return
        if event.action in ("die", "destroy", "kill", "unpause"):
            self._starts.pop(cid, None)
            gate = self._gates.get(cid)
            if gate is not None:  # ours are gone from the gates before their own events come
                self._end_gate(gate, facts, by="owner", why=f"its owner's {event.action}")

    def _on_recent(self, kills: Sequence[RecentKill]) -> None:
        """Kills at their signal: each pid's container from the trees and init processes seen lately."""
        for kill in kills:
            seen: set[tuple[str, int]] = set()
            for pid in kill.pids:
                owner = self._pids.get(pid) or self._init_owner(pid)
                if owner is not None and owner not in seen:
                    seen.add(owner)
                    self._note(ContainerKill(owner[0], owner[1], kill.ts, kill.trigger))

    def _init_owner(self, pid: int) -> tuple[str, int] | None:
        if self.containers is None:
            return None
        for facts in self.containers.running():
            if facts.pid == pid:
                return facts.id, pid
        return None

    def _on_killed(self, event: Event) -> None:
        """The kill's event: its containers, what the victims held; the signal's time estimated back from it where
        the guard's state did not give it (the reap's time and the settle)."""
        fields = event.fields
        footprint = policy.kill_footprint(fields)
        recorded = parse_rfc3339(event.ts) or self.clock()
        reaped_ms = fields.get("signal_to_reaped_ms")
        back_s = (reaped_ms / 1000 if isinstance(reaped_ms, (int, float)) else 0.0) + self.settings.kill_settle_s
        containers = fields.get("containers")
        for entry in containers if isinstance(containers, list) else ():
            if not isinstance(entry, dict):
                continue
            cid, root = entry.get("id"), entry.get("root_pid")
            if isinstance(cid, str) and isinstance(root, int):
                trigger = str(fields.get("trigger", ""))
                self._note(
                    ContainerKill(
                        cid, root, recorded - back_s, trigger, exact=False, footprint_bytes=footprint, confirmed=True
                    )
                )
                gate = self._gates.get(cid)
                if gate is not None and (gate.need is None or gate.need.source == "kill footprint"):
                    need = policy.need_of(None, None, footprint)
                    self._gates[cid] = replace(gate, need=need)
                    self._publish()

    def _note(self, kill: ContainerKill) -> None:
        self._kills = policy.note_kill(self._kills, kill)
        self._answer(kill.container_id)

    def _answer(self, cid: str) -> None:
        """Act on a restart once both its kill and its start are known."""
        pending = self._starts.get(cid)
        if pending is None:
            return
        start_ts, facts = pending
        kills = self._kills.get(cid, ())
        kill = policy.answered_kill(kills, start_ts, facts.restart_count)
        if kill is None:
            return
        del self._starts[cid]
        self._kills[cid] = tuple(replace(k, answered=True) if k == kill else k for k in kills)
        decision = policy.decide(kills, start_ts, facts.labels, self.configured)
        for problem in decision.problems:
            log.warning("after-kill: %s: %s; container_after_kill = %s decides", facts.name, problem, self.configured)
        fields = {
            **policy.container_fields(facts, cid),
            "kill_trigger": kill.trigger,
            "kill_root_pid": kill.root_pid,
            "kills": decision.kills,
            "policy": str(decision.action),
            "policy_source": decision.source,
        }
        if decision.loop:
            self._loop(cid, facts, fields, decision.kills)
        elif decision.action == AfterKill.GATE:
            self._gate(cid, facts, kill, start_ts, fields)
        elif decision.action == AfterKill.STOP:
            error = self._act("kill", cid)
            done = f"could not stop it: {error}" if error else "its restart cancelled through the API's kill"
            summary = f"{policy.named(fields)} restarted after a guard kill ({kill.trigger}): {done}"
            self._record(EventKind.CONTAINER_STOPPED, summary, {**fields, "error": error})
        else:
            summary = (
                f"{policy.named(fields)} restarted after a guard kill ({kill.trigger}); let run (after-kill allow, "
                f"{decision.source})"
            )
            self._record(EventKind.CONTAINER_ALLOWED, summary, fields)

    def _gate(
        self, cid: str, facts: ContainerFacts, kill: ContainerKill, start_ts: float, fields: dict[str, object]
    ) -> None:
        error = self._act("pause", cid)
        paused_at = self.clock()
        need = self._need(kill)
        took_ms = round((paused_at - start_ts) * 1000, 1)
        extra: dict[str, object] = {
            "restart_to_pause_ms": took_ms if error is None else None,
            "need_bytes": need.bytes if need is not None else None,
            "need_source": need.source if need is not None else None,
            "floor_bytes": self.settings.floor,
            "error": error,
        }
        if error is None:
            self._gates[cid] = Gate(cid, facts.name, facts.image, paused_at, kill.ts, kill.root_pid, need)
            self._publish()
            log.warning(
                "after-kill: %s paused %.0f ms after its restart (the guard killed its engine: %s)",
                policy.named(fields),
                took_ms,
                kill.trigger,
            )
        self._record(EventKind.CONTAINER_GATED, policy.gated_summary(fields, kill, need, error), {**fields, **extra})

    def _need(self, kill: ContainerKill) -> policy.Need | None:
        learned = estimate = None
        plan = self._plans.get(kill.root_pid)
        if plan is not None:
            key, estimate = plan
            record = peakstore.load(self.settings.state_dir).get(key)
            learned = record.learned_bytes if record is not None else None
        return policy.need_of(learned, estimate, kill.footprint_bytes)

    def _loop(self, cid: str, facts: ContainerFacts, fields: dict[str, object], kills: int) -> None:
        error = self._act("kill", cid)
        summary = policy.loop_summary(fields, kills, error)
        log.error("after-kill: %s", summary)
        self._record(
            EventKind.CONTAINER_KILL_LOOP,
            summary,
            {
                **fields,
                "window_s": LOOP_WINDOW_S,
                "stopped": error is None,
                "error": error,
                "fix": policy.loop_fix(facts.name),
            },
        )

    def _on_cycle(self, cycle: _Cycle) -> None:
        for pid, owner in cycle.pids.items():
            if self._pids.get(pid) != owner:
                self._remember_pid(pid, owner)
        for root, plan in cycle.plans.items():
            self._plans[root] = plan
            self._plans.move_to_end(root)
            while len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
        now = self.clock()
        for cid, (start_ts, _facts) in list(self._starts.items()):
            if now - start_ts > policy.RESTART_WINDOW_S:
                del self._starts[cid]
        if cycle.available_bytes is None:
            return
        for cid, held in list(self._gates.items()):
            gate, release = policy.gate_step(
                held,
                cycle.t,
                letting_go=cycle.letting_go,
                available_bytes=cycle.available_bytes,
                floor_bytes=self.settings.floor,
                shmem_bytes=cycle.shmem_bytes,
            )
            self._gates[cid] = gate
            if release:
                self._release(gate)
        self._publish()

    def _release(self, gate: Gate) -> None:
        error = self._act("unpause", gate.container_id)
        if error is not None and self._status not in (404, 409):
            # no daemon, or it failed: tried again at the next cycle (counted and logged each time); a 404 (gone) or
            # a 409 (not paused) leaves nothing to hold
            return
        self._end_gate(
            gate, self.containers.facts(gate.container_id) if self.containers else None, by="sparkwatch", error=error
        )

    def _end_gate(
        self, gate: Gate, facts: ContainerFacts | None, *, by: str, why: str = "", error: str | None = None
    ) -> None:
        self._gates.pop(gate.container_id, None)
        self._publish()
        fields = {
            **policy.container_fields(facts, gate.container_id),
            "container_name": gate.name,
            "image": gate.image,
            "by": by,
            "gated_s": round(self.clock() - gate.since_ts, 1),
            "mem_available_bytes": gate.available_bytes,
            "floor_bytes": self.settings.floor,
            "need_bytes": gate.need.bytes if gate.need is not None else None,
            "need_source": gate.need.source if gate.need is not None else None,
            "error": error,
        }
        if by == "sparkwatch" and error is None:
            avail = format_size(gate.available_bytes or 0)
            need = f", {format_size(gate.need.bytes)} ({gate.need.source}) fits" if gate.need is not None else ""
            summary = (
                f"{policy.named(fields)} unpaused after {fields['gated_s']} s: the pool settled at MemAvailable "
                f"{avail}{need}"
            )
        elif error is not None:
            summary = f"{policy.named(fields)} is no longer held: {error}"
        else:
            summary = f"{policy.named(fields)} is no longer held paused: {why}"
        self._record(EventKind.CONTAINER_RELEASED, summary, fields)

    def _recover(self) -> None:
        """The gates the event log shows (a previous telemetry process's): held again while the container is still
        paused, else recorded as ended."""
        try:
            events = read_events(self.settings.events_path, RECOVER_EVENTS)
        except (OSError, ValueError) as exc:
            log.warning("after-kill: could not read the event log for gates left held: %s", exc)
            return
        assert self.containers is not None
        for view in gated_now(events):
            facts = self.containers.facts(view.container_id)
            need = policy.Need(view.need_bytes, view.need_source or "") if view.need_bytes else None
            gate = Gate(view.container_id, view.name, view.image or "", self.clock(), 0.0, 0, need)
            if facts is not None and facts.state == "paused":
                self._gates[view.container_id] = gate
                log.warning(
                    "after-kill: %s is still paused from before this start: held",
                    policy.named(policy.container_fields(facts, view.container_id)),
                )
            else:
                self._end_gate(gate, facts, by="owner", why="not paused when telemetry started again")
        self._publish()

    # --- acts and records --------------------------------------------------------------------------------------

    def _act(self, verb: str, cid: str) -> str | None:
        """One call of the API (pause, unpause, kill); the error in words, or None. Never raises."""
        self._status = 0
        api = self.api
        if api is None:
            self.errors["no_api"] += 1
            return f"no Docker API: {self.where}"
        try:
            if verb == "pause":
                api.pause(cid)
            elif verb == "unpause":
                api.unpause(cid)
            else:
                api.kill(cid)
        except DockerApiError as exc:
            self.errors[exc.kind] = self.errors.get(exc.kind, 0) + 1
            log.warning("after-kill: %s of container %s failed: %s", verb, cid[:12], exc)
            self._status = exc.status
            return str(exc)
        return None

    def _record(self, kind: EventKind, summary: str, fields: Mapping[str, object]) -> None:
        try:
            self.events.append(make_event(kind, summary, dict(fields)))
        except EventLogError as exc:
            self.errors["events"] += 1
            log.error("after-kill: could not record %s: %s", kind, exc)

    def _publish(self) -> None:
        with self._lock:
            self._published = tuple(self._gates.values())
