"""NvmlSource against a fake NVML built from pynvml's real names (a GB10 cannot exist here), and against the real
pynvml where the real outcome here is "library not found"."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from sparkwatch.core.model import GpuProcess
from sparkwatch.telemetry.sources.nvml import (
    ENERGY_EVERY_S,
    NO_LIBRARY_RETRY_S,
    UNIFIED_TOLERANCE,
    NvmlSource,
    is_unified,
)
from tests.helpers.fake_nvml import NOT_SUPPORTED, Err, FakeNvml, gb10

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
GB10_PROC = FIXTURES / "gb10-proc"  # MemTotal 127600748 kB, a real GB10 reading
GB10_MEM_TOTAL_BYTES = 127_600_748 * 1024


_open: list[NvmlSource] = []


def source(fake: FakeNvml, timeout_s: float = 0.5) -> NvmlSource:
    src = NvmlSource(timeout_s=timeout_s, nvml=fake, proc_root=GB10_PROC)
    _open.append(src)
    return src


@pytest.fixture(autouse=True)
def _close_sources() -> Iterator[None]:
    yield
    while _open:
        _open.pop().close()


def nvml_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sparkwatch-nvml"]


def test_gb10_idle_reads_what_works_and_leaves_out_what_is_not_supported() -> None:
    fake = FakeNvml([gb10()])
    report = source(fake).collect()
    assert report.up and report.nvml_return_code == 0 and report.error is None
    assert report.driver_version == "580.95.05" and report.nvml_version == "13.580.95.05"
    (dev,) = report.devices
    assert (dev.index, dev.name, dev.bus_id) == (0, "NVIDIA GB10", "0000000F:01:00.0")
    assert dev.uuid.startswith("GPU-")
    assert dev.power_watts == pytest.approx(11.64)
    assert dev.utilization_ratio == 0.0  # a real 0 %, not a missing field
    assert dev.temperature_celsius == 41.0
    assert dev.sm_clock_hertz == 2418e6 and dev.sm_clock_max_hertz == 3003e6
    assert dev.energy_joules == pytest.approx(48_213.577)
    # NOT_SUPPORTED on a GB10: absent, never 0
    assert dev.memory_clock_max_hertz is None
    assert dev.power_limit_watts is None
    assert dev.memory_total_bytes is None and dev.memory_used_bytes is None
    assert dev.unified
    assert dev.supported["memory"] is False
    assert dev.supported["memory_clock_max"] is False
    assert dev.supported["power_limit"] is False
    for field in ("power", "utilization", "temperature", "sm_clock", "energy", "processes"):
        assert dev.supported[field] is True, field
    assert dev.field_errors == {}


def test_processes_from_both_lists_are_one_entry_per_pid() -> None:
    fake = FakeNvml([gb10(), gb10(uuid="GPU-second", compute_procs=[(777, 1 << 30)], graphics_procs=[])])
    report = source(fake).collect()
    # pid 4242 is in the compute and the graphics list of GPU 0: once. 5150's figure is not available: None.
    assert report.devices[0].processes == (GpuProcess(4242, 87_000_000_000, 0), GpuProcess(5150, None, 0))
    assert report.processes == (
        GpuProcess(4242, 87_000_000_000, 0),
        GpuProcess(5150, None, 0),
        GpuProcess(777, 1 << 30, 1),
    )
    pid, used, gpu = report.processes[2]  # plain tuples for callers that unpack
    assert (pid, used, gpu) == (777, 1 << 30, 1)


@pytest.mark.parametrize(
    ("memory", "unified"),
    [
        (Err(NOT_SUPPORTED), True),  # most GB10 drivers
        ((0, 0, 0), True),  # SUCCESS with zeros
        ((128_500_000_000, 10_000_000_000, 118_500_000_000), True),  # one tool's GB10: total ≈ MemTotal
        ((150_754_820_096, 145_262_510_080, 5_492_310_016), False),  # H200 VRAM (real figures)
    ],
)
def test_unified_memory_rule(memory: tuple[int, int, int] | Err, unified: bool) -> None:
    report = source(FakeNvml([gb10(memory=memory)])).collect()
    dev = report.devices[0]
    assert dev.unified is unified
    if unified:
        assert dev.memory_total_bytes is None and dev.memory_used_bytes is None
    else:
        assert dev.memory_total_bytes == 150_754_820_096 and dev.memory_used_bytes == 5_492_310_016


def test_unified_rule_edges() -> None:
    assert is_unified(None, GB10_MEM_TOTAL_BYTES)
    assert is_unified(int(GB10_MEM_TOTAL_BYTES * (1 + UNIFIED_TOLERANCE * 0.9)), GB10_MEM_TOTAL_BYTES)
    assert not is_unified(int(GB10_MEM_TOTAL_BYTES * (1 + UNIFIED_TOLERANCE * 1.1)), GB10_MEM_TOTAL_BYTES)
    assert not is_unified(80 << 30, None)  # MemTotal unreadable: a non-zero total is VRAM


def test_identity_is_read_once_and_each_cycle_costs_seven_calls_and_energy_every_5_s() -> None:
    fake = FakeNvml([gb10()])
    now = [100.0]
    src = NvmlSource(timeout_s=0.5, nvml=fake, proc_root=GB10_PROC, clock=lambda: now[0])
    _open.append(src)
    first = src.collect().devices[0]
    before = sum(fake.calls.values())
    energy = fake.calls["nvmlDeviceGetTotalEnergyConsumption"]
    for _ in range(4):  # t = 101 .. 104: within ENERGY_EVERY_S of the first read
        now[0] += 1.0
        dev = src.collect().devices[0]
        assert dev.energy_joules == first.energy_joules and dev.supported.get("energy") is True  # the last reading
    assert fake.calls["nvmlInit"] == 1
    assert fake.calls["nvmlDeviceGetUUID"] == 1
    assert (sum(fake.calls.values()) - before) / 4 == 7  # 4.0 ms of CPU a call on an H200: not every second
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == energy
    now[0] += 1.0  # t = 105: due again
    src.collect()
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == energy + 1
    now[0] += ENERGY_EVERY_S - 0.01  # a cycle of the 5 s quiet cadence, a touch early: due all the same
    src.collect()
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == energy + 2


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has libnvidia-ml")
def test_real_pynvml_without_the_library_reports_code_12_every_cycle() -> None:
    now = [0.0]
    # the real pynvml, imported lazily; libnvidia-ml.so.1 is absent here
    src = NvmlSource(timeout_s=2.0, clock=lambda: now[0])
    for step in (0.0, 1.0, NO_LIBRARY_RETRY_S):  # the first try, the standing report, a second try
        now[0] += step
        report = src.collect()
        assert not report.up
        assert report.nvml_return_code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND == 12
        assert report.error is not None and "LibraryNotFound" in report.error
        assert report.devices == ()


# In a child process (this one has pynvml loaded): what NvmlSource reports without the library, whether that loaded
# pynvml, and then what the real pynvml's nvmlInit says.
WITHOUT_LIBRARY_PROBE = """
import json, sys
from sparkwatch.telemetry.sources.nvml import NvmlSource
src = NvmlSource(timeout_s=2.0)
report = src.collect()
loaded = "pynvml" in sys.modules
src.close()
import pynvml
try:
    pynvml.nvmlInit()
    real = None
except pynvml.NVMLError as exc:
    real = [exc.value, type(exc).__name__]
print(json.dumps({"up": report.up, "code": report.nvml_return_code, "error": report.error, "loaded": loaded,
                  "real": real}))
"""


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has libnvidia-ml")
def test_without_the_library_pynvml_is_not_imported_and_the_report_is_pynvmls() -> None:
    """With no libnvidia-ml at all, nvmlInit's answer is given without importing pynvml (its import was 22-31 ms
    of `status`'s start-up here), and it is the answer the real pynvml gives, word for word."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_LIBRARY_PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-1])
    code, name = got["real"]
    assert code == pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    assert not got["loaded"]
    assert not got["up"] and got["code"] == code
    assert got["error"] == f"nvmlInit: {name} (NVML code {code})"


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,  # 9: no module (a stranded driver after a kernel update)
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,  # 18: user space updated, old module still loaded
    ],
)
def test_init_failure_is_down_with_the_code_and_retried_each_cycle(code: int) -> None:
    fake = FakeNvml([gb10()])
    fake.init_error = code
    src = source(fake)
    for cycle in range(1, 4):
        report = src.collect()
        assert not report.up and report.nvml_return_code == code and report.devices == ()
        assert fake.calls["nvmlInit"] == cycle
    assert fake.calls["nvmlShutdown"] == 0  # nothing to shut down: init never succeeded


def test_a_failing_energy_read_stays_an_error_between_reads_never_unsupported() -> None:
    fake = FakeNvml([gb10(energy_mj=Err(pynvml.NVML_ERROR_UNKNOWN))])
    now = [0.0]
    src = NvmlSource(timeout_s=0.5, nvml=fake, proc_root=GB10_PROC, clock=lambda: now[0])
    _open.append(src)
    for _ in range(3):  # the read at t=0, then two cycles that reuse what it said
        dev = src.collect().devices[0]
        assert dev.energy_joules is None and dev.field_errors.get("energy") == 999
        assert "energy" not in dev.supported  # unknown, not "unsupported"
        now[0] += 1.0


def test_no_library_is_tried_again_every_30_s_and_reported_in_between() -> None:
    fake = FakeNvml([gb10()])
    fake.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND  # 12: no libnvidia-ml on this box
    now = [0.0]
    src = NvmlSource(timeout_s=0.5, nvml=fake, proc_root=GB10_PROC, clock=lambda: now[0])
    _open.append(src)
    for _ in range(5):  # a cycle a second: one dlopen, the same down report four more times
        report = src.collect()
        assert not report.up and report.nvml_return_code == 12
        now[0] += 1.0
    assert fake.calls["nvmlInit"] == 1
    fake.init_error = None  # the driver's user space got installed
    now[0] = NO_LIBRARY_RETRY_S
    assert src.collect().up and fake.calls["nvmlInit"] == 2


def test_recovery_after_the_driver_loads() -> None:
    fake = FakeNvml([gb10()])
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    src = source(fake)
    assert src.collect().nvml_return_code == 9
    fake.init_error = None  # the human rebooted / loaded the module
    report = src.collect()
    assert report.up and report.nvml_return_code == 0 and report.devices[0].power_watts == pytest.approx(11.64)


def test_a_fatal_code_mid_run_shuts_down_and_reinitialises() -> None:
    fake = FakeNvml([gb10()])
    src = source(fake)
    assert src.collect().up
    fake.fail["nvmlDeviceGetPowerUsage"] = pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
    report = src.collect()
    assert not report.up and report.nvml_return_code == 18
    assert fake.calls["nvmlShutdown"] == 1
    del fake.fail["nvmlDeviceGetPowerUsage"]
    report = src.collect()
    assert report.up and fake.calls["nvmlInit"] == 2
    assert fake.calls["nvmlDeviceGetUUID"] == 2  # identity re-read after re-init


def test_raising_on_every_call_never_raises() -> None:
    fake = FakeNvml([gb10()])
    fake.fail_all = pynvml.NVML_ERROR_UNKNOWN
    src = source(fake)
    for _ in range(2):
        report = src.collect()
        assert not report.up and report.nvml_return_code == pynvml.NVML_ERROR_UNKNOWN == 999


def test_every_read_failing_after_init_is_down_and_reinitialises() -> None:
    fake = FakeNvml([gb10()])
    src = source(fake)
    assert src.collect().up
    fake.fail_all = pynvml.NVML_ERROR_GPU_IS_LOST
    report = src.collect()
    assert not report.up and report.nvml_return_code == pynvml.NVML_ERROR_GPU_IS_LOST
    fake.fail_all = None
    assert src.collect().up and fake.calls["nvmlInit"] == 2


def test_one_failing_field_is_absent_and_recorded_the_rest_stays() -> None:
    fake = FakeNvml([gb10(temperature_c=Err(pynvml.NVML_ERROR_UNKNOWN))])
    report = source(fake).collect()
    assert report.up
    dev = report.devices[0]
    assert dev.temperature_celsius is None
    assert dev.field_errors == {"temperature": 999}
    assert "temperature" not in dev.supported  # unknown, not "unsupported"
    assert dev.power_watts == pytest.approx(11.64)


def test_a_function_missing_from_an_old_nvidia_ml_py_is_a_field_error() -> None:
    class OldNvml(FakeNvml):
        nvmlDeviceGetTotalEnergyConsumption = None  # type: ignore[assignment]

    report = source(OldNvml([gb10()])).collect()
    assert report.up and report.devices[0].energy_joules is None
    assert report.devices[0].field_errors == {"energy": -1}


def test_garbage_from_nvml_is_reported_not_raised() -> None:
    class Garbage(FakeNvml):
        def nvmlDeviceGetUtilizationRates(self, h: object) -> object:
            return "garbage"  # no .gpu

    report = source(Garbage([gb10()])).collect()
    assert not report.up and report.error is not None and "internal error" in report.error


@pytest.fixture
def release() -> Iterator[threading.Event]:
    ev = threading.Event()
    yield ev
    ev.set()  # never leave the worker hanging after a test


def wait_for(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met")


def test_a_hung_call_returns_within_the_timeout_and_piles_up_no_threads(release: threading.Event) -> None:
    fake = FakeNvml([gb10()])
    src = source(fake, timeout_s=0.2)
    assert src.collect().up
    threads_before = set(nvml_threads())
    assert src._worker._thread in threads_before
    fake.hang["nvmlDeviceGetPowerUsage"] = release

    t0 = time.monotonic()
    report = src.collect()
    elapsed = time.monotonic() - t0
    assert 0.15 <= elapsed < 0.5, elapsed
    assert not report.up and report.nvml_return_code is None
    assert report.error is not None and "nvmlDeviceGetPowerUsage" in report.error and "0.2 s" in report.error
    assert report.call_timeouts_total == 1

    # While it is stuck: answered at once, no new NVML call, no new thread.
    calls = sum(fake.calls.values())
    for _ in range(3):
        t0 = time.monotonic()
        report = src.collect()
        assert time.monotonic() - t0 < 0.1  # at once: well under the 0.2 s timeout
        assert not report.up and report.error is not None and "stuck" in report.error
    assert sum(fake.calls.values()) == calls
    assert set(nvml_threads()) <= threads_before  # no new thread started

    # The driver comes back: the stuck call returns and the next cycle is whole again.
    del fake.hang["nvmlDeviceGetPowerUsage"]
    release.set()
    wait_for(lambda: src._worker.stuck_call() is None)
    report = src.collect()
    assert report.up and report.devices[0].power_watts == pytest.approx(11.64)
    assert report.call_timeouts_total == 1
    assert set(nvml_threads()) <= threads_before  # no new thread started


def test_a_hang_inside_init_restarts_init_once_it_returns(release: threading.Event) -> None:
    fake = FakeNvml([gb10()])
    fake.hang["nvmlDeviceGetCount"] = release
    src = source(fake, timeout_s=0.2)
    report = src.collect()
    assert not report.up and report.error is not None and "nvmlDeviceGetCount" in report.error
    del fake.hang["nvmlDeviceGetCount"]
    release.set()
    wait_for(lambda: src._worker.stuck_call() is None)
    report = src.collect()
    assert report.up and len(report.devices) == 1
    assert fake.calls["nvmlShutdown"] == 1 and fake.calls["nvmlInit"] == 2  # the half-done init was undone
    assert fake.initialized == 1


def test_close_shuts_nvml_down_and_ends_the_worker_thread() -> None:
    fake = FakeNvml([gb10()])
    src = source(fake)
    src.collect()
    thread = src._worker._thread
    assert thread is not None and thread.is_alive()
    src.close()
    assert fake.initialized == 0
    thread.join(2.0)
    assert not thread.is_alive()
    assert src.collect().up  # and starts over when asked again


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        NvmlSource(timeout_s=0)
