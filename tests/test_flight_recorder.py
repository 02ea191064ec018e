"""The flight recorder: the ring file's format, its rotation at a new boot, the recorder's cadence and bounds, and a
hundred SIGKILLs of a guard loop while it writes (the ring stays readable, its last record within 2 s of the kill)."""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sparkwatch.common.flightrec import (
    HEADER_BYTES,
    PAYLOAD_MAX_BYTES,
    SLOT_BYTES,
    SLOT_HEAD_BYTES,
    TREES_MAX,
    RingWriter,
    decode_sample,
    encode_sample,
    read_ring,
    ring_capacity,
)
from sparkwatch.common.sources.buddyinfo import page_size_bytes
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.core.postmortem.flight import FlightSample, LaunchedEngine, TreeFootprint, pool_trend, sample_due
from sparkwatch.core.units import GiB, MiB
from sparkwatch.guard.recorder import QUEUE_MAX, FlightRecorder, Tick
from tests.conftest import ROOT
from tests.daemon import sparkwatch_run
from tests.receiver import wait_until

BOOT_A = "a" * 32
BOOT_B = "b" * 32


def sample(t: float, available: int = 60 * GiB, **kw: object) -> FlightSample:
    base = FlightSample(
        t=t,
        available_bytes=available,
        free_bytes=available // 2,
        cached_bytes=4 * GiB,
        shmem_bytes=GiB,
        fill_rate_bytes_per_s=0.0,
        interval_s=1.0,
        near_floor=False,
        guard_phase="watch",
        kills=0,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


# --- the file


def test_the_ring_keeps_the_newest_records_in_order(tmp_path: Path) -> None:
    writer = RingWriter(tmp_path / "recorder.ring", 10, BOOT_A)
    writer.open()
    for i in range(25):
        writer.write(sample(1000.0 + i, available=i))
    writer.close()
    ring = read_ring(tmp_path / "recorder.ring")
    assert ring is not None and ring.boot_id == BOOT_A and ring.capacity == 10
    assert [s.available_bytes for s in ring.samples] == list(range(15, 25))
    assert ring.last_seq == 25 and ring.last_sample_at == 1024.0
    assert (tmp_path / "recorder.ring").stat().st_size == HEADER_BYTES + 10 * SLOT_BYTES  # preallocated, never grows


def test_a_torn_record_costs_that_record_only(tmp_path: Path) -> None:
    path = tmp_path / "recorder.ring"
    writer = RingWriter(path, 8, BOOT_A)
    writer.open()
    for i in range(8):
        writer.write(sample(1000.0 + i, available=i))
    writer.close()
    with open(path, "r+b") as fh:  # a power loss that tore slot 3: a value changed, the record still well-formed
        offset = HEADER_BYTES + 3 * SLOT_BYTES + SLOT_HEAD_BYTES + 8  # the first byte of available_bytes
        fh.seek(offset)
        assert fh.read(1) == b"\x03"
        fh.seek(offset)
        fh.write(b"\x09")
        fh.seek(HEADER_BYTES + 5 * SLOT_BYTES + 30)  # and slot 5 with garbage over its payload
        fh.write(b"\xff" * 200)
    ring = read_ring(path)
    assert ring is not None
    assert [s.available_bytes for s in ring.samples] == [0, 1, 2, 4, 6, 7]


def test_a_restart_in_the_same_boot_continues_and_a_new_boot_keeps_the_old_ring(tmp_path: Path) -> None:
    path = tmp_path / "recorder.ring"
    first = RingWriter(path, 16, BOOT_A)
    first.open()
    for i in range(3):
        first.write(sample(1000.0 + i))
    first.close()
    again = RingWriter(path, 16, BOOT_A)
    again.open()
    assert again.next_seq == 4 and not again.rotated
    again.write(sample(1003.0))
    again.close()
    new_boot = RingWriter(path, 16, BOOT_B)
    new_boot.open()
    assert new_boot.rotated
    new_boot.write(sample(2000.0))
    new_boot.close()
    prev = read_ring(tmp_path / "recorder.prev.ring")
    assert prev is not None and prev.boot_id == BOOT_A
    assert [s.t for s in prev.samples] == [1000.0, 1001.0, 1002.0, 1003.0]
    now = read_ring(path)
    assert now is not None and now.boot_id == BOOT_B and [s.t for s in now.samples] == [2000.0]


def test_garbage_where_the_ring_should_be_is_replaced_and_a_symlink_refused(tmp_path: Path) -> None:
    path = tmp_path / "recorder.ring"
    path.write_bytes(b"not a ring at all" * 100)
    assert read_ring(path) is None
    writer = RingWriter(path, 4, BOOT_A)
    writer.open()
    writer.write(sample(1.0))
    writer.close()
    ring = read_ring(path)
    assert ring is not None and len(ring.samples) == 1
    other = tmp_path / "elsewhere"
    other.write_text("precious")
    link = tmp_path / "link" / "recorder.ring"
    link.parent.mkdir()
    link.symlink_to(other)
    with pytest.raises(OSError):
        RingWriter(link, 4, BOOT_A).open()
    assert other.read_text() == "precious"


def test_a_sample_with_many_trees_keeps_the_biggest_and_round_trips() -> None:
    trees = tuple(TreeFootprint("vllm-" + "x" * 40, 100000 + i, (50 - i) * GiB) for i in range(30))
    launched = (LaunchedEngine("qwen3", 4242, "loading_weights"), LaunchedEngine("gemma", 4343, "serving"))
    full = sample(1.0, trees=trees, launched=launched, free_2mib_bytes=3 * GiB, psi_some_us=12, trees_age_s=0.5)
    payload = encode_sample(full)
    assert len(payload) <= PAYLOAD_MAX_BYTES
    back = decode_sample(payload)
    assert [t.root_pid for t in back.trees] == list(range(100000, 100000 + TREES_MAX))  # the biggest kept
    assert back.trees[0].kind == "vllm-xxxxxxxxxxx" and back.trees[0].footprint_bytes == 50 * GiB  # cut to its field
    assert back.launched == launched
    assert back == replace(full, trees=back.trees)  # everything else exactly as written, None stays None
    assert back.free_64kib_bytes is None and back.gpu_bytes is None and back.psi_full_us is None


# --- the recorder


def test_one_sample_a_second_far_from_the_floor_every_tick_near_it() -> None:
    assert sample_due(None, 10.0, False)
    assert not sample_due(10.0, 10.5, False)
    assert sample_due(10.0, 10.97, False)  # a tick a few ms early still takes its second
    assert sample_due(10.0, 10.05, True)


def test_the_recorder_writes_what_the_guard_knows_and_marks_a_clean_stop(tmp_path: Path) -> None:
    proc_root = Path("/proc")
    mem = MeminfoReader(proc_root).read()
    root = Proc(4242, 1, os.getuid(), "vllm", "S", 1, 3 * GiB, ("vllm", "serve"))
    worker = Proc(4243, 4242, os.getuid(), "VLLM::EngineCor", "S", 2, 2 * GiB, ("VLLM::EngineCore",))
    tree = EngineTree("vllm", root, (root, worker))
    now = time.monotonic()
    recorder = FlightRecorder(
        tmp_path,
        60,
        proc_root,
        trees=lambda: (now - 2.0, (tree,)),
        roots=lambda: (("vllm", 4242), ("llama.cpp", 777)),
        engines=lambda: 2,
        gpu=lambda: (now, {4243: 40 * GiB}),
    )
    recorder.start()
    try:
        for i in range(3):
            recorder.offer(Tick(now + i, time.time(), mem, 5.0 * MiB, 1.0, False, "watch", 0))
        recorder.offer(Tick(now + 2.5, time.time(), mem, 5.0 * MiB, 1.0, False, "watch", 0))  # not due: dropped
        assert wait_until(lambda: recorder.samples_total == 3, 5)
    finally:
        recorder.stop()
    ring = read_ring(tmp_path / "recorder.ring")
    assert ring is not None and len(ring.samples) == 4
    first = ring.samples[0]
    assert first.trees[0] == TreeFootprint("vllm", 4242, 45 * GiB)  # RSS of both plus the worker's GPU bytes
    assert first.trees[1] == TreeFootprint("llama.cpp", 777, None)  # telemetry's word only
    assert first.engines == 2 and first.gpu_bytes == 40 * GiB and first.trees_age_s == 2.0
    assert first.shmem_bytes == mem.shmem_bytes and first.available_bytes == mem.available_bytes
    assert first.psi_some_us is not None and first.free_2mib_bytes is not None  # this kernel has PSI and buddyinfo
    assert ring.samples[-1].stopping and not any(s.stopping for s in ring.samples[:-1])
    assert recorder.syncs_total == 1  # far from the floor only the stop syncs


def test_a_stuck_writer_never_holds_up_the_guard(tmp_path: Path) -> None:
    """Without its thread (as if stuck on a dead disk) the queue stays bounded; the offers return at once."""
    recorder = FlightRecorder(tmp_path, 60, Path("/proc"))
    mem = MeminfoReader(Path("/proc")).read()
    t0 = time.monotonic()
    for i in range(QUEUE_MAX + 50):
        recorder.offer(Tick(float(i), time.time(), mem, 0.0, 0.05, True, "watch", 0))
    assert time.monotonic() - t0 < 1.0
    assert recorder.dropped_total == 50


def test_near_the_floor_it_batches_and_syncs_at_most_once_a_second(tmp_path: Path) -> None:
    recorder = FlightRecorder(tmp_path, 60, Path("/proc"))
    mem = MeminfoReader(Path("/proc")).read()
    recorder.start()
    try:
        for i in range(40):  # 2 s of ticks at 50 ms
            recorder.offer(Tick(100.0 + i * 0.05, time.time(), mem, 2e9, 0.05, True, "watch", 0))
        assert wait_until(lambda: recorder.samples_total >= 36, 5)  # the last batch waits for the next handover
    finally:
        recorder.stop()
    assert recorder.samples_total == 41
    assert recorder.handovers_total == 9  # a batch every 0.25 s (the first at once), and the stop's: not 41 wake-ups
    assert recorder.syncs_total == 3  # the first near-floor record, the one a second later, and the clean stop
    ring = read_ring(tmp_path / "recorder.ring")
    assert ring is not None and len(ring.samples) == 41


def test_pool_trend_over_the_last_minute() -> None:
    samples = [sample(1000.0 + i, available=(200 - i) * GiB) for i in range(120)]
    trend = pool_trend(samples)
    assert trend is not None
    assert trend.span_s == 60 and trend.samples == 61
    assert trend.first_available_bytes == 141 * GiB and trend.min_available_bytes == 81 * GiB
    assert trend.change_bytes_per_s == -GiB and "draining at 1.0 GiB/s" in trend.words


# --- crash safety


def newer_than(path: Path, seq: int) -> bool:
    ring = read_ring(path)
    return ring is not None and ring.last_seq > seq


def test_a_guard_killed_mid_write_a_hundred_times_leaves_a_readable_recent_ring(tmp_path: Path) -> None:
    """A real guard loop (PoolWatch + FlightRecorder, real /proc, a record every 50 ms and an fdatasync a second),
    SIGKILLed at a random instant a hundred times: every time the ring reads whole, no record is torn, and its last
    record is at most 2 s older than the kill."""
    state = tmp_path / "state"
    zygote = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "helpers" / "recorder_zygote.py"), str(state)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    rng = random.Random(23)
    last_seq = 0
    capacity = ring_capacity(30)
    try:
        for round_ in range(100):
            zygote.stdin.write("spawn\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            # Wait for this child's first record, then kill it at a random instant within its writing.
            assert wait_until(functools.partial(newer_than, state / "recorder.ring", last_seq), 10)
            time.sleep(rng.uniform(0.0, 0.3))
            killed_at = time.time()
            os.kill(pid, signal.SIGKILL)
            zygote.stdin.write(f"reap {pid}\n")
            zygote.stdin.flush()
            status = int(zygote.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, round_
            ring = read_ring(state / "recorder.ring")
            assert ring is not None, round_
            assert ring.last_seq > last_seq
            # Every record from the first kept one to the last reads back: none torn, none lost.
            assert len(ring.samples) == min(ring.last_seq, capacity), (round_, len(ring.samples), ring.last_seq)
            assert ring.last_sample_at is not None and killed_at - ring.last_sample_at <= 2.0, round_
            last_seq = ring.last_seq
    finally:
        zygote.stdin.write("quit\n")
        zygote.stdin.close()
        zygote.wait(10)
        zygote.stdout.close()


def test_a_real_daemon_killed_with_sigkill_keeps_its_recent_ring(tmp_path: Path) -> None:
    """`sparkwatch run` (both processes, one record a second far from the floor), SIGKILLed: the ring holds a record
    from the last two seconds; a second daemon in the same boot continues it."""
    state = tmp_path / "state"
    seqs = []
    for _ in range(2):
        with sparkwatch_run(tmp_path) as daemon:
            assert wait_until(lambda: (r := read_ring(state / "recorder.ring")) is not None and len(r.samples) >= 2, 15)
            time.sleep(random.uniform(0.0, 1.5))
            killed_at = time.time()
            daemon.proc.kill()
            daemon.proc.wait(10)
        ring = read_ring(state / "recorder.ring")
        assert ring is not None and ring.last_sample_at is not None
        assert killed_at - ring.last_sample_at <= 2.0
        assert not ring.samples[-1].stopping  # no clean-stop mark: it was killed
        seqs.append(ring.last_seq)
    assert seqs[1] > seqs[0]
    assert not (state / "recorder.prev.ring").exists()  # the same boot: continued, not rotated


def test_without_buddyinfo_or_psi_a_sample_says_none(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "buddyinfo").write_text("Node 0, zone   Normal  garbage\n")
    recorder = FlightRecorder(tmp_path / "state", 60, proc)
    mem = MeminfoReader(Path("/proc")).read()
    got = recorder.sample(Tick(1.0, 2.0, mem, 0.0, 1.0, False, "watch", 0))
    assert got.free_2mib_bytes is None and got.free_64kib_bytes is None  # garbled: never guessed
    assert got.psi_some_us is None and got.psi_full_us is None  # no PSI in this /proc
    (proc / "buddyinfo").write_text(
        "Node 0, zone   Normal      1      2      3      4      5      6      7      8      9     10     11\n"
    )
    again = recorder.sample(Tick(2.0, 3.0, mem, 0.0, 1.0, False, "watch", 0))
    page = page_size_bytes()
    want = sum(n * (page << order) for order, n in enumerate(range(1, 12)) if page << order >= 2 * MiB)
    assert again.free_2mib_bytes == want
