"""The guard's one way in: every kill request that does not come from the pool watch's own floor decision.

The budgets and the kernel-log hook put theirs on the pool watch's own thread, during its tick (`put`: no wake-up, the
tick drains them before it sleeps); the group watch and the wedge watch, on the supervisor's thread, `submit` theirs,
which also wakes the pool watch at once. The pool watch drains the inbox on its tick (guard.poolwatch), each request in
the order it came, into the one kill path (guard.killpath.KillPath.fire) with that tick's MemInfo sample.

The inbox owns the pool watch's wake-up pipe: whatever must make the pool watch look now (a reload, a fast GPU sample
of a near-budget engine, a request) writes one byte here, so nothing needs the pool watch built first to wake it.
deque append and popleft are atomic: no lock.
"""

from __future__ import annotations

import collections
import os

from sparkwatch.guard.killpath import KillRequest


class KillInbox:
    def __init__(self) -> None:
        self._queue: collections.deque[KillRequest] = collections.deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def fd(self) -> int:
        """Readable when woken: the pool watch polls it between ticks."""
        return self._wake_r

    def put(self, request: KillRequest) -> None:
        """A request from the pool watch's own thread, during its tick (budgets, the kernel log): drained before the
        tick ends, so no wake-up."""
        self._queue.append(request)

    def submit(self, request: KillRequest) -> None:
        """A request from another thread (the group watch, the wedge watch): the pool watch's next tick, woken now."""
        self._queue.append(request)
        self.wake()

    def take(self) -> KillRequest | None:
        """The oldest request waiting, or None (no allocation and no exception when empty: the idle tick's case)."""
        queue = self._queue
        return queue.popleft() if queue else None

    def wake(self) -> None:
        """Make the pool watch look now (from any thread, never blocking)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # the pipe is full: a wake-up is already pending
            pass

    def clear_wakeups(self) -> None:
        try:
            os.read(self._wake_r, 64)
        except BlockingIOError:
            pass
