"""Near-budget engines are sampled fast for GPU bytes, and a GPU step past the budget is killed on the next samples.

The engine tree is real (titled like vLLM's EngineCore) and really killed; the guard's /proc is a fixture holding a
GB10's idle meminfo and links to that tree alone (as tests/test_guard_policy_loop.py does). NVML is the fake built
from the real pynvml module (tests/helpers/fake_nvml.py), since a GB10 cannot exist here; it lists the real root pid
with the bytes the test sets. The messages cross a real channel (a SOCK_SEQPACKET pair). Assertions are on the
order and count of samples and looks, never on wall-clock timing: the H200 bench (bench/gpu_runaway_bench.py) times it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pynvml
import pytest

from sparkwatch.common.channel import Channel, socketpair
from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.common.guardconfig import GuardConfig
from sparkwatch.common.messages import GpuSampleMsg, StateMsg, TelMsg, decode, encode
from sparkwatch.common.stats import BudgetStat, GuardStats, KernelLogStats
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings, settings_to_wire
from sparkwatch.core.units import GiB
from sparkwatch.guard.gpuboard import GpuBoard
from sparkwatch.guard.poolwatch import GuardLinks, PoolWatch
from sparkwatch.guard.supervisor import TelemetrySupervisor
from sparkwatch.telemetry.gpufast import GpuFastSampler, start_ticks
from sparkwatch.telemetry.sources.nvml import NvmlSource
from sparkwatch.telemetry.telemetryprocess import TelemetryProcess
from tests.conftest import Spawner, alive, pids_in, wait_until
from tests.helpers.fake_nvml import FakeNvml, gb10

GB10_IDLE = (Path(__file__).parent / "fixtures" / "proc" / "meminfo.gb10-idle").read_text()
LISTS = "nvmlDeviceGetComputeRunningProcesses"


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "meminfo").write_text(GB10_IDLE)
    return root


def nvml_for(pid: int, used: int) -> tuple[FakeNvml, NvmlSource]:
    fake = FakeNvml([gb10(compute_procs=[(pid, used)])])
    source = NvmlSource(nvml=fake)
    assert source.collect().up  # the telemetry cycle initialises NVML; the fast sampler only reads process lists
    return fake, source


def test_the_sampler_reads_only_when_watched_sends_only_changes_and_counts_nvml_failures(
    spawner: Spawner, tmp_path: Path
) -> None:
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--title", "VLLM::EngineCore_fast", "--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=2)
    pid = min(pids_in(pidfile))
    start = start_ticks("/proc", pid)
    assert start is not None
    fake, source = nvml_for(pid, 5 * GiB)
    guard_end, tel_end = (Channel(s) for s in socketpair())
    try:
        sampler = GpuFastSampler(source.process_bytes, tel_end.send)
        before = fake.calls[LISTS]
        assert sampler.sample() is None and fake.calls[LISTS] == before  # nothing watched: NVML is not asked
        sampler.watch([(pid, start + 1)])  # the pid, but another start time: a reused pid is not the engine
        assert sampler.watched == frozenset()
        sampler.watch([(pid, start)])
        first = sampler.sample()
        assert first is not None and first.pids == {pid: 5 * GiB}
        assert sampler.sample() is None  # unchanged: nothing sent
        fake.gpus[0].compute_procs = [(pid, 15 * GiB)]  # the step
        assert sampler.sample() is not None
        assert fake.calls[LISTS] - before == 3  # one process-list call a sample, one GPU
        got = guard_end.receive(1.0)
        assert [m.pids[pid] for m in got if isinstance(m, GpuSampleMsg)] == [5 * GiB, 15 * GiB]
        fake.fail[LISTS] = pynvml.NVML_ERROR_UNKNOWN
        fake.gpus[0].compute_procs = [(pid, 1 * GiB)]
        sampler.sample()  # never raises: the failed list is counted, the sample says 0 bytes for it
        assert source.fast_errors_total == 1
        sampler.watch([])
        assert sampler.sample() is None
    finally:
        guard_end.close()
        tel_end.close()


def test_the_sampler_thread_sends_a_step_and_idles_when_nothing_is_watched(spawner: Spawner, tmp_path: Path) -> None:
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--title", "VLLM::EngineCore_fast", "--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=2)
    pid = min(pids_in(pidfile))
    start = start_ticks("/proc", pid)
    assert start is not None
    fake, source = nvml_for(pid, 5 * GiB)
    sent: list[GpuSampleMsg] = []
    sampler = GpuFastSampler(source.process_bytes, sent.append)
    sampler.start()
    try:
        sampler.watch([(pid, start)])
        assert wait_until(lambda: bool(sent), 5)
        fake.gpus[0].compute_procs = [(pid, 15 * GiB)]
        assert wait_until(lambda: sent[-1].pids[pid] == 15 * GiB, 5)
        sampler.watch([])
        assert wait_until(lambda: sampler.watched == frozenset(), 5)
    finally:
        sampler.stop()
        source.close()


def test_a_near_budget_engine_is_watched_and_a_gpu_step_is_killed_on_the_next_looks(
    spawner: Spawner, proc_root: Path, tmp_path: Path
) -> None:
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--title", "VLLM::EngineCore_gpu-step", "--worker", "VLLM::Worker_TP0",
                   pidfile=pidfile, wait_for=2)  # fmt: skip
    pids = pids_in(pidfile)
    for pid in pids:
        (proc_root / str(pid)).symlink_to(f"/proc/{pid}")
    root = min(pids)
    settings = load_settings(
        overrides={
            "proc_root": proc_root,
            "state_dir": tmp_path / "state",
            "floor": "8GiB",
            "mlock": False,
            "ancestor_pid": os.getpid(),
            "engine_budgets": ["6GiB=gpu-step"],
        }
    )
    woken: list[int] = []
    board = GpuBoard(on_sample=lambda: woken.append(1))
    guard = PoolWatch.build(
        guard_config(settings), EventLog(settings.events_path), GuardLinks(gpu_bytes_by_pid=board.latest)
    )
    fake, source = nvml_for(root, 5 * GiB)
    guard_end, tel_end = (Channel(s) for s in socketpair())
    guard.reaper.start()
    try:
        # The cycle's reading: 5 GiB of GPU memory + the tree's RSS, over 80 % of 6 GiB.
        board.update(TelMsg(gpu_ts=time.time(), gpu_pids={root: 5 * GiB}))
        guard.tick()
        (stat,) = guard.stats.budgets
        assert stat.footprint_bytes is not None and stat.footprint_bytes >= 0.8 * 6 * GiB
        # The state names the tree's members for fast sampling, and it crosses the channel as it is.
        state = StateMsg(guard.stats.snapshot(), KernelLogStats())
        wire = decode(encode(state))
        assert isinstance(wire, StateMsg)
        watch = [key for b in wire.guard.budgets for key in b.gpu_watch]
        assert {pid for pid, _start in watch} == set(pids)

        sampler = GpuFastSampler(source.process_bytes, tel_end.send, proc_root=str(proc_root))
        sampler.watch(watch)

        def deliver() -> None:
            for msg in guard_end.receive(1.0):
                assert isinstance(msg, GpuSampleMsg)
                board.update_fast(msg)

        assert sampler.sample() is not None
        deliver()
        looks = guard.budgets.samples_total
        guard.tick()
        assert guard.budgets.samples_total == looks  # the same bytes: the schedule stands, no extra look
        fake.gpus[0].compute_procs = [(root, 15 * GiB)]  # one step of 10 GiB
        assert sampler.sample() is not None
        deliver()
        assert woken  # the guard's loop is woken for it
        guard.tick()
        assert guard.budgets.samples_total == looks + 1  # looked at on the very tick after the sample
        assert not guard.stats.kills_total  # the debounce's first sample over the limit
        assert wait_until(lambda: guard.tick() is not None and bool(guard.stats.kills_total), 5, step_s=0.01)
        assert guard.budgets.samples_total == looks + 2  # the debounce's second look kills: no look in between
        assert wait_until(lambda: not any(alive(pid, ticks) for pid, (ticks, _r) in pids.items()), 10)
        assert wait_until(lambda: any(e["kind"] == "kill" for e in read_events(settings.events_path)), 10)
        kill = next(e for e in read_events(settings.events_path) if e["kind"] == "kill")
        assert kill["trigger"] == "budget" and kill["victim_gpu_bytes"] == 15 * GiB
    finally:
        guard.reaper.stop()
        guard_end.close()
        tel_end.close()
        source.close()


def test_a_state_never_asks_for_more_than_the_bound_of_pids() -> None:
    stats = GuardStats()
    msg = GpuSampleMsg(0.0, {pid: 1 for pid in range(65)})
    with pytest.raises(ValueError, match="more than 64 pids"):
        decode(encode(msg))
    assert isinstance(decode(encode(StateMsg(stats, KernelLogStats()))), StateMsg)


def test_telemetry_watches_what_the_guards_state_names_and_the_supervisor_wakes_the_guard(tmp_path: Path) -> None:
    """The wiring of both processes: a state naming a near tree's members sets telemetry's watch (and one naming
    none clears it); a sample coming back is laid over the cycle's reading and wakes the guard's loop."""
    settings = load_settings(
        None,
        {"state_dir": tmp_path / "state", "root": tmp_path / "root", "mlock": False, "listen": "127.0.0.1:9"},
    )
    me = os.getpid()
    start = start_ticks("/proc", me)
    assert start is not None
    guard_end, telemetry_end = (Channel(s) for s in socketpair())
    tp = TelemetryProcess(settings, telemetry_end)
    try:
        near = GuardStats(budgets=[BudgetStat(me, "vllm", "m", 6 * GiB, 5 * GiB, "rss+gpu", 5 * GiB, "config",
                                              gpu_watch=((me, start),))])  # fmt: skip
        assert guard_end.send(StateMsg(near, KernelLogStats()))
        for msg in telemetry_end.receive(5.0):
            tp.handle(msg)
        assert tp.gpu_fast.watched == frozenset({me})
        assert guard_end.send(StateMsg(GuardStats(), KernelLogStats()))
        for msg in telemetry_end.receive(5.0):
            tp.handle(msg)
        assert tp.gpu_fast.watched == frozenset()
    finally:
        guard_end.close()
        telemetry_end.close()
        tp.loop.telemetry.close()

    config = GuardConfig.from_wire(settings_to_wire(settings), settings.public_dict())
    woken: list[int] = []
    sup = TelemetrySupervisor(
        config, EventLog(tmp_path / "events.jsonl"), lambda: StateMsg(GuardStats(), KernelLogStats()),
        on_gpu_sample=lambda: woken.append(1),
    )  # fmt: skip
    sup._handle(TelMsg(gpu_ts=time.time() - 1.0, gpu_pids={me: 5 * GiB, 1: 1 * GiB}))
    sup._handle(GpuSampleMsg(time.time(), {me: 15 * GiB}))
    assert woken == [1]
    latest = sup.gpu.latest()
    assert latest is not None and latest[1] == {me: 15 * GiB, 1: 1 * GiB}
    sup._handle(TelMsg(gpu_ts=time.time() + 1.0, gpu_pids={me: 6 * GiB}))  # a newer cycle reading wins
    latest = sup.gpu.latest()
    assert latest is not None and latest[1] == {me: 6 * GiB}
