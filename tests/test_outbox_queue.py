"""The outbox's retry queue decides without threads, files or sockets: the clock is an argument, so each decision
(which item next, how long a backoff, who a failure pushes back, what the cap drops) is checked as it is made."""

from __future__ import annotations

from sparkwatch.telemetry.outbox.queue import JITTER, Item, RetryQueue

NOW_S = 1000.0
LOW, HIGH = JITTER


def queue(*event_ids: str, backoff_min_s: float = 1.0, backoff_max_s: float = 60.0, max_items: int = 100) -> RetryQueue:
    q = RetryQueue(backoff_min_s, backoff_max_s, max_items)
    for event_id in event_ids:
        q.add(Item(event_id, event_id.encode(), None))
    return q


def test_backoff_doubles_from_min_to_max_within_its_jitter() -> None:
    q = queue()
    for failures, base_s in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0), (7, 60.0), (500, 60.0)]:
        delays = [q.backoff_s(failures) for _ in range(200)]
        assert all(base_s * LOW <= d <= base_s * HIGH for d in delays), (failures, min(delays), max(delays))
        # jittered: 200 draws of ±20 % spread well past ±10 % (all within it: p = 0.5**200)
        assert min(delays) < base_s * 0.9 and max(delays) > base_s * 1.1, (failures, min(delays), max(delays))


def test_backoff_max_below_min_is_raised_to_min() -> None:
    q = queue(backoff_min_s=5.0, backoff_max_s=1.0)
    assert all(5.0 * LOW <= q.backoff_s(n) <= 5.0 * HIGH for n in (1, 2, 10))


def test_oldest_due_goes_first_and_an_empty_queue_waits_for_ever() -> None:
    assert queue().next_due(NOW_S) == (None, None)
    q = queue("0002", "0001", "0003")
    item, wait_s = q.next_due(NOW_S)
    assert item is not None and item.event_id == "0001" and wait_s is None


def test_a_transport_failure_pauses_every_item() -> None:
    q = queue("0001", "0002", "0003")
    first, _ = q.next_due(NOW_S)
    assert first is not None
    q.failed(first, transport=True, now_s=NOW_S)
    assert first.attempts == 1 and LOW <= first.next_due_s - NOW_S <= HIGH
    item, wait_s = q.next_due(NOW_S)
    assert item is None and wait_s is not None and LOW <= wait_s <= HIGH  # 0002 and 0003 are due, but paused
    assert q.next_due(NOW_S + wait_s * 0.99)[0] is None
    resumed, _ = q.next_due(NOW_S + wait_s)
    assert resumed is not None and resumed.event_id == "0002"  # due since it was queued: it goes before 0001


def test_transport_failures_in_a_row_lengthen_the_pause_and_a_delivery_ends_it() -> None:
    q = queue("0001", "0002", "0003", backoff_min_s=1.0, backoff_max_s=60.0)
    first, _ = q.next_due(NOW_S)
    assert first is not None
    for _ in range(3):
        q.failed(first, transport=True, now_s=NOW_S)
    _, wait_s = q.next_due(NOW_S)
    assert wait_s is not None and 4.0 * LOW <= wait_s <= 4.0 * HIGH  # the third failure in a row: 4 s for all
    q.delivered("0003")  # whatever went out: the receiver is back
    resumed, _ = q.next_due(NOW_S)
    assert resumed is not None and resumed.event_id == "0002"  # no pause left
    q.failed(first, transport=True, now_s=NOW_S)
    _, wait_s = q.next_due(NOW_S)
    assert wait_s is not None and LOW <= wait_s <= HIGH  # counted from one again, not 8 s


def test_a_rejected_item_is_pushed_back_alone() -> None:
    q = queue("0001", "0002")
    first, _ = q.next_due(NOW_S)
    assert first is not None and first.event_id == "0001"
    q.failed(first, transport=False, now_s=NOW_S)
    other, wait_s = q.next_due(NOW_S)
    assert other is not None and other.event_id == "0002" and wait_s is None  # no pause: the next goes at once
    q.delivered("0002")
    item, wait_s = q.next_due(NOW_S)
    assert item is None and wait_s is not None and LOW <= wait_s <= HIGH  # 0001 waits out its own backoff
    again, _ = q.next_due(NOW_S + wait_s)
    assert again is first and len(q) == 1


def test_the_cap_drops_the_oldest_and_a_requeued_id_keeps_its_first_copy() -> None:
    q = queue("0005", "0001", "0004", "0002", "0003", max_items=3)
    dropped = q.over_cap()
    assert [i.event_id for i in dropped] == ["0001", "0002"] and len(q) == 3
    assert q.over_cap() == []
    q.add(Item("0004", b"second copy", None))
    assert len(q) == 3 and q.over_cap() == []
    item, _ = q.next_due(NOW_S)
    assert item is not None and item.event_id == "0003"
    q.delivered("0003")
    item, _ = q.next_due(NOW_S)
    assert item is not None and item.event_id == "0004" and item.body == b"0004"
