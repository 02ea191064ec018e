"""A pynvml-shaped object for GPUs that cannot exist here (a GB10, a stranded driver, a hung driver).

It is built from the real nvidia-ml-py module: the constants, the NVMLError classes (NVMLError(9) is
NVMLError_DriverNotLoaded) and the ctypes structs the real calls return (c_nvmlMemory_t, c_nvmlUtilization_t,
nvmlPciInfo_t, c_nvmlProcessInfo_v3_t through nvmlStructToFriendlyObject). Only the answers are made up; pynvml's
library is never loaded by it. Each call is counted, can be made to raise any NVML code, or to hang until released.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pynvml

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED


@dataclass
class Err:
    """A field whose call returns this NVML code instead of a value."""

    code: int


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus_id: str
    power_mw: int | Err
    utilization_pct: int | Err
    temperature_c: int | Err
    sm_clock_mhz: int | Err
    sm_clock_max_mhz: int | Err
    mem_clock_max_mhz: int | Err
    power_limit_mw: int | Err
    energy_mj: int | Err
    # (total, free, used) in bytes, or an error code
    memory: tuple[int, int, int] | Err
    compute_procs: list[tuple[int, int | None]] = field(default_factory=list)
    graphics_procs: list[tuple[int, int | None]] = field(default_factory=list)


def gb10(**changes: Any) -> FakeGpu:
    """A DGX Spark's GB10 at idle, as NVML answers on a real one (public GB10 reports).

    Real: the name, the bus id, memory info NOT_SUPPORTED (with zeros), no memory clock, power limit N/A,
    11–16 W idle in P0, 41 °C, 0 %, 3003 MHz max SM clock, a VLLM::Worker holding 87 GB. Made up: the uuid, the
    current SM clock, the energy counter and the pids.
    """
    values: dict[str, Any] = {
        "name": "NVIDIA GB10",
        "uuid": "GPU-5d1c2a9e-7b3f-4e61-9a0c-2f8e4b6d1a37",
        "bus_id": "0000000F:01:00.0",
        "power_mw": 11640,
        "utilization_pct": 0,
        "temperature_c": 41,
        "sm_clock_mhz": 2418,
        "sm_clock_max_mhz": 3003,
        "mem_clock_max_mhz": Err(NOT_SUPPORTED),
        "power_limit_mw": Err(NOT_SUPPORTED),
        "energy_mj": 48_213_577,
        "memory": Err(NOT_SUPPORTED),
        # the same engine appears in both lists on some drivers: one process, counted once
        "compute_procs": [(4242, 87_000_000_000), (5150, None)],
        "graphics_procs": [(4242, 87_000_000_000)],
    }
    values.update(changes)
    return FakeGpu(**values)


def h200_like() -> FakeGpu:
    """Figures read from the real H200 run (tests/fixtures/gpu/h200-context.txt): the non-unified path."""
    return FakeGpu(
        name="NVIDIA H200",
        uuid="GPU-c0361d91-62ef-7b33-6844-27efb2cdff96",
        bus_id="00000000:00:06.0",
        power_mw=368_541,
        utilization_pct=100,
        temperature_c=48,
        sm_clock_mhz=1980,
        sm_clock_max_mhz=1980,
        mem_clock_max_mhz=3201,
        power_limit_mw=700_000,
        energy_mj=13_199_376,
        memory=(150_754_820_096, 145_262_510_080, 5_492_310_016),
        compute_procs=[(572, 4_838_129_664)],
    )


class FakeNvml:
    """Stands in for the pynvml module inside NvmlSource(nvml=...)."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        driver_version: str = "580.95.05",
        nvml_version: str = "13.580.95.05",
    ) -> None:
        for name in dir(pynvml):
            if name.startswith(("NVML_", "NVMLError")):
                setattr(self, name, getattr(pynvml, name))
        self.gpus = gpus
        self.driver_version = driver_version
        self.nvml_version = nvml_version
        self.calls: Counter[str] = Counter()
        self.init_error: int | None = None  # nvmlInit returns this code (driver not loaded, mismatch, ...)
        self.fail_all: int | None = None  # every call returns this code
        self.fail: dict[str, int] = {}  # this call returns this code
        self.hang: dict[str, threading.Event] = {}  # this call blocks until the event is set
        self.initialized = 0

    def _enter(self, name: str) -> None:
        self.calls[name] += 1
        ev = self.hang.get(name)
        if ev is not None:
            ev.wait()
        if self.fail_all is not None:
            raise pynvml.NVMLError(self.fail_all)
        if name in self.fail:
            raise pynvml.NVMLError(self.fail[name])
        if name != "nvmlInit" and self.initialized <= 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    @staticmethod
    def _value(v: Any) -> Any:
        if isinstance(v, Err):
            raise pynvml.NVMLError(v.code)
        return v

    def _gpu(self, handle: Any) -> FakeGpu:
        return self.gpus[int(handle)]

    # --- system ---
    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetNVMLVersion(self) -> str:
        self._enter("nvmlSystemGetNVMLVersion")
        return self.nvml_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return index

    # --- identity ---
    def nvmlDeviceGetUUID(self, h: Any) -> str:
        self._enter("nvmlDeviceGetUUID")
        return self._gpu(h).uuid

    def nvmlDeviceGetName(self, h: Any) -> str:
        self._enter("nvmlDeviceGetName")
        return self._gpu(h).name

    def nvmlDeviceGetPciInfo(self, h: Any) -> Any:
        self._enter("nvmlDeviceGetPciInfo")
        info = pynvml.nvmlPciInfo_t()
        info.busId = self._gpu(h).bus_id.encode()  # a c_char array: bytes, as from the real library
        return info

    def nvmlDeviceGetMaxClockInfo(self, h: Any, clock: int) -> int:
        self._enter("nvmlDeviceGetMaxClockInfo")
        g = self._gpu(h)
        return int(self._value(g.sm_clock_max_mhz if clock == pynvml.NVML_CLOCK_SM else g.mem_clock_max_mhz))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int:
        self._enter("nvmlDeviceGetEnforcedPowerLimit")
        return int(self._value(self._gpu(h).power_limit_mw))

    # --- per cycle ---
    def nvmlDeviceGetPowerUsage(self, h: Any) -> int:
        self._enter("nvmlDeviceGetPowerUsage")
        return int(self._value(self._gpu(h).power_mw))

    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any:
        self._enter("nvmlDeviceGetUtilizationRates")
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = int(self._value(self._gpu(h).utilization_pct))
        util.memory = 0
        return util

    def nvmlDeviceGetTemperature(self, h: Any, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature")
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return int(self._value(self._gpu(h).temperature_c))

    def nvmlDeviceGetClockInfo(self, h: Any, clock: int) -> int:
        self._enter("nvmlDeviceGetClockInfo")
        assert clock == pynvml.NVML_CLOCK_SM
        return int(self._value(self._gpu(h).sm_clock_mhz))

    def nvmlDeviceGetTotalEnergyConsumption(self, h: Any) -> int:
        self._enter("nvmlDeviceGetTotalEnergyConsumption")
        return int(self._value(self._gpu(h).energy_mj))

    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo")
        total, free, used = self._value(self._gpu(h).memory)
        mem = pynvml.c_nvmlMemory_t()
        mem.total, mem.free, mem.used = total, free, used
        return mem

    @staticmethod
    def _procs(entries: list[tuple[int, int | None]]) -> list[Any]:
        out = []
        for pid, used in entries:
            raw = pynvml.c_nvmlProcessInfo_v3_t()
            raw.pid = pid
            raw.usedGpuMemory = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value if used is None else used
            obj = pynvml.nvmlStructToFriendlyObject(raw)
            # what the real nvmlDeviceGetComputeRunningProcesses_v3 does with NVML_VALUE_NOT_AVAILABLE
            if obj.usedGpuMemory == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
                obj.usedGpuMemory = None
            out.append(obj)
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return self._procs(self._gpu(h).compute_procs)

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: Any) -> list[Any]:
        self._enter("nvmlDeviceGetGraphicsRunningProcesses")
        return self._procs(self._gpu(h).graphics_procs)
