"""A kill loop: a supervisor (systemd Restart=, a shell `while true`, Ray's actor restarts) starts the same engine
again and again into the same spike. Every kill is still made only under the floor; the loop itself gets one alert.

Pure: the caller passes each kill's engine identity and monotonic time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkwatch.core.model import EngineTree

# Three kills of the same engine within ten minutes is a loop: one kill is a spike, two can be an owner retrying by
# hand after a kill (the field saw a relaunch 3 s after a kill fail, and one 30 s later succeed), three is a machine.
LOOP_KILLS = 3
LOOP_WINDOW_S = 600.0
MAX_REMEMBERED_KILLS = 64


@dataclass(frozen=True, slots=True)
class LoopState:
    kills: tuple[tuple[str, float], ...] = ()  # (identity, monotonic time), the newest last
    alerted: frozenset[str] = field(default_factory=frozenset)


def loop_identity(tree: EngineTree) -> str:
    """The same engine across restarts: its kind, title and command line (a new pid every time)."""
    root = tree.root
    return f"{tree.kind}|{root.display_name}|{' '.join(root.argv)}"


def note_kill(state: LoopState, t: float, identity: str) -> tuple[LoopState, int | None]:
    """Record one kill. Returns the kill count within the window when this kill makes a new loop (alert once), else
    None. A loop that stays quiet for LOOP_WINDOW_S may alert again when it starts over."""
    kills = tuple(k for k in state.kills if t - k[1] <= LOOP_WINDOW_S)
    alerted = frozenset(a for a in state.alerted if any(k[0] == a for k in kills))  # quiet for a window: forgotten
    kills = (*kills, (identity, t))[-MAX_REMEMBERED_KILLS:]
    count = sum(1 for k in kills if k[0] == identity)
    if count >= LOOP_KILLS and identity not in alerted:
        return LoopState(kills=kills, alerted=alerted | {identity}), count
    return LoopState(kills=kills, alerted=alerted), None
