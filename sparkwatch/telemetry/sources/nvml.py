"""The GPU through NVML (nvidia-ml-py). The one adapter that owns NVML: the only module that imports pynvml.

Two ways in: `NvmlSource` (telemetry, every cycle) and `probe_nvml` (the one-shot library/driver version question the
drift check and doctor ask). The return codes are core.driver.nvmlcodes.NvmlReturn.

Every NVML call goes through one guarded query (`NvmlSource._query`, after nvitop's `nvmlQuery`):
- it runs on one worker thread and the caller waits at most `timeout_s` for it. A driver stuck in an ioctl (seen
  after Xid errors and during driver updates) strands that worker, not the telemetry loop. While a call is stuck,
  no new one is started: a stuck ctypes call cannot be cancelled, so each new attempt would strand another thread.
  `collect()` reports `up=False` at once until the stuck call comes back.
- an NVMLError becomes its return code. NOT_SUPPORTED leaves the field out (None), never 0 — a GB10 answers it for
  memory info, the memory clock and the power limit. Codes that mean NVML as a whole is gone (driver not loaded 9,
  library not found 12, version mismatch 18, uninitialised 1) take the report down and re-initialise next cycle;
  any other code is recorded for that field alone.

Identity (uuid, name, bus id, max clocks, power limit) is read once per initialisation; each cycle then costs
8 calls a GPU.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sparkwatch.common.sources.meminfo import MeminfoError, parse_meminfo
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.driver.nvmlcodes import FATAL_CODES as _FATAL_CODES
from sparkwatch.core.driver.nvmlcodes import NvmlReturn
from sparkwatch.core.model import GpuDevice, GpuProcess, GpuReport, NvmlFacts
from sparkwatch.telemetry.sources.nvml_preflight import LIBRARY

# Memory info "about MemTotal" means unified memory. A GB10 report saw total ≈ 128.5 GB against MemTotal
# 127,600,748 kB (130.7 GB): 1.7 % apart; if that figure was GiB (the physical 128 GiB) it is 5.6 % above MemTotal,
# which excludes kernel-reserved memory. An H200 (140.4 GiB VRAM) in a 128 GiB host is 10–12 % apart: not unified.
UNIFIED_TOLERANCE = 0.06

_MHZ = 1_000_000.0
# nvmlDeviceGetTotalEnergyConsumption is the one dear call: measured on an H200 (driver 580.159), 4.0 ms of CPU a
# call, against 2-9 us for each other field; read every cycle it was 0.40 % of a core, half of the idle agent's
# cost. The energy counter is read at most this often (the default scrape interval: each scrape still sees a new
# value, and rate() over Grafana's 4-scrape window has 3-4 of them); between reads the last value is kept.
ENERGY_EVERY_S = 5.0
# A quiet box is cycled every 5 s too (telemetry.loop.QUIET_INTERVAL_S), and a cycle reaches this read a few ms
# earlier or later than the last one did: without this slack half of them found it not yet due, and the counter moved
# every 10 s.
ENERGY_SLACK_S = 0.5
# With no libnvidia-ml at all (a box without the driver's user space), nvmlInit is a failed dlopen: 0.44 ms a cycle
# measured here, 0.04 % of a core for nothing. It is tried again only this often; in between the same report stands.
NO_LIBRARY_RETRY_S = 30.0


class NvmlCallError(Exception):
    """An NVML call returned an error code (pynvml raised NVMLError)."""

    def __init__(self, call: str, code: int | None, message: str) -> None:
        super().__init__(f"{call}: {message}" + (f" (NVML code {code})" if code is not None else ""))
        self.call = call
        self.code = code


class NvmlTimeout(Exception):
    """An NVML call did not return within the timeout, or an earlier one is still stuck."""


# One call of a batch: (pynvml function name, the function, its arguments).
Step = tuple[str, Callable[..., Any], tuple[Any, ...]]


class _Call:
    __slots__ = ("args", "done", "error", "fn", "name", "result", "started")

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.name = name
        self.fn = fn
        self.args = args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.started = time.monotonic()


class _Worker:
    """One daemon thread that runs NVML calls one at a time.

    Daemon, so that a call stuck in the driver never blocks the process from exiting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: _Call | None = None
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._running = False  # under the lock: a thread is serving (is_alive() lags a thread that decided to end)
        self.stuck: _Call | None = None  # a call that outlived its timeout and has not returned yet

    def _ensure_thread(self) -> None:
        # Called with the lock held.
        if not self._running:
            self._running = True
            self._thread = daemon_thread(self._loop, "sparkwatch-nvml")
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None:
                    if self._stopping:
                        self._running = False
                        return
                    self._wake.wait()
                call = self._pending
                self._pending = None
            try:
                call.result = call.fn(*call.args)
            except BaseException as exc:
                call.error = exc
            call.done.set()

    def stop(self) -> None:
        """Let the thread end once it is idle (a stuck call ends it when it returns). run() starts a new one."""
        with self._wake:
            self._stopping = True
            self._wake.notify()

    def stuck_call(self) -> _Call | None:
        if self.stuck is not None and self.stuck.done.is_set():
            self.stuck = None
        return self.stuck

    def run(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float) -> Any:
        call = self._start(_Call(name, fn, args))
        self._wait(call, timeout_s)
        if call.error is not None:
            raise call.error
        return call.result

    def run_batch(self, steps: Sequence[Step], timeout_s: float) -> list[tuple[Any, Exception | None]]:
        """Several calls in one hand-off to the worker, each bounded by `timeout_s` as if made alone: (result, the
        exception it raised) for each, in order. One hand-off instead of one per call: a thread wake-up costs
        0.2-1 ms of CPU on these VMs, and a cycle reads 8 fields a GPU (bench/RESULTS-idle.md)."""
        results: list[tuple[Any, Exception | None]] = []
        call = _Call(steps[0][0] if steps else "batch", lambda: None, ())

        def run_all() -> None:
            for name, fn, args in steps:
                call.name, call.started = name, time.monotonic()  # what a stuck batch is stuck in, since when
                try:
                    results.append((fn(*args), None))
                except Exception as exc:
                    results.append((None, exc))

        call.fn = run_all
        self._wait(self._start(call), timeout_s)
        return results

    def _start(self, call: _Call) -> _Call:
        stuck = self.stuck_call()
        if stuck is not None:
            raise NvmlTimeout(f"{stuck.name} has been stuck for {time.monotonic() - stuck.started:.1f} s")
        with self._wake:
            self._stopping = False
            self._ensure_thread()
            self._pending = call
            self._wake.notify()
        return call

    def _wait(self, call: _Call, timeout_s: float) -> None:
        """Until the call is done, or its current step has run for timeout_s (then it is stuck: NvmlTimeout)."""
        while not call.done.wait(max(0.0, call.started + timeout_s - time.monotonic())):
            if time.monotonic() - call.started >= timeout_s:
                self.stuck = call
                raise NvmlTimeout(f"{call.name} did not return within {timeout_s:g} s")


class _Identity:
    """What does not change while NVML stays initialised: read once per init."""

    __slots__ = (
        "bus_id",
        "energy_mj",
        "energy_read_at",
        "errors",
        "handle",
        "index",
        "memory_clock_max_hertz",
        "name",
        "power_limit_watts",
        "sm_clock_max_hertz",
        "supported",
        "uuid",
    )

    def __init__(self, index: int, handle: Any) -> None:
        self.index = index
        self.handle = handle
        self.uuid = ""
        self.name = ""
        self.bus_id = ""
        self.sm_clock_max_hertz: float | None = None
        self.memory_clock_max_hertz: float | None = None
        self.power_limit_watts: float | None = None
        self.supported: dict[str, bool] = {}
        self.errors: dict[str, int] = {}
        self.energy_mj: int | None = None  # the last energy reading (ENERGY_EVERY_S), and when it was taken
        self.energy_read_at = -math.inf


_DYNAMIC_FIELDS = ("power", "utilization", "temperature", "sm_clock", "energy", "memory", "processes")


def _all_reads_failed(devices: tuple[GpuDevice, ...]) -> int | None:
    """The code of the failures if no dynamic field of any GPU succeeded or answered NOT_SUPPORTED, else None.
    The energy counter is left out: it is read only every ENERGY_EVERY_S, the others every cycle."""
    if not devices:
        return None
    codes = []
    for dev in devices:
        for f in _DYNAMIC_FIELDS:
            if f == "energy":
                continue
            if f not in dev.field_errors:
                return None
            codes.append(dev.field_errors[f])
    return codes[0]


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def read_mem_total_bytes(proc_root: Path) -> int | None:
    try:
        return parse_meminfo((proc_root / "meminfo").read_bytes()).total_bytes
    except (OSError, MeminfoError):
        return None


def is_unified(memory_total_bytes: int | None, mem_total_bytes: int | None) -> bool:
    """The GPU's memory is the system pool: memory info unsupported (None), zero, or about MemTotal."""
    if memory_total_bytes is None or memory_total_bytes <= 0:
        return True
    if mem_total_bytes is None or mem_total_bytes <= 0:
        return False
    return abs(memory_total_bytes / mem_total_bytes - 1.0) <= UNIFIED_TOLERANCE


class NvmlSource:
    """Reads every GPU through NVML. `collect()` never raises.

    `nvml` is the pynvml module (imported lazily when None); tests pass a fake built from pynvml's own names.
    `proc_root` is where MemTotal is read, for the unified-memory rule.
    """

    def __init__(
        self,
        timeout_s: float = 0.5,
        *,
        nvml: Any = None,
        proc_root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self.proc_root = proc_root
        self.clock = clock  # when the energy counter is due (ENERGY_EVERY_S); tests step it
        self._nvml: Any = nvml
        self._worker = _Worker()
        self._lock = threading.Lock()
        self._initialized = False  # nvmlInit succeeded (so nvmlShutdown is owed)
        self._ready = False  # and the identity of every GPU was read
        self._driver_version: str | None = None
        self._nvml_version: str | None = None
        self._identities: list[_Identity] = []
        self._mem_total_bytes: int | None = None
        self.call_timeouts_total = 0
        self.fast_errors_total = 0  # failed or timed-out calls of process_bytes (the fast sampler's)
        self._no_library: tuple[float, GpuReport] | None = None  # (when, the report) while libnvidia-ml is missing

    # --- the one guarded query -------------------------------------------------------------------------------------

    def _query(self, name: str, *args: Any) -> Any:
        """Call pynvml.<name>(*args) on the worker, bounded by the timeout.

        Raises NvmlCallError (with the NVML code) or NvmlTimeout; never anything else.
        """
        nvml = self._nvml
        fn = getattr(nvml, name, None)
        if fn is None:
            raise NvmlCallError(name, None, "not in this nvidia-ml-py")
        try:
            return self._worker.run(name, fn, args, self.timeout_s)
        except NvmlTimeout:
            self.call_timeouts_total += 1
            raise
        except Exception as exc:
            raise self._call_error(name, exc) from exc

    def _call_error(self, name: str, exc: Exception) -> NvmlCallError:
        """What a call's exception means: an NVMLError becomes its return code."""
        if isinstance(exc, self._nvml.NVMLError):
            code = getattr(exc, "value", None)
            # The class name (NVMLError_DriverNotLoaded), not str(exc): for a code pynvml does not know,
            # str() calls nvmlErrorString in the library, on this thread, unguarded.
            return NvmlCallError(name, code if isinstance(code, int) else None, type(exc).__name__)
        return NvmlCallError(name, None, f"{type(exc).__name__}: {exc}")

    # --- lifecycle -------------------------------------------------------------------------------------------------

    def _init(self) -> None:
        if self._nvml is None:
            # Without libnvidia-ml at all (a box without the driver's user space), nvmlInit's answer is known before
            # pynvml is imported: its import (ctypes.util, tempfile, 3,000 lines of structures) was 22-31 ms of
            # `sparkwatch status`'s start-up on the 2-core VM. The same report as pynvml's (code 12, its class name).
            try:
                ctypes.CDLL(LIBRARY)  # where it loads, pynvml's own load right after finds it loaded
            except OSError:
                raise NvmlCallError(
                    "nvmlInit", NvmlReturn.ERROR_LIBRARY_NOT_FOUND, "NVMLError_LibraryNotFound"
                ) from None
            try:
                # Imported on first use: `sparkwatch events` and the guard never load it.
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlCallError("import pynvml", NvmlReturn.ERROR_LIBRARY_NOT_FOUND, str(exc)) from exc
        self._query("nvmlInit")
        self._initialized = True
        nvml = self._nvml
        self._driver_version = self._optional_text("nvmlSystemGetDriverVersion")
        self._nvml_version = self._optional_text("nvmlSystemGetNVMLVersion")
        count = int(self._query("nvmlDeviceGetCount"))
        identities = []
        for index in range(count):
            ident = _Identity(index, self._query("nvmlDeviceGetHandleByIndex", index))
            h = ident.handle
            ident.uuid = _text(self._static(ident, "uuid", "nvmlDeviceGetUUID", h) or "")
            ident.name = _text(self._static(ident, "name", "nvmlDeviceGetName", h) or "")
            pci = self._static(ident, "bus_id", "nvmlDeviceGetPciInfo", h)
            ident.bus_id = _text(pci.busId) if pci is not None else ""
            sm_max = self._static(ident, "sm_clock_max", "nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_SM)
            ident.sm_clock_max_hertz = None if sm_max is None else float(sm_max) * _MHZ
            mem_max = self._static(ident, "memory_clock_max", "nvmlDeviceGetMaxClockInfo", h, nvml.NVML_CLOCK_MEM)
            ident.memory_clock_max_hertz = None if mem_max is None else float(mem_max) * _MHZ
            limit_mw = self._static(ident, "power_limit", "nvmlDeviceGetEnforcedPowerLimit", h)
            ident.power_limit_watts = None if limit_mw is None else float(limit_mw) / 1000.0
            identities.append(ident)
        self._identities = identities
        self._mem_total_bytes = read_mem_total_bytes(self.proc_root)
        self._ready = True

    def _optional_text(self, name: str) -> str | None:
        try:
            return _text(self._query(name))
        except NvmlCallError as exc:
            if exc.code in _FATAL_CODES:
                raise
            return None

    def _static(self, ident: _Identity, field: str, name: str, *args: Any) -> Any:
        return self._field(ident.supported, ident.errors, field, name, *args)

    @staticmethod
    def _field_result(
        supported: dict[str, bool], errors: dict[str, int], field: str, exc: NvmlCallError | None
    ) -> None:
        if exc is None:
            supported[field] = True
        elif exc.code == NvmlReturn.ERROR_NOT_SUPPORTED:
            supported[field] = False
        else:
            errors[field] = exc.code if exc.code is not None else -1

    def _field(self, supported: dict[str, bool], errors: dict[str, int], field: str, name: str, *args: Any) -> Any:
        """One field: its value, or None when NOT_SUPPORTED or failed (recorded). Fatal codes and hangs propagate."""
        try:
            value = self._query(name, *args)
        except NvmlCallError as exc:
            if exc.code in _FATAL_CODES:
                raise
            self._field_result(supported, errors, field, exc)
            return None
        self._field_result(supported, errors, field, None)
        return value

    def _fields(
        self, supported: dict[str, bool], errors: dict[str, int], wanted: Sequence[tuple[str, str, tuple[Any, ...]]]
    ) -> list[Any]:
        """Several fields in one hand-off to the worker (`_Worker.run_batch`), each judged as `_field` judges one:
        its value, or None when NOT_SUPPORTED or failed (recorded). Fatal codes and hangs propagate."""
        nvml = self._nvml
        present = [(field, name, args, getattr(nvml, name, None)) for field, name, args in wanted]
        steps: list[Step] = [(name, fn, args) for _f, name, args, fn in present if fn is not None]
        try:
            done = iter(self._worker.run_batch(steps, self.timeout_s))
        except NvmlTimeout:
            self.call_timeouts_total += 1
            raise
        values: list[Any] = []
        for field, name, _args, fn in present:
            error: NvmlCallError | None
            if fn is None:  # an old nvidia-ml-py without this function: that field's error, like any other
                value, error = None, NvmlCallError(name, None, "not in this nvidia-ml-py")
            else:
                value, exc = next(done)
                error = None if exc is None else self._call_error(name, exc)
            if error is not None and error.code in _FATAL_CODES:
                raise error
            self._field_result(supported, errors, field, error)
            values.append(None if error is not None else value)
        return values

    def _drop(self) -> None:
        """Forget the initialisation so that the next cycle starts over."""
        was = self._initialized
        self._initialized = False
        self._ready = False
        self._identities = []
        if was and self._worker.stuck_call() is None:
            try:
                self._query("nvmlShutdown")
            except (NvmlCallError, NvmlTimeout):
                pass

    def close(self) -> None:
        """nvmlShutdown, and end the worker thread. A later collect() starts over."""
        with self._lock:
            self._drop()
            self._worker.stop()

    # --- one cycle -------------------------------------------------------------------------------------------------

    def _down(self, code: int | None, error: str) -> GpuReport:
        return GpuReport(
            up=False,
            nvml_return_code=code,
            error=error,
            driver_version=self._driver_version,
            nvml_version=self._nvml_version,
            call_timeouts_total=self.call_timeouts_total,
        )

    def collect(self) -> GpuReport:
        with self._lock:
            missing = self._no_library
            if missing is not None and self.clock() - missing[0] < NO_LIBRARY_RETRY_S:
                return missing[1]
            try:
                report = self._collect()
            except Exception as exc:  # never raise into the telemetry loop
                return self._down(None, f"internal error: {type(exc).__name__}: {exc}")
            library_missing = report.nvml_return_code == NvmlReturn.ERROR_LIBRARY_NOT_FOUND
            self._no_library = (self.clock(), report) if library_missing else None
            return report

    def _collect(self) -> GpuReport:
        stuck = self._worker.stuck_call()
        if stuck is not None:
            age_s = time.monotonic() - stuck.started
            return self._down(None, f"NVML call {stuck.name} stuck for {age_s:.1f} s; no new call until it returns")
        try:
            if not self._ready:
                self._drop()  # a half-done init (a call timed out in it) starts over
                self._init()
            devices = tuple(self._read_device(ident) for ident in self._identities)
        except NvmlCallError as exc:
            self._drop()
            return self._down(exc.code, str(exc))
        except NvmlTimeout as exc:
            # Keep a finished initialisation: the stuck call may yet return, and nvmlShutdown would queue behind it.
            return self._down(None, f"NVML call timed out: {exc}")
        failed = _all_reads_failed(devices)
        if failed is not None:
            # Every read of every GPU failed (GPU lost, driver wedged): NVML is not usable, whatever nvmlInit said.
            self._drop()
            return self._down(failed, f"every NVML read failed (NVML code {failed})")
        return GpuReport(
            up=True,
            nvml_return_code=NvmlReturn.SUCCESS,
            driver_version=self._driver_version,
            nvml_version=self._nvml_version,
            devices=devices,
            call_timeouts_total=self.call_timeouts_total,
        )

    def _read_device(self, ident: _Identity) -> GpuDevice:
        nvml = self._nvml
        h = ident.handle
        supported = dict(ident.supported)
        errors = dict(ident.errors)

        now = self.clock()
        energy_due = now - ident.energy_read_at >= ENERGY_EVERY_S - ENERGY_SLACK_S
        wanted: list[tuple[str, str, tuple[Any, ...]]] = [
            ("power", "nvmlDeviceGetPowerUsage", (h,)),
            ("utilization", "nvmlDeviceGetUtilizationRates", (h,)),
            ("temperature", "nvmlDeviceGetTemperature", (h, nvml.NVML_TEMPERATURE_GPU)),
            ("sm_clock", "nvmlDeviceGetClockInfo", (h, nvml.NVML_CLOCK_SM)),
            ("memory", "nvmlDeviceGetMemoryInfo", (h,)),
            ("processes", "nvmlDeviceGetComputeRunningProcesses", (h,)),
            ("graphics_processes", "nvmlDeviceGetGraphicsRunningProcesses", (h,)),
        ]
        if energy_due:
            wanted.append(("energy", "nvmlDeviceGetTotalEnergyConsumption", (h,)))
        values = self._fields(supported, errors, wanted)
        power_mw, util, temp, sm_mhz, mem, compute, graphics = values[:7]
        if energy_due:
            ident.energy_mj, ident.energy_read_at = values[7], now
            if "energy" in supported:
                ident.supported["energy"] = supported["energy"]
            else:  # failed with another code: neither supported nor not, as _field_result leaves it
                ident.supported.pop("energy", None)
            if "energy" in errors:
                ident.errors["energy"] = errors["energy"]
            else:
                ident.errors.pop("energy", None)
        else:  # between reads: the last reading and what it said about the field
            if "energy" in ident.supported:
                supported["energy"] = ident.supported["energy"]
            if "energy" in ident.errors:
                errors["energy"] = ident.errors["energy"]
        energy_mj = ident.energy_mj

        memory_total = None if mem is None else int(mem.total)
        unified = is_unified(memory_total, self._mem_total_bytes)
        # Unified: NVML's figure is the system pool (or zeros); /proc/meminfo owns it. Never export it as VRAM.
        memory_used = None if mem is None or unified else int(mem.used)

        used_by_pid: dict[int, int | None] = {}
        for proc in (compute or []) + (graphics or []):
            pid = int(proc.pid)
            used = proc.usedGpuMemory
            used_bytes = None if used is None else int(used)
            # A pid in both lists is one process; keep the larger figure (NVML reports the same allocation twice).
            prev = used_by_pid.get(pid)
            if pid not in used_by_pid or (used_bytes is not None and (prev is None or used_bytes > prev)):
                used_by_pid[pid] = used_bytes
        processes = tuple(GpuProcess(pid, used_by_pid[pid], ident.index) for pid in sorted(used_by_pid))

        return GpuDevice(
            index=ident.index,
            uuid=ident.uuid,
            name=ident.name,
            bus_id=ident.bus_id,
            unified=unified,
            power_watts=None if power_mw is None else float(power_mw) / 1000.0,
            power_limit_watts=ident.power_limit_watts,
            utilization_ratio=None if util is None else float(util.gpu) / 100.0,
            temperature_celsius=None if temp is None else float(temp),
            sm_clock_hertz=None if sm_mhz is None else float(sm_mhz) * _MHZ,
            sm_clock_max_hertz=ident.sm_clock_max_hertz,
            memory_clock_max_hertz=ident.memory_clock_max_hertz,
            energy_joules=None if energy_mj is None else float(energy_mj) / 1000.0,
            memory_total_bytes=None if unified else memory_total,
            memory_used_bytes=memory_used,
            processes=processes,
            supported=supported,
            field_errors=errors,
        )

    # --- fast samples of a few pids (telemetry/gpufast.py) ---------------------------------------------------------

    def process_bytes(self) -> dict[int, int] | None:
        """NVML's bytes per pid over every GPU (compute and graphics lists, the larger figure of a pid listed twice;
        summed over GPUs), two calls a GPU in one hand-off to the worker: None while NVML is not initialised by a
        cycle, or stuck. Never raises; a failed call is counted (`fast_errors_total`)."""
        with self._lock:
            if not self._ready or self._worker.stuck_call() is not None:
                return None
            nvml = self._nvml
            steps: list[Step] = []
            gpus: list[int] = []  # the GPU of each step
            for ident in self._identities:
                for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                    fn = getattr(nvml, name, None)
                    if fn is not None:
                        steps.append((name, fn, (ident.handle,)))
                        gpus.append(ident.index)
            try:
                results = self._worker.run_batch(steps, self.timeout_s)
            except NvmlTimeout:
                self.call_timeouts_total += 1
                self.fast_errors_total += 1
                return None
        per_gpu: dict[tuple[int, int], int] = {}  # (gpu, pid) -> bytes: a pid in both lists of one GPU counts once
        for gpu, (procs, exc) in zip(gpus, results, strict=False):
            if exc is not None:
                self.fast_errors_total += 1
                continue
            for proc in procs or []:
                used = proc.usedGpuMemory
                key = (gpu, int(proc.pid))
                per_gpu[key] = max(per_gpu.get(key, 0), 0 if used is None else int(used))
        out: dict[int, int] = {}
        for (_gpu, pid), used in per_gpu.items():
            out[pid] = out.get(pid, 0) + used
        return out


# --- the one-shot probe (drift check, doctor) ---------------------------------------------------------------------

_last_probe: dict[str, threading.Thread] = {}  # the last probe thread, to see whether it is still stuck


def probe_nvml(timeout_s: float = 5.0) -> NvmlFacts:
    """Ask NVML for its library and driver versions, on a worker thread bounded by `timeout_s`.

    A hung driver must not hang the caller: on timeout the thread is abandoned (daemon) and the answer says so.
    NVML's own error codes are kept (NvmlReturn): DRIVER_NOT_LOADED is a stranded driver, LIB_RM_VERSION_MISMATCH a
    library updated under a loaded module.
    """
    previous = _last_probe.get("thread")
    if previous is not None and previous.is_alive():
        # One thread stuck in the driver is enough: do not add another every minute.
        return NvmlFacts(error="an earlier NVML call is still hung in the driver")
    answer: queue.Queue[NvmlFacts] = queue.Queue(maxsize=1)

    def ask() -> None:
        answer.put(_ask_nvml())

    thread = daemon_thread(ask, "sparkwatch-nvml-probe")
    thread.start()
    _last_probe["thread"] = thread
    try:
        return answer.get(timeout=timeout_s)
    except queue.Empty:
        return NvmlFacts(error=f"NVML did not answer within {timeout_s:g} s (hung driver?)")


def _ask_nvml() -> NvmlFacts:
    try:
        import pynvml  # noqa: PLC0415 - only the live root pays for loading NVML
    except ImportError as exc:
        return NvmlFacts(error=f"pynvml not importable: {exc}")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        return NvmlFacts(error_code=code if isinstance(code, int) else None, error=str(exc))
    except Exception as exc:  # libnvidia-ml.so missing raises NVMLError_LibraryNotFound, others OSError
        return NvmlFacts(error=f"NVML unavailable: {exc}")
    try:
        library = _text(pynvml.nvmlSystemGetNVMLVersion())
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        return NvmlFacts(library_version=library, driver_version=driver)
    except pynvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        return NvmlFacts(error_code=code if isinstance(code, int) else None, error=str(exc))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
