"""The guard's word on a launched engine, from its published state (common.guardfile), keyed by the declaration.

- After the start: whether a guard took the declaration (within GUARD_WORD_WAIT_S), or at once and only once that no
  guard is running (with a budget: that it is not enforced). "Enforced" is said only when a guard took it.
- After a SIGKILL launch did not send: the running guard's word that it killed the engine, waited for up to
  KILL_WORD_WAIT_S, and not at all when no guard runs. A dry run's decision is not a kill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

from sparkwatch.common import guardfile
from sparkwatch.core.report.guardstate import KillWord, no_guard_line, not_taken_line, taken_line

# How long launch looks for a guard to take its declaration: the guard reads the declarations each tick (at most
# poll_max_s, 1 s, apart) and republishes guard.json at once when it took a new one.
GUARD_WORD_WAIT_S = 5.0
# How long launch looks for a running guard's word on a SIGKILL it did not send: the guard asks its main thread to
# republish guard.json right after its signals, and launch looks only after its own reap, leftovers and drain.
KILL_WORD_WAIT_S = 3.0
AWAIT_POLL_S = 0.25  # while a guard's word is awaited, launch looks four times a second


class GuardWord:
    """The guard's word on one launched tree, said through `note` (one line at the start of a terminal line)."""

    def __init__(
        self, env: Mapping[str, str], state_dir: Path, budget_bytes: int | None, note: Callable[[str], None]
    ) -> None:
        self._paths = guardfile.reader_paths(env, state_dir)
        self._budget_bytes = budget_bytes
        self._note = note
        self._wait_until: float | None = None  # monotonic; None: nothing (more) to say about the guard

    @property
    def awaited(self) -> bool:
        """Whether a running guard's word on the declaration is still to come."""
        return self._wait_until is not None

    def declared(self, tree_key: tuple[int, int]) -> None:
        """Just declared: at once when no guard runs, else once one took it (or GUARD_WORD_WAIT_S passed), from
        `poll`."""
        if not guardfile.read_guards(self._paths).running:
            self._note(no_guard_line(self._budget_bytes))
            return
        self._wait_until = time.monotonic() + GUARD_WORD_WAIT_S
        self.poll(tree_key)

    def poll(self, tree_key: tuple[int, int]) -> None:
        """The awaited word, said once it came (taken, no guard any more, or not taken in time)."""
        if self._wait_until is None:
            return
        seen = guardfile.read_guards(self._paths)
        state = seen.taken_by(tree_key)
        if state is not None:
            self._note(taken_line(state, self._budget_bytes))
        elif not seen.running:
            self._note(no_guard_line(self._budget_bytes))  # it stopped meanwhile
        elif time.monotonic() >= self._wait_until:
            self._note(not_taken_line(seen.states, self._budget_bytes, GUARD_WORD_WAIT_S))
        else:
            return
        self._wait_until = None

    def kill_word(self, tree_key: tuple[int, int]) -> KillWord | None:
        """A running guard's word that it killed this tree, looked for until KILL_WORD_WAIT_S passed; at once None
        when no guard runs."""
        deadline = time.monotonic() + KILL_WORD_WAIT_S
        while True:
            seen = guardfile.read_guards(self._paths)
            word = seen.killed(tree_key)
            if word is not None and not word.dry_run:
                return word
            if not seen.running or time.monotonic() >= deadline:
                return None
            time.sleep(0.1)
