"""The guard ↔ telemetry channel on a real socketpair: sends never block, drops are counted, EOF is seen."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from sparkwatch.common.channel import Channel, ChannelClosed, socketpair
from sparkwatch.common.messages import (
    MAX_ITEMS,
    MAX_MESSAGE_BYTES,
    VERSION,
    AckMsg,
    AppliedMsg,
    BadMessage,
    EventMsg,
    SettingsMsg,
    StateMsg,
    TelMsg,
    decode,
    encode,
)
from sparkwatch.common.sources.procs import holds_gpu_device
from sparkwatch.common.stats import GuardStats, KernelLogStats
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill.policy import fresh_gpu
from sparkwatch.core.model import Event
from sparkwatch.guard.gpuboard import GpuBoard, verified_holders


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
    from sparkwatch.common.eventlog import EventLog, make_event
    from sparkwatch.config.schema import guard_config
    from sparkwatch.config.settings import load_settings
    from sparkwatch.core.eventkinds import EventKind
    from sparkwatch.guard.supervisor import TelemetrySupervisor

    settings = load_settings(None, {"state_dir": tmp_path})
    config = guard_config(settings)
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


def test_receive_takes_at_most_its_limits_and_says_more_is_waiting() -> None:
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        for _ in range(10):
            assert telemetry.send(TelMsg(engines=1))
        results = []
        for limit in (4, 64, 64):
            got = guard.receive(0.2, max_messages=limit)
            results.append((len(got), guard.saturated))
        assert results == [(4, True), (6, False), (0, False)]
    finally:
        guard.close()
        telemetry.close()


def test_an_oversized_datagram_is_dropped_and_counted() -> None:
    a, b = socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MAX_MESSAGE_BYTES)
    guard, telemetry = Channel(a), Channel(b)
    try:
        big = b'{"v": %d, "t": "tel", "pad": "' % VERSION + b"x" * MAX_MESSAGE_BYTES + b'"}'
        assert guard.send_bytes(big)
        assert guard.send(AckMsg(("after",)))
        got = telemetry.receive(1.0)
        assert got == [AckMsg(("after",))]
        assert telemetry.oversized_total == 1 and telemetry.bad_total == 1
    finally:
        guard.close()
        telemetry.close()


def test_every_message_kind_survives_the_wire() -> None:
    stats = GuardStats(kills_total={"floor": 2}, mem=None, last_error="x")
    kernlog = KernelLogStats(xid_total={79: 1}, recent_xids=[(1.5, 79, "fallen off the bus")])
    event = Event("0001", "2026-12-02T00:00:00.000Z", EventKind.KILL, "spark", "killed", {"victims": [{"pid": 1}]})
    for msg in (
        SettingsMsg({"floor": 8}, {"floor": "8GiB"}, reload=True),
        StateMsg(stats, kernlog, {"events": {"event_write_errors": 1}}, 20 << 20, 3, 42),
        EventMsg(event),
        AppliedMsg(("floor",), ("oops",)),
        AckMsg(("0001",)),
        TelMsg(1, 7, 1000.5, {123: 5 << 30}, ((123, 456),)),
    ):
        assert decode(encode(msg)) == msg, msg


@pytest.mark.parametrize(
    "datagram",
    [
        b'{"v": 2, "t": "tel", "engines": true}',  # a bool is not an int
        b'{"v": 2, "t": "tel", "gpu_pids": {"x": 1}}',  # a pid key that is not a number
        b'{"v": 2, "t": "ack", "ids": "abc"}',  # a string is not a list
        b'{"v": 2, "t": "event", "event": {"id": "1"}}',  # an event without its head
        b'{"v": 2, "t": "nonsense"}',
        b"[1, 2]",
    ],
)
def test_a_malformed_message_is_refused_whole(datagram: bytes) -> None:
    with pytest.raises(BadMessage):
        decode(datagram)


def test_a_collection_past_its_limit_is_refused() -> None:
    pids = {i: 1 for i in range(MAX_ITEMS + 1)}
    with pytest.raises(BadMessage, match="items"):
        decode(encode(TelMsg(gpu_pids=pids)))


def test_a_holder_telemetry_names_must_pass_the_guards_own_checks() -> None:
    """Same pid and start time in the guard's own scan, and an NVIDIA device open now: else it is no candidate."""
    scanned = {10: 500, 11: 600, 12: 700}
    holding = {10, 12}
    claimed = {(10, 500), (11, 600), (12, 699), (13, 800)}  # 11 holds nothing, 12 was reused, 13 is gone
    assert verified_holders(claimed, scanned, lambda pid: pid in holding) == {(10, 500)}


def test_holds_gpu_device_reads_the_fd_links(tmp_path: Path) -> None:
    fds = tmp_path / "77" / "fd"
    fds.mkdir(parents=True)
    (fds / "0").symlink_to("/dev/null")
    assert not holds_gpu_device(tmp_path, 77)
    (fds / "5").symlink_to("/dev/nvidia-uvm")
    assert holds_gpu_device(tmp_path, 77)
    assert not holds_gpu_device(tmp_path, 78)  # gone


def test_state_goes_out_when_it_changed_not_when_memory_moved(tmp_path: Path) -> None:
    """The guard's state crosses the channel on a change or a heartbeat, not each tick: MemAvailable moving is not
    a change, a kill is."""
    from sparkwatch.common.eventlog import EventLog
    from sparkwatch.config.schema import guard_config
    from sparkwatch.config.settings import load_settings
    from sparkwatch.core.model import MemInfo
    from sparkwatch.guard.supervisor import TelemetrySupervisor

    settings = load_settings(None, {"state_dir": tmp_path})
    config = guard_config(settings)
    current = [StateMsg(GuardStats(last_loop_monotonic=1.0), KernelLogStats())]
    sup = TelemetrySupervisor(config, EventLog(tmp_path / "events.jsonl"), lambda: current[0])
    a, b = socketpair()
    guard, telemetry = Channel(a), Channel(b)
    try:
        sup._send_state(guard)
        mem = MemInfo(100 << 30, 60 << 30, 50 << 30, 0, 1 << 30, 0, 0)
        current[0] = StateMsg(GuardStats(mem=mem, last_loop_monotonic=2.0, fill_rate_bytes_per_s=5.0), KernelLogStats())
        sup._send_state(guard)  # only the readings moved
        assert len(telemetry.receive(0.2)) == 1
        current[0] = StateMsg(GuardStats(mem=mem, last_loop_monotonic=3.0, kills_total={"floor": 1}), KernelLogStats())
        sup._send_state(guard)  # a kill: at once
        got = telemetry.receive(0.2)
        assert len(got) == 1 and isinstance(got[0], StateMsg) and got[0].guard.kills_total == {"floor": 1}
        sup._last_state_at -= 10  # the heartbeat is due
        sup._send_state(guard)
        assert len(telemetry.receive(0.2)) == 1
        sup.near_floor = lambda: True  # near the floor: every look sends
        sup._send_state(guard)
        sup._send_state(guard)
        assert len(telemetry.receive(0.2)) == 2
    finally:
        guard.close()
        telemetry.close()
