"""The outbox's retry queue: which alert goes next, when, and which are dropped at the cap.

Pure bookkeeping over a clock passed in (`now_s`, monotonic seconds): no threads, no files, no sockets, so every
decision is testable as it is. It is not thread-safe; the outbox (outbox.py) calls it under its one lock.

- Next: the due item with the earliest (due time, event id); event ids sort by time, so the oldest goes first.
- Backoff: each failed attempt pushes its item back exponentially from `backoff_min_s` to `backoff_max_s`, with
  ±20 % jitter so several nodes do not retry in lock step.
- A transport failure (the receiver unreachable or unwell: transport.py classifies) also pauses the whole queue,
  backing off on the count of such failures in a row; an item rejected by the receiver pushes back only that item,
  so one payload a receiver refuses cannot block the others forever. A delivery ends the pause.
- Cap: at most `max_items`; past that the oldest are dropped (the caller removes their files and counts them).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

JITTER = (0.8, 1.2)  # ±20 %


@dataclass
class Item:
    event_id: str
    body: bytes
    path: Path | None  # None: could not be spooled (full disk); delivered from memory if we live long enough
    attempts: int = 0
    next_due_s: float = 0.0


class RetryQueue:
    def __init__(self, backoff_min_s: float, backoff_max_s: float, max_items: int) -> None:
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = max(backoff_max_s, backoff_min_s)
        self.max_items = max(1, max_items)
        self._items: dict[str, Item] = {}
        self._transport_failures = 0  # in a row
        self._paused_until_s = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Item) -> None:
        """Queue `item`, due now, unless its event id is already queued (the same alert spooled twice)."""
        self._items.setdefault(item.event_id, item)

    def over_cap(self) -> list[Item]:
        """Remove and return the oldest items past `max_items`."""
        dropped: list[Item] = []
        while len(self._items) > self.max_items:
            dropped.append(self._items.pop(min(self._items)))
        return dropped

    def next_due(self, now_s: float) -> tuple[Item | None, float | None]:
        """The item to send now, or (None, seconds until one is due; None while the queue is empty)."""
        if not self._items:
            return None, None
        first = min(self._items.values(), key=lambda i: (i.next_due_s, i.event_id))
        due_s = max(first.next_due_s, self._paused_until_s)
        if due_s <= now_s:
            return first, None
        return None, due_s - now_s

    def delivered(self, event_id: str) -> None:
        """The receiver has it: forget it, and end any pause."""
        self._items.pop(event_id, None)
        self._transport_failures = 0
        self._paused_until_s = 0.0

    def failed(self, item: Item, transport: bool, now_s: float) -> None:
        """One failed attempt: push `item` back; a transport failure pauses every item too."""
        item.attempts += 1
        item.next_due_s = now_s + self.backoff_s(item.attempts)
        if transport:
            self._transport_failures += 1
            self._paused_until_s = now_s + self.backoff_s(self._transport_failures)

    def backoff_s(self, failures: int) -> float:
        """The wait after `failures` failures in a row: min_s doubling to max_s, times the jitter."""
        delay = min(self.backoff_max_s, self.backoff_min_s * float(2 ** min(max(failures - 1, 0), 60)))
        return delay * random.uniform(*JITTER)
