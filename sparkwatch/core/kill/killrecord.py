"""What a kill leaves behind: the greppable line and the fields of the `kill` event (docs/contract.md, Events)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from sparkwatch.core.container import ContainerNote
from sparkwatch.core.engines.progress import COUNTER_WORDS
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, MemInfo, Proc
from sparkwatch.core.redact import safe_cmdline
from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural


@dataclass(frozen=True, slots=True)
class GroupLoss:
    """Trigger `group_teardown`: an engine group spanning nodes lost a member (core.kill.raygroup), and this node stops
    its own members of it. `roles`: (pid, role) of the members the guard checked; `detected_ts`: wall clock of the death
    in Ray's state (0: unknown)."""

    group: str
    cause: str
    first_node: str
    first_pid: int | None
    roles: tuple[tuple[int, str], ...]
    detected_ts: float = 0.0
    peer_word: str | None = None  # the peer guard's own line when it killed the first member (text only)

    @property
    def label(self) -> str:
        """The group as the line and the summary name it: a Ray placement group's id (36 hex digits) by its first 12,
        as `sparkwatch engines` shows it; a group without Ray by its whole rendezvous (`10.9.0.1:29500`), which cut
        to 12 read `10.9.0.1:295`, another port. The event's `group` field is always whole."""
        if len(self.group) > 12 and all(c in "0123456789abcdef" for c in self.group):
            return self.group[:12]
        return self.group

    @property
    def death(self) -> str:
        """The first death in words, the one wording of the line, the summary and the reasons. A rank Ray never
        placed has no node and no pid: its actor died before it started (its creation cancelled), and the engine's
        start failed with it."""
        if self.peer_word:
            return f"pid {self.first_pid} on {self.first_node} was {self.peer_word}"
        if not self.first_node and self.first_pid is None:
            return f"{self.cause}: a rank died before Ray placed it (its start failed)"
        return f"{self.cause} on {self.first_node or '?'} (pid {self.first_pid if self.first_pid is not None else '?'})"


@dataclass(frozen=True, slots=True)
class WedgeStall:
    """Trigger `wedged`: what the serving probe and the engine's own counters said (core.engines.serving, .progress):
    the failed probes in a row, since the first of them, the last failure, and the progress counter that stayed."""

    failures: int
    wedged_for_s: float
    error: str
    counter: str
    counter_value: float

    @property
    def stayed(self) -> str:
        """`tokens generated stayed at 1234` (core.engines.progress's words for the counter)."""
        return f"{COUNTER_WORDS.get(self.counter, self.counter)} stayed at {self.counter_value:.0f}"


@dataclass(frozen=True, slots=True)
class KillFacts:
    """Everything known about one guard firing, measured by the guard and the reaper."""

    trigger: Trigger
    mem: MemInfo
    floor_bytes: int
    fill_rate_bytes_per_s: float
    dry_run: bool
    trees: tuple[EngineTree, ...]
    victims: tuple[tuple[Proc, str], ...]  # (process, engine kind) actually signalled (or that would be)
    detect_to_signal_ms: float | None = None
    signal_to_reaped_ms: float | None = None
    reclaimed_bytes: int | None = None
    survivors: tuple[int, ...] = ()  # pids not reaped within the wait (D state, or not ours)
    method: str = "pidfd"
    # What the victims held when they were signalled: RSS from the scan, GPU bytes from telemetry's last per-pid
    # reading (None: no fresh reading; on a GB10 RSS misses the GPU share: a 77 GiB engine showed 1.8 GiB RSS).
    victim_rss_bytes: int | None = None
    victim_gpu_bytes: int | None = None
    # MemAvailable settle_s after the reap. Not "what came back": on this project's VM MemAvailable read 0-125 MiB
    # higher 0.5 s after a 1.3 GiB tree was reaped (freed pages sit in per-CPU lists), so the record gives both figures.
    available_after_settle_bytes: int | None = None
    settle_s: float | None = None
    why_this_tree: tuple[str, ...] = ()  # the ranking's reasons for the victim
    ranking: tuple[tuple[int, str, tuple[str, ...]], ...] = ()  # (root pid, kind, reasons) in kill order
    # trigger "budget" (core.kill.budget): the tree's budget, its footprint when it died, where the footprint came from
    budget_bytes: int | None = None
    footprint_bytes: int | None = None
    footprint_source: str | None = None
    budget_source: str | None = None
    group: GroupLoss | None = None  # trigger "group_teardown"
    wedge: WedgeStall | None = None  # trigger "wedged"
    # What telemetry last told the guard of the killed trees' containers (name, image, compose service), by id; a
    # container it did not name is recorded by its id alone (core.containerid).
    container_notes: tuple[ContainerNote, ...] = ()

    def note_of(self, tree: EngineTree) -> ContainerNote | None:
        ref = tree.container
        if ref is None:
            return None
        return next((n for n in self.container_notes if n.id == ref.id), None)


def kill_reason(facts: KillFacts) -> str:
    """Why the guard fired, one sentence per trigger (core.kill.triggers: the match names every member, and mypy's
    exhaustiveness check fails the lint for a new one without its sentence): a wedged engine's kill once said
    `MemAvailable 22.8 GiB <= floor 4.0 GiB`, the floor's sentence, for a pool far above it. Every size of a kill's
    record is written by core.units.format_size, in the line, the summary and the views alike: one kill once showed
    its floor as "21761 MiB" in one place and "21.3 GiB" in another."""
    avail = format_size(facts.mem.available_bytes)
    floor = format_size(facts.floor_bytes)
    under = f"MemAvailable {avail} <= floor {floor}"
    match facts.trigger:
        case Trigger.BUDGET:
            if facts.budget_bytes is None or facts.footprint_bytes is None:
                return under
            return (
                f"footprint {format_size(facts.footprint_bytes)} ({facts.footprint_source}) over its budget "
                f"{format_size(facts.budget_bytes)} ({facts.budget_source}); MemAvailable {avail}"
            )
        case Trigger.GROUP_TEARDOWN:
            if facts.group is None:
                return under
            return f"group {facts.group.label} lost a member: {facts.group.death}"
        case Trigger.WEDGED:
            if facts.wedge is None:
                return under
            w = facts.wedge
            return (
                f"engine wedged: {plural(w.failures, 'probe')} failed over {w.wedged_for_s:.0f} s with no progress in "
                f"its counters ({w.stayed})"
            )
        case Trigger.ESCALATE:
            return f"MemAvailable {avail} still <= floor {floor} after the last kill"
        case Trigger.PREDICTED:
            return (
                f"MemAvailable {avail} falling {format_size(facts.fill_rate_bytes_per_s)}/s, "
                f"predicted to cross floor {floor}"
            )
        case Trigger.DRIVER_ALLOC_FAILED:  # core.driver.nvrm's corroboration: the driver ran out first
            return f"NVIDIA driver allocation failed at MemAvailable {avail}, within warn_headroom of floor {floor}"
        case Trigger.HUNT:  # core.kill.trigger: under the floor, and the last look found no engine to kill
            return f"MemAvailable {avail} still <= floor {floor} (looking again: the last look found no engine to kill)"
        case Trigger.FLOOR:
            return under
        case _:
            assert_never(facts.trigger)


def kill_line(facts: KillFacts) -> str:
    """`sparkwatch: KILL vllm tree root=1234 (9 processes): MemAvailable 4.6 GiB <= floor 8.0 GiB`"""
    verb = "DRY-RUN would KILL" if facts.dry_run else "KILL"
    if not facts.trees:
        return f"sparkwatch: NO ENGINE TO KILL: {kill_reason(facts)}"
    parts = [
        f"{t.kind} tree root={t.root.pid}{in_container(t, facts.note_of(t))} ({plural(len(t.members), 'process')})"
        for t in facts.trees
    ]
    why = f" [{'; '.join(facts.why_this_tree)}]" if facts.why_this_tree else ""
    return f"sparkwatch: {verb} {', '.join(parts)}: {kill_reason(facts)}{why}"


def terminal_note(facts: KillFacts, tree: EngineTree) -> str:
    """The one line written to a killed tree root's own terminal (guard.ttynote), so the owner's screen says who
    killed the engine and why, under the shell's `Killed`. Only sparkwatch's words and numbers: no title or command
    line of any process reaches a terminal."""
    kind = "".join(c for c in tree.kind if c.isascii() and c.isprintable())[:32]
    return (
        f"sparkwatch: killed this {kind} engine (pid {tree.root.pid}, {plural(len(tree.members), 'process')}) "
        f"before memory ran out: {kill_reason(facts)}. Details: sparkwatch events"
    )


def kill_summary(facts: KillFacts) -> str:
    if facts.group is not None:
        g, roles = facts.group, dict(facts.group.roles)
        members = ", ".join(f"{roles.get(p.pid, 'child')} {p.pid}" for p, _kind in facts.victims)
        verb = "would stop" if facts.dry_run else "stopped"
        return f"group {g.label}: {g.death}; {verb} {plural(len(facts.victims), 'local member')}: {members}"
    if not facts.trees:
        return f"Memory ran low ({kill_reason(facts)}) but no engine process was found to kill."
    names = ", ".join(
        f"{t.kind} (root pid {t.root.pid}, {plural(len(t.members), 'process')}){in_container(t, facts.note_of(t))}"
        for t in facts.trees
    )
    head = "Would have killed" if facts.dry_run else "Killed"
    tail = ""
    if facts.victim_rss_bytes is not None:
        gpu = "" if facts.victim_gpu_bytes is None else f" and {format_size(facts.victim_gpu_bytes)} of GPU memory"
        tail = f"; {'they' if facts.dry_run else 'the victims'} held {format_size(facts.victim_rss_bytes)} RSS{gpu}"
    if facts.available_after_settle_bytes is not None and not facts.dry_run:
        tail += (
            f"; MemAvailable was {format_size(facts.available_after_settle_bytes)} "
            f"{facts.settle_s or 0:.1f} s after the reap"
        )
    if facts.survivors:
        tail += f"; {plural(len(facts.survivors), 'process')} had not exited yet"
    return f"{head} {names}: {kill_reason(facts)}{tail}."


def kill_fields(facts: KillFacts) -> dict[str, object]:
    return {
        "trigger": facts.trigger,
        "mem_available_bytes": facts.mem.available_bytes,
        "floor_bytes": facts.floor_bytes,
        "fill_rate_bytes_per_second": round(facts.fill_rate_bytes_per_s),
        "dry_run": facts.dry_run,
        "method": facts.method,
        "victims": [
            {
                "pid": p.pid,
                "name": p.display_name,
                "engine": kind,
                "rss_bytes": p.rss_bytes,
                "cmdline": safe_cmdline(p.argv),
            }
            for p, kind in facts.victims
        ],
        "detect_to_signal_ms": _ms(facts.detect_to_signal_ms),
        "signal_to_reaped_ms": _ms(facts.signal_to_reaped_ms),
        "reclaimed_bytes": facts.reclaimed_bytes,
        "survivors": list(facts.survivors),
        "victim_rss_bytes": facts.victim_rss_bytes,
        "victim_gpu_bytes": facts.victim_gpu_bytes,
        "mem_available_after_settle_bytes": facts.available_after_settle_bytes,
        "why": list(facts.why_this_tree),
        "ranking": [{"root_pid": pid, "engine": kind, "why": list(why)} for pid, kind, why in facts.ranking],
        **(
            {
                "budget_bytes": facts.budget_bytes,
                "footprint_bytes": facts.footprint_bytes,
                "footprint_source": facts.footprint_source,
                "budget_source": facts.budget_source,
            }
            if facts.trigger == "budget"
            else {}
        ),
        **(_group_fields(facts.group, facts.victims) if facts.group is not None else {}),
        **({"containers": containers} if (containers := _container_fields(facts)) else {}),
        **(
            {
                "failures": facts.wedge.failures,
                "wedged_for_s": facts.wedge.wedged_for_s,
                "probe_error": facts.wedge.error,
                "progress_counter": facts.wedge.counter,
                "progress_value": facts.wedge.counter_value,
            }
            if facts.wedge is not None
            else {}
        ),
    }


def _group_fields(g: GroupLoss, victims: Sequence[tuple[Proc, str]]) -> dict[str, object]:
    roles = dict(g.roles)
    return {
        "group": g.group,
        "cause": g.cause,
        "first_node": g.first_node,
        "first_pid": g.first_pid,
        "members": [{"pid": p.pid, "role": roles.get(p.pid, "child")} for p, _kind in victims],
        "detected_ts": g.detected_ts or None,  # wall clock: when telemetry saw the death in Ray's state
        "peer_word": g.peer_word,  # the peer guard's line when it killed the first member; None: it did not, or unknown
    }


def in_container(tree: EngineTree, note: ContainerNote | None = None) -> str:
    """` in container vllm-main (nvcr.io/nvidia/vllm:25.09-py3 spark/vllm; 4f4f4f4f4f4f)` for a tree in a container
    telemetry named, ` in container 4f4f4f4f4f4f` (the id `docker ps` shows) for one it did not, "" for a bare one."""
    ref = tree.container
    if ref is None:
        return ""
    if note is not None and note.id == ref.id:
        return f" in {note.label(with_id=True)}"
    return f" in container {ref.short_id}"


def container_entry(tree: EngineTree, note: ContainerNote | None) -> dict[str, object] | None:
    """A tree's container as events carry it: {root_pid, runtime, id} from the cgroup path, and the name, image and
    compose service (`compose_project`, `compose_service`) when telemetry named it; None for a bare tree."""
    ref = tree.container
    if ref is None:
        return None
    entry: dict[str, object] = {"root_pid": tree.root.pid, "runtime": ref.runtime, "id": ref.id}
    if note is not None and note.id == ref.id:
        entry.update(note.fields())
    return entry


def _container_fields(facts: KillFacts) -> list[dict[str, object]]:
    """The event's `containers`: each killed tree's container by its full id (telemetry's after-kill policy and the
    views find it by that id), from the cgroup path, with its names where telemetry gave them."""
    return [entry for t in facts.trees if (entry := container_entry(t, facts.note_of(t))) is not None]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def victims_of(trees: Sequence[EngineTree]) -> tuple[tuple[Proc, str], ...]:
    return tuple((p, t.kind) for t in trees for p in t.members)
