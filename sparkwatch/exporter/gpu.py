"""GPU metric families from a GpuReport (the gpu_* names are a contract: sparkwatch/exporter/contract.py).

Identity (name, uuid, bus id, driver version, unified) is only on `sparkwatch_gpu_info`, as node_exporter and
dcgm-exporter do; every other per-GPU series carries `gpu` (the NVML index) and `uuid`, so a dashboard joins on
either. A field the GPU does not support has no series at all: a GB10 answering NOT_SUPPORTED for memory must not
read as 0 bytes. `sparkwatch_gpu_field_supported{field}` says which is which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sparkwatch.core.nvmlcodes import meanings_text
from sparkwatch.model import GpuDevice, GpuReport

_DEVICE_LABELS = ["gpu", "uuid"]

# (metric name, help, GpuDevice attribute) for the plain per-GPU gauges, in exposition order.
_GAUGES: tuple[tuple[str, str, Callable[[GpuDevice], float | int | None]], ...] = (
    ("sparkwatch_gpu_power_watts", "Power draw of the GPU (NVML power usage).", lambda d: d.power_watts),
    (
        "sparkwatch_gpu_power_limit_watts",
        "Enforced power limit of the GPU; absent where NVML has none (GB10).",
        lambda d: d.power_limit_watts,
    ),
    (
        "sparkwatch_gpu_utilization_ratio",
        "Fraction of the last sample period in which a kernel ran on the GPU (0 to 1).",
        lambda d: d.utilization_ratio,
    ),
    ("sparkwatch_gpu_temperature_celsius", "GPU core temperature.", lambda d: d.temperature_celsius),
    ("sparkwatch_gpu_sm_clock_hertz", "Current SM clock.", lambda d: d.sm_clock_hertz),
    ("sparkwatch_gpu_sm_clock_max_hertz", "Maximum SM clock.", lambda d: d.sm_clock_max_hertz),
    (
        "sparkwatch_gpu_memory_total_bytes",
        "Dedicated GPU memory (VRAM); absent on unified memory, where the pool is the sparkwatch_memory_* series.",
        lambda d: d.memory_total_bytes,
    ),
    (
        "sparkwatch_gpu_memory_used_bytes",
        "Dedicated GPU memory in use; absent on unified memory.",
        lambda d: d.memory_used_bytes,
    ),
)


def _labels(dev: GpuDevice) -> list[str]:
    return [str(dev.index), dev.uuid]


def gpu_families(report: GpuReport | None) -> Iterator[Metric]:
    """The GPU series for one scrape. None (the source is off or has not run) gives no series.

    Families without a sample are left out rather than sent empty.
    """
    if report is None:
        return
    yield GaugeMetricFamily("sparkwatch_gpu_up", "1 if NVML answered this cycle, 0 if not.", value=int(report.up))
    if report.nvml_return_code is not None:
        yield GaugeMetricFamily(
            "sparkwatch_gpu_nvml_return_code",
            f"NVML return code of the last cycle: {meanings_text()}.",
            value=report.nvml_return_code,
        )
    yield CounterMetricFamily(
        "sparkwatch_gpu_nvml_call_timeouts",
        "NVML calls that did not return within the timeout (a hung driver).",
        value=report.call_timeouts_total,
    )
    devices = report.devices
    if not devices:
        return

    info = GaugeMetricFamily(
        "sparkwatch_gpu_info",
        "GPU identity; always 1. unified=true: the GPU shares the system memory pool.",
        labels=["gpu", "uuid", "name", "driver_version", "bus_id", "unified"],
    )
    for dev in devices:
        info.add_metric(
            [str(dev.index), dev.uuid, dev.name, report.driver_version or "", dev.bus_id, str(dev.unified).lower()],
            1,
        )
    yield info

    for name, help_text, get in _GAUGES:
        fam = GaugeMetricFamily(name, help_text, labels=_DEVICE_LABELS)
        for dev in devices:
            value = get(dev)
            if value is not None:
                fam.add_metric(_labels(dev), value)
        if fam.samples:
            yield fam

    energy = CounterMetricFamily(
        "sparkwatch_gpu_energy_joules",
        "Energy the GPU used since the driver loaded.",
        labels=_DEVICE_LABELS,
    )
    for dev in devices:
        if dev.energy_joules is not None:
            energy.add_metric(_labels(dev), dev.energy_joules)
    if energy.samples:
        yield energy

    procs = GaugeMetricFamily(
        "sparkwatch_gpu_process_memory_bytes",
        "GPU memory used by a process (NVML compute and graphics lists); on unified memory a share of the pool "
        "that RSS and cgroups do not see.",
        labels=[*_DEVICE_LABELS, "pid"],
    )
    for dev in devices:
        for proc in dev.processes:
            if proc.used_gpu_memory_bytes is not None:
                procs.add_metric([*_labels(dev), str(proc.pid)], proc.used_gpu_memory_bytes)
    if procs.samples:
        yield procs

    supported = GaugeMetricFamily(
        "sparkwatch_gpu_field_supported",
        "1 if NVML answers this field on this GPU, 0 if it says NOT_SUPPORTED (the field's series is then absent).",
        labels=[*_DEVICE_LABELS, "field"],
    )
    for dev in devices:
        for field, ok in sorted(dev.supported.items()):
            supported.add_metric([*_labels(dev), field], int(ok))
    if supported.samples:
        yield supported

    errors = GaugeMetricFamily(
        "sparkwatch_gpu_field_error_code",
        "NVML return code of a field that failed this cycle for another reason than NOT_SUPPORTED.",
        labels=[*_DEVICE_LABELS, "field"],
    )
    for dev in devices:
        for field, code in sorted(dev.field_errors.items()):
            errors.add_metric([*_labels(dev), field], code)
    if errors.samples:
        yield errors
