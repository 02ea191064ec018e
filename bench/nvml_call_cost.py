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
    }
    for name, fn in calls.items():
        fn()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(CALLS):
            fn()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(f"{name:28s} cpu {cpu / CALLS * 1e6:8.1f} us  wall {wall / CALLS * 1e6:8.1f} us")
    n.nvmlShutdown()


if __name__ == "__main__":
    main()
