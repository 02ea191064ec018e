"""The guard ↔ telemetry channel on a real socketpair: sends never block, drops are counted, EOF is seen."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sparkwatch.common.channel import Channel, ChannelClosed, socketpair
from sparkwatch.common.messages import VERSION, AckMsg, EventMsg, StateMsg, TelMsg
from sparkwatch.common.stats import GuardStats, KernelLogStats
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event
from sparkwatch.core.policy import fresh_gpu
from sparkwatch.guard.gpuboard import GpuBoard


def state(pad: str = "") -> StateMsg:
    return StateMsg(GuardStats(last_error=pad or None), KernelLogStats())


def test_a_peer_that_never_reads_never_blocks_the_sender() -> None:
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        payload = "x" * 4000
        t0 = time.monotonic()
        results = [guard.send(state(pad=payload)) for _ in range(5000)]  # ~20 MB into a ~1 MiB buffer
        elapsed = time.monotonic() - t0
        assert results[0] is True and results[-1] is False
        assert guard.dropped_total == results.count(False) > 0
        assert guard.sent_total == results.count(True)
        assert elapsed < 10  # generous: what matters is that it returned at all
        got = telemetry.receive(1.0)
        assert got and isinstance(got[0], StateMsg) and got[0].guard.last_error == payload
    finally:
        guard.close()
        telemetry.close()


def test_garbage_is_counted_and_eof_is_seen() -> None:
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        a.send(b"not json")
        a.send(b'{"v": 99, "t": "state"}')  # a newer peer's message type/version is skipped, not fatal
        a.send(b'{"v": %d, "t": "tel", "gpu_pids": {"10": "lots"}}' % VERSION)  # a field of the wrong type
        assert guard.send(EventMsg(Event("1", "2026-12-02T00:00:00.000Z", EventKind.KILL, "node", "killed")))
        got = telemetry.receive(1.0)
        assert [type(m) for m in got] == [EventMsg]
        assert telemetry.bad_total == 3
        guard.close()
        with pytest.raises(ChannelClosed):
            telemetry.receive(1.0)
    finally:
        telemetry.close()


def test_gpu_board_is_empty_when_stale() -> None:
    board = GpuBoard()
    assert board.latest() is None  # nothing until telemetry's NVML answered
    board.update(TelMsg(gpu_ts=time.time() - 2.0, gpu_pids={123: 7 << 30}))
    reading = board.latest()
    assert reading is not None and fresh_gpu(reading, time.monotonic()) == {123: 7 << 30}
    board.update(TelMsg(gpu_ts=time.time() - 6.0, gpu_pids={123: 7 << 30}))
    assert fresh_gpu(board.latest(), time.monotonic()) is None


def test_unacknowledged_events_go_to_the_next_telemetry_process(tmp_path: Path) -> None:
    """A kill event sent to a telemetry process that died before its outbox had it is sent again to the next one;
    an acknowledged one is not."""
    from sparkwatch.common.events import EventLog, make_event
    from sparkwatch.common.guardconfig import GuardConfig
    from sparkwatch.config.settings import load_settings, settings_to_wire
    from sparkwatch.core.eventkinds import EventKind
    from sparkwatch.guard.supervisor import TelemetrySupervisor

    settings = load_settings(None, {"state_dir": tmp_path})
    config = GuardConfig.from_wire(settings_to_wire(settings), settings.public_dict())
    sup = TelemetrySupervisor(config, EventLog(tmp_path / "events.jsonl"), state)
    first, second = (make_event(EventKind.KILL, f"kill {n}") for n in (1, 2))
    sup.forward(first)
    sup.forward(second)
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        sup._flush_events(guard)
        sent = [m.event.id for m in telemetry.receive(1.0) if isinstance(m, EventMsg)]
        assert sent == [first.id, second.id]
        sup._handle(AckMsg((first.id,)))  # the outbox has the first; telemetry dies before the second
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
        assert [m.event.id for m in telemetry.receive(1.0) if isinstance(m, EventMsg)] == [second.id]
    finally:
        guard.close()
        telemetry.close()


def test_telemetry_environment_turns_pymalloc_off_unless_the_user_chose() -> None:
    from sparkwatch.guard.supervisor import telemetry_env

    assert telemetry_env({"PATH": "/usr/bin"}) == {"PATH": "/usr/bin", "PYTHONMALLOC": "malloc"}
    assert telemetry_env({"PYTHONMALLOC": "pymalloc_debug"})["PYTHONMALLOC"] == "pymalloc_debug"
