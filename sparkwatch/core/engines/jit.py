"""JIT build progress and the per-engine state: idle, compiling or stalled.

A first boot sits 10-25 minutes with a frozen log, 0 % GPU and 12-13 W while flashinfer JIT-compiles, and people kill
it thinking it hung (seen on Sparks: the main thread asleep in anon_pipe_read, every thread S, 0 % CPU). The tells
that it works are live compilers in the engine's tree and a growing cache; the tell that it does not is an engine
whose processes sleep waiting on a pipe with no compiler left to write to it, and a cache that stopped growing.

Pure: sources hand in build.ninja text, process facts and cache totals; this module decides.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sparkwatch.core.enums import JitState
from sparkwatch.core.model import JitEngineState
from sparkwatch.core.words import plural

IDLE, COMPILING, STALLED = JitState.IDLE, JitState.COMPILING, JitState.STALLED
_VAR_RE = re.compile(r"\$\{([A-Za-z0-9_.-]+)\}|\$([A-Za-z0-9_-]+)")


def _join_continuations(text: str) -> list[str]:
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.endswith("$") and not raw.endswith("$$"):
            pending += raw[:-1]
            continue
        lines.append(pending + raw)
        pending = ""
    if pending:
        lines.append(pending)
    return lines


def _split_outputs(spec: str) -> list[str]:
    """The explicit outputs of a `build` line (up to the first unescaped ':' or '|'), unescaped."""
    outs: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(spec):
        ch = spec[i]
        if ch == "$" and i + 1 < len(spec) and spec[i + 1] in " :$\n":
            cur.append(spec[i + 1])
            i += 2
            continue
        if ch in ":|":
            break
        if ch == " ":
            if cur:
                outs.append("".join(cur))
                cur = []
        else:
            cur.append(ch)
        i += 1
    if cur:
        outs.append("".join(cur))
    return outs


def ninja_object_targets(text: str) -> tuple[str, ...]:
    """Object files (`*.o`) a build.ninja builds, with top-level `$var`/`${var}` expanded.

    flashinfer writes one `build <obj>.cuda.o: cuda_compile <src>.cu` per source and a final link to `<module>.so`;
    objects done against these targets is the module's progress.
    """
    variables: dict[str, str] = {}
    targets: list[str] = []
    for line in _join_continuations(text):
        if not line or line[0] in " \t#":
            continue  # indented lines are rule/build-local bindings
        if line.startswith("build "):
            for out in _split_outputs(line[6:]):
                expanded = _VAR_RE.sub(lambda m: variables.get(m.group(1) or m.group(2), ""), out)
                if expanded.endswith(".o"):
                    targets.append(expanded)
            continue
        name, eq, value = line.partition("=")
        if eq and " " not in name.strip() and not name.startswith(("rule ", "pool ", "default ", "include ")):
            variables[name.strip()] = _VAR_RE.sub(lambda m: variables.get(m.group(1) or m.group(2), ""), value.strip())
    return tuple(dict.fromkeys(targets))


# --- per-engine state

# Where a main thread sleeps when it waits on a child's output (flashinfer waiting on ninja's pipe: a Spark showed
# anon_pipe_read). Asleep here with no compiler left is the shape of a stall; an idle server sleeps in epoll instead.
PIPE_WAIT_WCHANS = frozenset({"pipe_read", "anon_pipe_read", "pipe_wait", "pipe_wait_readable"})
# compiling -> idle only after no sign of compiling for this long: ninja starts jobs back to back, and between two
# flashinfer modules there are seconds with no compiler; that is one compile, not a flapping state.
SETTLE_S = 5.0


@dataclass(frozen=True, slots=True)
class JitParams:
    stall_s: float
    settle_s: float = SETTLE_S


@dataclass(frozen=True, slots=True)
class EngineObservation:
    """One engine tree this cycle, as the sources saw it."""

    kind: str
    root_pid: int
    root_start_ticks: int
    compilers: int  # live compiler processes in the tree
    pipe_waiting: bool  # some member's main thread sleeps in a pipe read (PIPE_WAIT_WCHANS)
    all_asleep: bool  # no member running (state R)
    gpu_busy: bool = False  # NVML says a GPU is busy: work is happening, whatever the processes look like


@dataclass(frozen=True, slots=True)
class JitTrack:
    state: JitState
    since_ts: float
    last_activity_ts: float | None  # last compiler or cache growth seen for this engine
    last_awake_ts: float
    reason: str


@dataclass(frozen=True, slots=True)
class JitTransition:
    kind: str
    root_pid: int
    old: JitState
    new: JitState
    reason: str


def jit_step(
    tracks: Mapping[tuple[int, int], JitTrack],
    observations: Sequence[EngineObservation],
    cache_growing: bool,
    params: JitParams,
    now: float,
) -> tuple[dict[tuple[int, int], JitTrack], tuple[JitEngineState, ...], tuple[JitTransition, ...]]:
    """Advance every engine's state by one cycle. Engines that are gone are dropped (no transition for them).

    compiling: compilers alive in the tree or a JIT cache growing, or either within `settle_s`.
    stalled: the engine did compile in its life, shows no compiler and no growth for `stall_s`, every process is
      asleep and one waits on a pipe, and the GPU is idle, for `stall_s`.
    idle: otherwise. An engine that never compiled is idle, never stalled: an idle llama-server is not a stuck JIT.
    """
    out: dict[tuple[int, int], JitTrack] = {}
    states: list[JitEngineState] = []
    changes: list[JitTransition] = []
    for obs in observations:
        key = (obs.root_pid, obs.root_start_ticks)
        prev = tracks.get(key)
        last_activity = prev.last_activity_ts if prev else None
        last_awake = prev.last_awake_ts if prev else now
        active_reason = ""
        if obs.compilers:
            active_reason = f"{plural(obs.compilers, 'compiler process')} in the tree"
        elif cache_growing:
            active_reason = "JIT cache growing"
        if active_reason:
            last_activity = now
        if not (obs.all_asleep and obs.pipe_waiting) or obs.gpu_busy:
            last_awake = now
        if last_activity is not None and now - last_activity < params.settle_s:
            state = COMPILING
            reason = active_reason or f"last compiler activity {now - last_activity:.0f} s ago"
        elif last_activity is not None and now - last_activity >= params.stall_s and now - last_awake >= params.stall_s:
            state = STALLED
            reason = (
                f"no compiler and no cache growth for {now - last_activity:.0f} s; every process asleep, "
                f"waiting on a pipe for {now - last_awake:.0f} s"
            )
        else:
            state = IDLE
            reason = "no compiler activity" if last_activity is not None else "never seen compiling"
        since = prev.since_ts if prev is not None and prev.state == state else now
        if prev is not None and prev.state != state:
            changes.append(JitTransition(obs.kind, obs.root_pid, prev.state, state, reason))
        elif prev is None and state != IDLE:
            changes.append(JitTransition(obs.kind, obs.root_pid, IDLE, state, reason))
        out[key] = JitTrack(state, since, last_activity, last_awake, reason)
        states.append(JitEngineState(obs.kind, obs.root_pid, state, since, reason))
    return out, tuple(states), tuple(changes)
