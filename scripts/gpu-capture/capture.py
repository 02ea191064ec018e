"""Runs sparkwatch's GPU collector on a real NVIDIA machine, idle and under load, and writes what it saw.

Used with the device tool (docs/gpu.md): `python3 capture.py OUT_DIR LOAD_PID_FILE`. It samples NvmlSource every
`--interval` seconds and writes each exposition of gpu_families, the GpuReport and the cost of each collect().
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from sparkwatch.core.model import GpuReport
from sparkwatch.telemetry.exporter.gpu import gpu_families
from sparkwatch.telemetry.sources.nvml import NvmlSource


class _One:
    def __init__(self, report: GpuReport) -> None:
        self.report = report

    def collect(self):  # type: ignore[no-untyped-def]
        return gpu_families(self.report)


def exposition(report: GpuReport) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_One(report))
    return generate_latest(reg).decode()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--interval", type=float, default=2.5)
    args = ap.parse_args()
    src = NvmlSource(timeout_s=0.5)
    best: tuple[float, str] | None = None
    with (args.out / "expositions-all.txt").open("w") as allf, (args.out / "reports.txt").open("w") as repf:
        for i in range(args.samples):
            t0 = time.perf_counter()
            report = src.collect()
            dt_ms = (time.perf_counter() - t0) * 1000
            text = exposition(report)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            allf.write(f"### sample {i} at {stamp}, collect() took {dt_ms:.2f} ms\n{text}\n")
            repf.write(f"sample {i} {stamp} collect_ms={dt_ms:.2f} {report!r}\n")
            util = max((d.utilization_ratio or 0.0) for d in report.devices) if report.devices else -1.0
            print(f"sample {i}: up={report.up} util={util:.2f} collect={dt_ms:.2f} ms", flush=True)
            if best is None or util > best[0]:
                best = (util, text)
            time.sleep(args.interval)
    if best is not None:
        (args.out / "h200-exposition.prom").write_text(best[1])
    src.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
