"""What NVML costs a process in memory, stage by stage, and how much of it malloc_trim gives back.

    python3 bench/nvml_rss.py      # on a GPU host (nvidia-ml-py); results in bench/RESULTS-idle.md

On the H100/H200 hosts the telemetry process is about 30 MiB larger than on a box without NVML (bench/RESULTS-idle.md:
61.8 against 29.2 MiB): [heap] 30.8 against 17.6 MiB, [anon] 13.9 against 2.8, libcuda's and libnvidia-ml's mappings.
This prints VmRSS, RssAnon and RssFile after each stage (import pynvml, nvmlInit, one read of each field the cycle
makes, the same reads from another thread, as telemetry's NVML thread makes them) and after malloc_trim(0) (which
telemetry's loop calls after its first cycle, then once a minute), with the largest mappings after nvmlInit and
after the trim.
"""

from __future__ import annotations

import ctypes
import threading

import pynvml as n

KIB_FIELDS = ("VmRSS", "RssAnon", "RssFile")


def rss() -> str:
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in KIB_FIELDS:
                out[key] = int(value.split()[0]) / 1024
    return "  ".join(f"{k} {v:6.1f} MiB" for k, v in out.items())


def largest_mappings(count: int = 8) -> str:
    out: dict[str, float] = {}
    name = "?"
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                name = head[5].rsplit("/", 1)[-1] if len(head) > 5 else "[anon]"
            elif head and head[0] == "Rss:":
                out[name] = out.get(name, 0.0) + int(head[1]) / 1024
    top = sorted(out.items(), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{k} {v:.1f}" for k, v in top)


def reads(h: object) -> None:  # the fields telemetry's cycle reads (telemetry/sources/nvml.py)
    n.nvmlDeviceGetPowerUsage(h)
    n.nvmlDeviceGetUtilizationRates(h)
    n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)
    n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)
    n.nvmlDeviceGetMemoryInfo(h)
    n.nvmlDeviceGetComputeRunningProcesses(h)
    n.nvmlDeviceGetGraphicsRunningProcesses(h)
    n.nvmlDeviceGetTotalEnergyConsumption(h)


def read_many(h: object, times: int) -> None:
    for _ in range(times):
        reads(h)


def main() -> None:
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    print(f"{'import pynvml':28s} {rss()}")
    n.nvmlInit()
    print(f"{'nvmlInit':28s} {rss()}\n    {largest_mappings()}")
    h = n.nvmlDeviceGetHandleByIndex(0)
    reads(h)
    print(f"{'one read of each field':28s} {rss()}")
    worker = threading.Thread(target=read_many, args=(h, 20))
    worker.start()
    worker.join()
    print(f"{'20 reads on another thread':28s} {rss()}")
    trim(0)
    print(f"{'malloc_trim(0)':28s} {rss()}\n    {largest_mappings()}")
    n.nvmlShutdown()


if __name__ == "__main__":
    main()
