"""The guard ↔ telemetry channel on a real socketpair: sends never block, drops are counted, EOF is seen."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sparkwatch.channel import Channel, ChannelClosed, GpuBoard, socketpair


def test_a_peer_that_never_reads_never_blocks_the_sender() -> None:
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        payload = "x" * 4000
        t0 = time.monotonic()
        results = [guard.send("state", pad=payload) for _ in range(5000)]  # ~20 MB into a ~1 MiB buffer
        elapsed = time.monotonic() - t0
        assert results[0] is True and results[-1] is False
        assert guard.dropped_total == results.count(False) > 0
        assert guard.sent_total == results.count(True)
        assert elapsed < 10  # generous: what matters is that it returned at all
        got = telemetry.receive(1.0)
        assert got and got[0]["t"] == "state" and got[0]["v"] == 1
    finally:
        guard.close()
        telemetry.close()


def test_garbage_is_counted_and_eof_is_seen() -> None:
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        a.send(b"not json")
        a.send(b'{"v": 99, "t": "state"}')  # a newer peer's message type/version is skipped, not fatal
        assert guard.send("event", event={"id": "1"})
        got = telemetry.receive(1.0)
        assert [m["t"] for m in got] == ["event"]
        assert telemetry.bad_total == 2
        guard.close()
        with pytest.raises(ChannelClosed):
            telemetry.receive(1.0)
    finally:
        telemetry.close()


def test_gpu_board_is_empty_when_stale() -> None:
    board = GpuBoard()
    assert board.fresh(5.0, now_s=100.0) == {}
    board.update({"123": 7 << 30, "bad": 1, "9": "x"}, read_at_s=100.0)
    assert board.fresh(5.0, now_s=102.0) == {123: 7 << 30}
    assert board.fresh(5.0, now_s=106.0) == {}


def test_unacknowledged_events_go_to_the_next_telemetry_process(tmp_path: Path) -> None:
    """A kill event sent to a telemetry process that died before its outbox had it is sent again to the next one;
    an acknowledged one is not."""
    from sparkwatch.actuators.events import EventLog, make_event
    from sparkwatch.config import load_settings, settings_to_wire
    from sparkwatch.core.eventkinds import EventKind
    from sparkwatch.guardconfig import GuardConfig
    from sparkwatch.supervisor import TelemetrySupervisor

    settings = load_settings(None, {"state_dir": tmp_path})
    config = GuardConfig.from_wire(settings_to_wire(settings), settings.public_dict())
    sup = TelemetrySupervisor(config, EventLog(tmp_path / "events.jsonl"), dict)
    first, second = (make_event(EventKind.KILL, f"kill {n}") for n in (1, 2))
    sup.forward(first)
    sup.forward(second)
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        sup._flush_events(guard)
        sent = [m["event"]["id"] for m in telemetry.receive(1.0)]
        assert sent == [first.id, second.id]
        sup._handle({"t": "ack", "ids": [first.id]})  # the outbox has the first; telemetry dies before the second
    finally:
        guard.close()
        telemetry.close()
    assert list(sup._unacked) == [second.id]
    # What the supervisor does for the next telemetry process: unacked first, then anything new.
    sup._requeue_unacked()
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        sup._flush_events(guard)
        assert [m["event"]["id"] for m in telemetry.receive(1.0)] == [second.id]
    finally:
        guard.close()
        telemetry.close()


def test_telemetry_environment_turns_pymalloc_off_unless_the_user_chose() -> None:
    from sparkwatch.supervisor import telemetry_env

    assert telemetry_env({"PATH": "/usr/bin"}) == {"PATH": "/usr/bin", "PYTHONMALLOC": "malloc"}
    assert telemetry_env({"PYTHONMALLOC": "pymalloc_debug"})["PYTHONMALLOC"] == "pymalloc_debug"
