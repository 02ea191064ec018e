"""The containers that matter to sparkwatch, as telemetry knows them: those holding an engine tree (by the container
id in the tree's cgroup path, core.containerid) and those carrying `io.sparkwatch.*` labels. Told to the guard
(common.messages.ContainersMsg: names for its kill records, the labels' budget, protection and priority), and
exported as `sparkwatch_container_info` (telemetry.exporter.containermetric).

Fed from two sides, both passed in by the telemetry process, never reaching back:
- `on_event`: a subscriber of the container watch (telemetry.containerwatch), called on its thread with each event
  and the container's facts after it: a container that starts with a budget label is told to the guard within
  milliseconds of its start event, before its engine has loaded anything;
- `observe`: after each telemetry cycle, with the cycle's engine trees and the watch's running containers.
The guard hears the whole set when it changes and every CONTAINERS_RESEND_S while it is not empty; a node without
containers sends nothing. A label that does not parse is named once in the log per container and ignored.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from sparkwatch.common import logs
from sparkwatch.common.messages import CONTAINERS_RESEND_S, ContainersMsg
from sparkwatch.core.container import (
    NOTES_MAX,
    ContainerFacts,
    ContainerNote,
    has_sparkwatch_labels,
    label_asks,
    note_of,
)
from sparkwatch.core.model import EngineTree

if TYPE_CHECKING:
    from sparkwatch.telemetry.sources.dockerapi import DockerEvent

log = logs.get("containers")

LIVE_STATES = frozenset({"running", "paused", "restarting"})
SAID_MAX = 1024  # containers whose bad labels were named; past this the memory starts over (a name said twice)


def engine_container_ids(trees: Iterable[EngineTree]) -> frozenset[str]:
    """The containers the engine trees run in, by full id (from each root's cgroup path)."""
    return frozenset(ref.id for t in trees if (ref := t.container) is not None)


class ContainerBoard:
    def __init__(
        self,
        send: Callable[[ContainersMsg], object],
        *,
        resend_s: float = CONTAINERS_RESEND_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`send`: hands a message to the guard (the channel's send: False when it was refused)."""
        self.send = send
        self.resend_s = resend_s
        self.clock = clock
        self._lock = threading.Lock()
        self._facts: dict[str, ContainerFacts] = {}  # the live containers by id, as the watch last said
        self._engine_ids: frozenset[str] = frozenset()  # the containers the last cycle's engine trees run in
        self._sent: tuple[ContainerNote, ...] = ()
        self._sent_at = -float("inf")
        self._refused = False  # the last send was refused (a full channel): tried again at the next look
        self._said: set[str] = set()
        self.sent_total = 0
        self.bad_labels_total = 0

    def counters(self) -> dict[str, int]:
        return {"bad_labels": self.bad_labels_total}

    # --- the two feeds

    def on_event(self, event: DockerEvent, facts: ContainerFacts | None) -> None:
        """A container watch subscriber (its thread): one container changed."""
        with self._lock:
            if facts is not None and facts.state in LIVE_STATES:
                self._facts[event.id] = facts
            else:
                self._facts.pop(event.id, None)
        self._tell(changed=True)

    def observe(self, trees: Iterable[EngineTree], running: Iterable[ContainerFacts]) -> None:
        """After a telemetry cycle (the loop's thread): its engine trees, and the containers the watch holds. Nothing
        is built when neither changed (the watch keeps a container's facts as one object until its next event) and no
        resend is due: a few comparisons a cycle."""
        engine_ids = engine_container_ids(trees)
        facts = {f.id: f for f in running if f.state in LIVE_STATES}
        with self._lock:
            old = self._facts
            changed = engine_ids != self._engine_ids or facts.keys() != old.keys()
            changed = changed or any(f is not old[i] for i, f in facts.items())
            self._facts, self._engine_ids = facts, engine_ids
        self._tell(changed=changed)

    # --- what the others read

    def engine_containers(self) -> tuple[ContainerFacts, ...]:
        """The containers holding an engine tree whose facts the watch has (for sparkwatch_container_info)."""
        with self._lock:
            return tuple(self._facts[i] for i in sorted(self._engine_ids) if i in self._facts)

    def notes(self) -> tuple[ContainerNote, ...]:
        """What the guard is told: the containers holding an engine tree, then the labelled ones, at most NOTES_MAX."""
        with self._lock:
            facts = dict(self._facts)
            engine_ids = self._engine_ids
        chosen = [f for i, f in sorted(facts.items()) if i in engine_ids]
        chosen += [f for i, f in sorted(facts.items()) if i not in engine_ids and has_sparkwatch_labels(f)]
        out = []
        for f in chosen[:NOTES_MAX]:
            asks = label_asks(f.labels)
            if asks.problems:
                self._say_problems(f, asks.problems)
            out.append(note_of(f, asks))
        return tuple(out)

    # --- the guard

    def _tell(self, *, changed: bool) -> None:
        now = self.clock()
        if not (changed or self._refused) and (not self._sent or now - self._sent_at < self.resend_s):
            return  # nothing new, and no resend due (or nothing to resend)
        notes = self.notes()
        with self._lock:
            due = notes != self._sent or (notes and now - self._sent_at >= self.resend_s)
            if not due:
                self._refused = False
                return
            self._refused = self.send(ContainersMsg(notes)) is False
            if self._refused:
                return  # the channel is full: the next cycle tries again
            self._sent, self._sent_at = notes, now
            self.sent_total += 1

    def _say_problems(self, facts: ContainerFacts, problems: Iterable[str]) -> None:
        if facts.id in self._said:
            return
        if len(self._said) >= SAID_MAX:
            self._said.clear()
        self._said.add(facts.id)
        self.bad_labels_total += 1
        log.warning(
            "containers: %s: %s; ignored (never a reason to kill; fix the label)", facts.label(), "; ".join(problems)
        )
