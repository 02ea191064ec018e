"""Each NVML call the telemetry cycle makes, timed on GPU 0: CPU time per call (process time), 200 calls each.

python3 bench/nvml_call_cost.py      # on a GPU host (nvidia-ml-py); results in bench/RESULTS-idle.md
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pynvml as n

CALLS = 200


def main() -> None:
    n.nvmlInit()
    h = n.nvmlDeviceGetHandleByIndex(0)
    calls: dict[str, Callable[[], object]] = {
        "PowerUsage": lambda: n.nvmlDeviceGetPowerUsage(h),
        "UtilizationRates": lambda: n.nvmlDeviceGetUtilizationRates(h),
        "Temperature": lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
        "ClockInfo": lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM),
        "MemoryInfo": lambda: n.nvmlDeviceGetMemoryInfo(h),
        "ComputeRunningProcesses": lambda: n.nvmlDeviceGetComputeRunningProcesses(h),
        "GraphicsRunningProcesses": lambda: n.nvmlDeviceGetGraphicsRunningProcesses(h),
        "TotalEnergyConsumption": lambda: n.nvmlDeviceGetTotalEnergyConsumption(h),
        # the same counter through the field-values API, and the power draw as a field
        "FieldValues(TOTAL_ENERGY)": lambda: n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION]),
        "FieldValues(ENERGY)": lambda: n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_ENERGY]),
    }
    for name, fn in calls.items():
        try:
            print(f"{name:28s} = {fn()!r:.120}")
        except n.NVMLError as exc:
            print(f"{name:28s} fails: {exc}")
            continue
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(CALLS):
            fn()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(f"{name:28s} cpu {cpu / CALLS * 1e6:8.1f} us  wall {wall / CALLS * 1e6:8.1f} us")
    n.nvmlShutdown()


if __name__ == "__main__":
    main()
