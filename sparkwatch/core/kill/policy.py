"""Which engine tree the guard kills first, and why: the victim ranking.

Pure: the caller passes the trees of a /proc scan, the monotonic time, and per-pid GPU bytes when telemetry has them.
The guard kills one tree at a time, the first of `rank`'s order that `choose` accepts, so a serving engine that holds
steady is never killed alongside the one whose start-up spike crosses the floor.

The default order (`kill_order = ["priority", "growth", "youngest", "largest"]`):
1. `kill_priority`: an owner's explicit order, higher first (default 0 for every tree);
2. growth: a tree that grew over the last GROWTH_WINDOW_S (RSS, plus GPU bytes where NVML maps a pid) before one
   that did not, faster growth first;
3. youngest: a tree started later before one started earlier (a steady old tree is killed last);
4. largest: more RSS + GPU bytes first.
Always, whatever the order: idle Ray workers (`ray::IDLE`) come after every other tree, and `never_kill` trees are
never chosen (they are listed last, with the pattern that spared them).

A tree in a container (its root's cgroup path names one: core.containerid) whose labels telemetry told the guard
(core.container.ContainerNotes) is also spared by `io.sparkwatch.protect=true`, and ranked by `io.sparkwatch.priority`
instead of `kill_priority` (the container's own word is the more specific one). Without notes no cgroup path is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from sparkwatch.core.container import LABEL_PRIORITY, LABEL_PROTECT, NO_NOTES, ContainerNotes
from sparkwatch.core.engines.identity import compile_regexes
from sparkwatch.core.model import EngineTree
from sparkwatch.core.units import MiB, format_size, parse_size
from sparkwatch.core.userregex import bounded, compile_user_regex

V = TypeVar("V")

# A tree's identity across scans: its root's pid and start time (a reused pid has a new start time).
TreeKey = tuple[int, int]
# Per-pid GPU bytes as telemetry last saw them: (monotonic time of the reading, pid -> bytes).
GpuBytes = tuple[float, Mapping[int, int]]

# Growth is measured over the last 5 s: a Spark's start-up spike drained 29 -> 2.5 GiB in 9 s and 34.0 -> 12.7 GiB
# in about 1.5 s, so a spiking engine shows gigabytes of growth inside this window, while a serving engine that
# loaded its weights minutes ago shows none.
GROWTH_WINDOW_S = 5.0
# A tree "grows" when it gained at least this much over the window. A steady Python engine's RSS moves by a few MiB
# (allocator churn); 64 MiB is well above that and well below any spike (the slowest one seen was ~2.9 GiB/s).
GROWING_MIN_BYTES = 64 * MiB
# History kept per tree: the scout scans at most once a second near the floor, so 16 samples cover the window with
# room for the kill path's own scans; trees beyond MAX_TREES are not tracked (a box runs a handful of engines).
HISTORY_SAMPLES = 16
MAX_TREES = 256
# A GPU reading older than this is ignored (telemetry refreshes every telemetry_interval_s, 1 s by default): a stale
# or missing figure never delays a kill, the ranking simply goes without it.
GPU_STALE_S = 5.0

KILL_ORDER_KEYS = ("priority", "growth", "youngest", "largest")
DEFAULT_KILL_ORDER = KILL_ORDER_KEYS
IDLE_RAY_TITLE = "ray::IDLE"


@dataclass(frozen=True, slots=True)
class TreeSample:
    t: float
    rss_bytes: int
    gpu_bytes: int | None  # None: no fresh GPU reading at that time


@dataclass(frozen=True, slots=True)
class GrowthHistory:
    """A small bounded RSS (+GPU) history per tree, fed by the guard's own scans. Replaced whole, never mutated."""

    trees: Mapping[TreeKey, tuple[TreeSample, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PolicyParams:
    kill_order: tuple[str, ...] = DEFAULT_KILL_ORDER
    kill_priority: tuple[tuple[int, re.Pattern[str]], ...] = ()
    never_kill: tuple[re.Pattern[str], ...] = ()
    growth_window_s: float = GROWTH_WINDOW_S
    growing_min_bytes: int = GROWING_MIN_BYTES

    @classmethod
    def build(
        cls,
        kill_order: Iterable[str] = DEFAULT_KILL_ORDER,
        kill_priority: Iterable[str] = (),
        never_kill: Iterable[str] = (),
    ) -> PolicyParams:
        return cls(
            kill_order=parse_kill_order(kill_order),
            kill_priority=parse_kill_priority(kill_priority),
            never_kill=compile_never_kill(never_kill),
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    """One tree in kill order, with the figures and the words that put it there."""

    tree: EngineTree
    growth_bytes: int | None  # over the window; None: seen in one scan only
    growth_window_s: float
    rss_bytes: int
    gpu_bytes: int | None  # None: no fresh GPU reading
    priority: int
    growing: bool
    idle_ray: bool
    never_kill: str | None  # the never_kill pattern that matched, if any
    reasons: tuple[str, ...]

    @property
    def key(self) -> TreeKey:
        return self.tree.root.key


def parse_kill_order(order: Iterable[str]) -> tuple[str, ...]:
    out = tuple(order)
    if not out:
        raise ValueError(f"must name at least one of {', '.join(KILL_ORDER_KEYS)}")
    for key in out:
        if key not in KILL_ORDER_KEYS:
            raise ValueError(f"{key!r} is not one of {', '.join(KILL_ORDER_KEYS)}")
    if len(set(out)) != len(out):
        raise ValueError("names a criterion twice")
    return out


def parse_value_patterns(
    patterns: Iterable[str], parse: Callable[[str], V], what: str, example: str
) -> tuple[tuple[V, re.Pattern[str]], ...]:
    """'value=regex' entries (kill_priority, engine_budgets): the one owner of that syntax. `parse` turns the value
    text into a value or raises ValueError. Raises ValueError naming the bad entry."""
    out = []
    for text in patterns:
        head, sep, regex = text.partition("=")
        try:
            value: V | None = parse(head.strip())
        except ValueError:
            value = None
        if not sep or value is None or not regex:
            raise ValueError(f"{text!r} should be written as {what}=regex, for example {example!r}")
        out.append((value, compile_user_regex(regex, searched=True, entry=text)))
    return tuple(out)


def compile_never_kill(patterns: Iterable[str]) -> tuple[re.Pattern[str], ...]:
    return compile_regexes(patterns, searched=True)  # searched anywhere in policy_strings


def parse_kill_priority(patterns: Iterable[str]) -> tuple[tuple[int, re.Pattern[str]], ...]:
    """'priority=regex' entries, e.g. '10=--served-model-name draft' or '-10=llama-server'. Raises ValueError."""
    return parse_value_patterns(patterns, int, "priority", "-10=--model prod")


def parse_engine_budgets(patterns: Iterable[str]) -> tuple[tuple[int, re.Pattern[str]], ...]:
    """'SIZE=regex' entries, e.g. '40GiB=--served-model-name chat': the budget of the engine trees whose kind, title
    or command line match (the strings kill_priority searches). Raises ValueError."""
    return parse_value_patterns(patterns, _positive_size, "SIZE", "40GiB=--served-model-name chat")


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value <= 0:
        raise ValueError("a budget must be larger than 0")
    return value


def first_match(tree: EngineTree, patterns: Sequence[tuple[V, re.Pattern[str]]]) -> V | None:
    """The value of the first pattern that matches the tree's policy strings (policy_strings), or None."""
    strings = policy_strings(tree)
    for value, pattern in patterns:
        if any(pattern.search(s) for s in strings):
            return value
    return None


def policy_strings(tree: EngineTree) -> tuple[str, ...]:
    """What kill_priority and never_kill patterns are searched in: the engine kind, the root's title and its command
    line (an owner names the model to keep: `--served-model-name prod`), each cut to MATCH_TEXT_MAX characters."""
    root = tree.root
    return (tree.kind, bounded(root.display_name), bounded(" ".join(root.argv)))  # bounded: core.userregex


def fresh_gpu(gpu: GpuBytes | None, now: float) -> Mapping[int, int] | None:
    if gpu is None:
        return None
    taken_at, by_pid = gpu
    if now - taken_at > GPU_STALE_S or taken_at > now + GPU_STALE_S:
        return None
    return by_pid


def tree_gpu_bytes(tree: EngineTree, by_pid: Mapping[int, int] | None) -> int | None:
    if by_pid is None:
        return None
    return sum(by_pid.get(p.pid, 0) for p in tree.members)


def observe(
    history: GrowthHistory,
    t: float,
    trees: Sequence[EngineTree],
    gpu: GpuBytes | None,
    window_s: float = GROWTH_WINDOW_S,
) -> GrowthHistory:
    """Add one scan's figures. Trees gone from the scan are forgotten; samples older than twice the window dropped."""
    by_pid = fresh_gpu(gpu, t)
    out: dict[TreeKey, tuple[TreeSample, ...]] = {}
    for tree in trees[:MAX_TREES]:
        key = tree.root.key
        old = tuple(s for s in history.trees.get(key, ()) if t - s.t <= 2 * window_s and s.t <= t)
        sample = TreeSample(t=t, rss_bytes=tree.rss_bytes, gpu_bytes=tree_gpu_bytes(tree, by_pid))
        out[key] = (*old, sample)[-HISTORY_SAMPLES:]
    return GrowthHistory(trees=out)


def growth(samples: Sequence[TreeSample], now: float, window_s: float) -> tuple[int | None, float]:
    """Bytes gained from the oldest sample inside the window to the newest, and the span; GPU bytes count where
    both ends have them. None when fewer than two samples lie in the window."""
    inside = [s for s in samples if now - s.t <= window_s]
    if len(inside) < 2:
        return None, 0.0
    first, last = inside[0], inside[-1]
    gained = last.rss_bytes - first.rss_bytes
    if first.gpu_bytes is not None and last.gpu_bytes is not None:
        gained += last.gpu_bytes - first.gpu_bytes
    return gained, last.t - first.t


def _is_idle_ray(tree: EngineTree) -> bool:
    return tree.root.display_name.startswith(IDLE_RAY_TITLE)


def _priority(tree: EngineTree, params: PolicyParams) -> int:
    return first_match(tree, params.kill_priority) or 0


def _never_kill(tree: EngineTree, params: PolicyParams) -> str | None:
    strings = policy_strings(tree)
    for pattern in params.never_kill:
        if any(pattern.search(s) for s in strings):
            return pattern.pattern
    return None


def protected_by_label(tree: EngineTree, containers: ContainerNotes) -> str | None:
    """`container x (image; id)`: the container whose io.sparkwatch.protect label spares this tree; None when none."""
    if not containers.protected:
        return None
    ref = tree.container
    if ref is None or ref.id not in containers.protected:
        return None
    return containers.by_id[ref.id].label(with_id=True)


def _candidate(
    tree: EngineTree,
    history: GrowthHistory,
    now: float,
    by_pid: Mapping[int, int] | None,
    params: PolicyParams,
    *,
    containers: ContainerNotes,
) -> Candidate:
    gained, span = growth(history.trees.get(tree.root.key, ()), now, params.growth_window_s)
    gpu = tree_gpu_bytes(tree, by_pid)
    growing = gained is not None and gained >= params.growing_min_bytes
    idle = _is_idle_ray(tree)
    spared = _never_kill(tree, params)
    reasons: list[str] = []
    if spared is not None:
        reasons.append(f"never_kill matches {spared!r}")
    ref = tree.container if containers else None
    if spared is None and ref is not None and ref.id in containers.protected:
        spared = f"{LABEL_PROTECT}=true"
        reasons.append(f"{LABEL_PROTECT}=true on {containers.by_id[ref.id].label(with_id=True)}")
    labelled = containers.priorities.get(ref.id) if ref is not None else None
    priority = labelled if labelled is not None else _priority(tree, params)
    if idle:
        reasons.append("idle Ray worker: killed after every other tree")
    if labelled is not None and priority:
        reasons.append(f"kill_priority {priority:+d} ({LABEL_PRIORITY})")
    elif priority:
        reasons.append(f"kill_priority {priority:+d}")
    if gained is None:
        reasons.append("no growth measured yet (seen in one scan)")
    elif growing:
        reasons.append(f"grew {format_size(gained)} in {span:.1f} s")
    else:
        reasons.append(f"steady ({'+' if gained >= 0 else '-'}{format_size(abs(gained))} in {span:.1f} s)")
    size = f"RSS {format_size(tree.rss_bytes)}"
    reasons.append(size if gpu is None else f"{size}, GPU {format_size(gpu)}")
    return Candidate(
        tree=tree,
        growth_bytes=gained,
        growth_window_s=span,
        rss_bytes=tree.rss_bytes,
        gpu_bytes=gpu,
        priority=priority,
        growing=growing,
        idle_ray=idle,
        never_kill=spared,
        reasons=tuple(reasons),
    )


def _sort_key(c: Candidate, order: Sequence[str]) -> tuple[int, ...]:
    key: list[int] = [c.never_kill is not None, c.idle_ray]
    for name in order:
        if name == "priority":
            key.append(-c.priority)
        elif name == "growth":
            key += [0 if c.growing else 1, -(c.growth_bytes or 0) if c.growing else 0]
        elif name == "youngest":
            key.append(-c.tree.root.start_ticks)
        elif name == "largest":
            key.append(-(c.rss_bytes + (c.gpu_bytes or 0)))
    key.append(c.tree.root.pid)
    return tuple(key)


# A zombie has exited and freed its memory; only its parent's wait() is missing. A tree of nothing but zombies (a
# victim whose parent has not reaped it yet) is no candidate: "killing" it would spend a firing and a settle time.
GONE_STATES = frozenset({"Z", "X"})


def rank(
    trees: Sequence[EngineTree],
    history: GrowthHistory,
    now: float,
    gpu: GpuBytes | None,
    params: PolicyParams,
    *,
    containers: ContainerNotes = NO_NOTES,
) -> tuple[Candidate, ...]:
    """Every live tree in the order the guard would kill them now (never_kill trees last, never chosen).
    `containers`: telemetry's word on the containers' labels (protection, priority), matched by container id."""
    by_pid = fresh_gpu(gpu, now)
    live = [t for t in trees if any(p.state not in GONE_STATES for p in t.members)]
    candidates = [_candidate(t, history, now, by_pid, params, containers=containers) for t in live]
    return tuple(sorted(candidates, key=lambda c: _sort_key(c, params.kill_order)))


def choose(
    ranking: Sequence[Candidate], growing_only: bool = False, exclude: Iterable[TreeKey] = ()
) -> Candidate | None:
    """The next victim: the first tree of the ranking that may die now.

    `growing_only` while an earlier victim's teardown is still in progress: its memory is not back until it is reaped
    (measured on a real H200: 49.4 GiB of driver-held host memory took 6.36 s to come back after SIGKILL), so only a
    tree that is itself growing is worth killing before then. `exclude`: trees already killed and not yet reaped.
    """
    skip = set(exclude)
    for c in ranking:
        if c.never_kill is not None or c.key in skip:
            continue
        if growing_only and not c.growing:
            continue
        return c
    return None
