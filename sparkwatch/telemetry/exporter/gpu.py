"""GPU metric families from a GpuReport (the gpu_* names are a contract: sparkwatch/telemetry/exporter/contract.py).

Identity (name, uuid, bus id, driver version, unified) is only on `sparkwatch_gpu_info`, as node_exporter and
dcgm-exporter do; every other per-GPU series carries `gpu` (the NVML index) and `uuid`, so a dashboard joins on
either. A field the GPU does not support has no series at all: a GB10 answering NOT_SUPPORTED for memory must not
read as 0 bytes. `sparkwatch_gpu_field_supported{field}` says which is which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from sparkwatch.core.model import GpuDevice, GpuReport
from sparkwatch.telemetry.exporter.families import counter, gauge

_DEVICE_LABELS = ("gpu", "uuid")

# A per-GPU family: its rows for one device, each (extra label values, value); None values are left out.
Rows = Callable[[GpuDevice], Iterable[tuple[tuple[str, ...], float | int | None]]]


def _one(get: Callable[[GpuDevice], float | int | None]) -> Rows:
    return lambda d: (((), get(d)),)


# (name without the prefix, kind, extra labels, rows) for every per-GPU family, in exposition order.
_PER_DEVICE: tuple[tuple[str, Callable[..., GaugeMetricFamily | CounterMetricFamily], tuple[str, ...], Rows], ...] = (
    ("gpu_power_watts", gauge, (), _one(lambda d: d.power_watts)),
    ("gpu_power_limit_watts", gauge, (), _one(lambda d: d.power_limit_watts)),
    ("gpu_utilization_ratio", gauge, (), _one(lambda d: d.utilization_ratio)),
    ("gpu_temperature_celsius", gauge, (), _one(lambda d: d.temperature_celsius)),
    ("gpu_sm_clock_hertz", gauge, (), _one(lambda d: d.sm_clock_hertz)),
    ("gpu_sm_clock_max_hertz", gauge, (), _one(lambda d: d.sm_clock_max_hertz)),
    ("gpu_memory_total_bytes", gauge, (), _one(lambda d: d.memory_total_bytes)),
    ("gpu_memory_used_bytes", gauge, (), _one(lambda d: d.memory_used_bytes)),
    ("gpu_energy_joules", counter, (), _one(lambda d: d.energy_joules)),
    (
        "gpu_process_memory_bytes",
        gauge,
        ("pid",),
        lambda d: (((str(p.pid),), p.used_gpu_memory_bytes) for p in d.processes),
    ),
    ("gpu_field_supported", gauge, ("field",), lambda d: (((f,), int(ok)) for f, ok in sorted(d.supported.items()))),
    ("gpu_field_error_code", gauge, ("field",), lambda d: (((f,), code) for f, code in sorted(d.field_errors.items()))),
)


def _per_device(devices: Iterable[GpuDevice]) -> Iterator[Metric]:
    """Each per-GPU family that has at least one sample (families without one are left out, not sent empty)."""
    for name, kind, extra, rows in _PER_DEVICE:
        fam = kind(name, labels=[*_DEVICE_LABELS, *extra])
        for dev in devices:
            for values, value in rows(dev):
                if value is not None:
                    fam.add_metric([str(dev.index), dev.uuid, *values], value)
        if fam.samples:
            yield fam


def gpu_families(report: GpuReport | None) -> Iterator[Metric]:
    """The GPU series for one scrape. None (the source is off or has not run) gives no series."""
    if report is None:
        return
    yield gauge("gpu_up", value=int(report.up))
    if report.nvml_return_code is not None:
        yield gauge("gpu_nvml_return_code", value=report.nvml_return_code)
    yield counter("gpu_nvml_call_timeouts", value=report.call_timeouts_total)
    if not report.devices:
        return
    info = gauge("gpu_info", labels=["gpu", "uuid", "name", "driver_version", "bus_id", "unified"])
    for dev in report.devices:
        labels = [str(dev.index), dev.uuid, dev.name, report.driver_version or "", dev.bus_id, str(dev.unified).lower()]
        info.add_metric(labels, 1)
    yield info
    yield from _per_device(report.devices)
