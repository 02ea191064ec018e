"""The one eviction rule for caches keyed by a process (pid and start time, or comm and argv).

Under churn every new process is a new key: 1,000 processes a minute in the soak bench (bench/soak_bench.py). A
`LiveCache` is cut back to the entries of live processes once `DEAD_SLACK` entries were added since its last cut, so
it never holds more than its live entries at the last cut plus DEAD_SLACK. The caches used to be cut only at 2-4x the
process count plus 256: a sawtooth that kept up to ~1,000 dead processes' argv tuples alive between cuts, under
three different rules. (Measured: this alone did not flatten the telemetry process's RSS under churn;
bench/RESULTS-soak.md has what did.)

A cut builds a new dict from a copy of the items (`list(d.items())` is one step under the GIL), so a second thread
that reads or inserts meanwhile (the guard's scout shares the kill path's cache) loses at most one insert, which
costs one re-read.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEAD_SLACK = 64  # entries added between cuts: a cut every ~4 s at 1,000 new processes a minute
HARD_MAX = 8192  # a cache is cleared past this whatever happens (a caller that never cuts stays bounded)


class LiveCache(Generic[K, V]):
    """A dict of per-process facts that forgets processes that are gone."""

    def __init__(self, hard_max: int = HARD_MAX) -> None:
        self._data: dict[K, V] = {}
        self._after_cut = 0
        self.hard_max = hard_max

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def get(self, key: K) -> V | None:
        return self._data.get(key)

    def put(self, key: K, value: V) -> None:
        if len(self._data) >= self.hard_max:
            self._data = {}
            self._after_cut = 0
        self._data[key] = value

    def forget_dead(self, live_keys: Callable[[], Container[K]]) -> bool:
        """Cut back to live keys if DEAD_SLACK entries were added since the last cut; True if it cut. `live_keys` is
        only called then (building it costs a pass over the process table)."""
        if len(self._data) <= self._after_cut + DEAD_SLACK:
            return False
        live = live_keys()
        self._data = {k: v for k, v in list(self._data.items()) if k in live}
        self._after_cut = len(self._data)
        return True
