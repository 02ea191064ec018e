"""loops.kernlog.KernelLogWatch: counting, corroborating and recording, fed real records without a /dev/kmsg.

A container (CI's, perhaps) may have no writable /dev/kmsg; test_kmsg_live.py covers the real device. Here the
source hands over records parsed from the fixtures (public NVRM/Xid lines), the event log is real, and attribution
reads the real /proc of a real engine tree this test started.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.common.sources.kmsg import KmsgSource
from sparkwatch.core.driver.nvrm import KmsgRecord, parse_kmsg_record
from sparkwatch.core.engines.identity import EngineRules, Scope
from sparkwatch.guard.kernlog import KernelLogWatch
from tests.conftest import Spawner, pids_in, wait_until

GiB = 1 << 30
FIX = Path(__file__).parent / "fixtures" / "kmsg"


class FixtureSource(KmsgSource):
    """Hands out queued records as the real source would after reading them from the ring."""

    def __init__(self) -> None:
        super().__init__(Path("/nonexistent"))
        self.queued: list[KmsgRecord] = []

    def open(self) -> bool:
        self.stats.readable = True
        return True

    def poll(self, now: float) -> list[KmsgRecord]:
        out, self.queued = self.queued, []
        self.stats.lines_total += len(out)
        return out


def public(*seqs: int) -> list[KmsgRecord]:
    recs = [parse_kmsg_record(line) for line in (FIX / "nvrm-public.txt").read_bytes().splitlines()]
    return [r for r in recs if r is not None and r.seq in seqs]


def watch(tmp_path: Path, enabled: bool = True) -> tuple[KernelLogWatch, FixtureSource, EventLog]:
    events = EventLog(tmp_path / "events.jsonl")
    source = FixtureSource()
    rules = EngineRules.build([], [])
    scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=os.getpid())
    w = KernelLogWatch(events, Path("/proc"), lambda: (rules, scope), enabled=enabled, source=source)
    w.start()
    return w, source, events


def test_one_failure_fires_once_and_records_once(tmp_path: Path) -> None:
    w, source, events = watch(tmp_path)
    try:
        source.queued = public(1001, 1002, 1003)  # one NV_ERR_NO_MEMORY failure: three lines
        assert w.poll(time.monotonic(), 10 * GiB, 8 * GiB, 4 * GiB, armed=True) == "driver_alloc_failed"
        assert w.poll(time.monotonic(), 10 * GiB, 8 * GiB, 4 * GiB, armed=True) is None  # nothing new
        assert wait_until(lambda: len(read_events(events.path)) == 1, 5)
        (event,) = read_events(events.path)
        assert event["kind"] == "driver_alloc_failed" and event["action"] == "fired"
        assert event["available_bytes"] == 10 * GiB and event["in_band"] is True
        with w.lock:
            assert w.stats.nvrm_errors_total["no_memory"] == 2 and w.stats.nvrm_errors_total["alloc_failed"] == 1
            assert w.stats.corroborated_fires_total == 1
    finally:
        w.stop()


def test_a_line_written_from_userspace_is_ignored_unless_accepted(tmp_path: Path) -> None:
    """The same failure with the user facility (what the kernel gives any line a process writes into /dev/kmsg) fires
    nothing and records nothing, and is counted; with kernel_log_accept_injected it fires like the driver's."""
    from dataclasses import replace

    injected = [replace(r, facility=1) for r in public(1001, 1002, 1003)]
    w, source, events = watch(tmp_path / "a")
    try:
        source.queued = list(injected)
        assert w.poll(time.monotonic(), 10 * GiB, 8 * GiB, 4 * GiB, armed=True) is None
        with w.lock:
            assert w.stats.injected_ignored_total == 3 and w.stats.nvrm_errors_total["no_memory"] == 0
        w.accept_injected = True  # as a reload applies it
        source.queued = list(injected)
        assert w.poll(time.monotonic(), 10 * GiB, 8 * GiB, 4 * GiB, armed=True) == "driver_alloc_failed"
        assert wait_until(lambda: len(read_events(events.path)) == 1, 5)
        assert read_events(events.path)[0]["kind"] == "driver_alloc_failed"
    finally:
        w.stop()


def test_outside_the_band_or_disabled_it_alerts(tmp_path: Path) -> None:
    w, source, events = watch(tmp_path / "a")
    off, off_source, off_events = watch(tmp_path / "b", enabled=False)
    try:
        source.queued = public(1001)
        assert w.poll(time.monotonic(), 13 * GiB, 8 * GiB, 4 * GiB, armed=True) is None
        off_source.queued = public(1001)
        assert off.poll(time.monotonic(), 9 * GiB, 8 * GiB, 4 * GiB, armed=True) is None
        assert wait_until(lambda: len(read_events(events.path)) == 1 and len(read_events(off_events.path)) == 1, 5)
        assert read_events(events.path)[0]["action"] == "alerted"
        assert "kernel_log_corroboration is off" in read_events(off_events.path)[0]["summary"]
    finally:
        w.stop()
        off.stop()


def test_xids_are_counted_and_the_named_pid_attributed(tmp_path: Path, spawner: Spawner) -> None:
    pidfile = tmp_path / "engine.pids"
    spawner.engine("--title", "VLLM::EngineCore", "--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=2)
    members = pids_in(pidfile)
    root = next(pid for pid, (_t, role) in members.items() if role == "root")
    worker = next(pid for pid in members if pid != root)
    w, source, events = watch(tmp_path)
    try:
        x31 = public(1011)[0]
        text = x31.text.replace("pid=2913", f"pid={worker}")
        source.queued = [KmsgRecord(0, 4, 1, 1, text), *public(1010, 1012)]
        assert w.poll(time.monotonic(), 10 * GiB, 8 * GiB, 4 * GiB, armed=True) is None  # an Xid never fires
        assert wait_until(lambda: len(read_events(events.path)) == 3, 10)
        by_code = {e["code"]: e for e in read_events(events.path)}
        assert by_code[31]["engine"] == "vllm" and by_code[31]["engine_root_pid"] == root
        assert by_code[79]["page"] is True and by_code[48]["page"] is True and by_code[31]["page"] is False
        with w.lock:
            assert w.stats.xid_total == {31: 1, 79: 1, 48: 1}
            assert [code for _ts, code, _name in w.stats.recent_xids] == [31, 79, 48]
    finally:
        w.stop()
