"""gpu_families: golden exposition for a GB10 (fake NVML), the down case, and the exposition captured on a real
H200 under load (tests/fixtures/gpu/h200-*, made by scripts/gpu-capture/run.sh through the device tool).

Set SPARKWATCH_TEST_UPDATE_GOLDEN=1 to rewrite the gb10 goldens after an intended change, and review the diff.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from sparkwatch.core.model import GpuReport
from sparkwatch.telemetry.exporter.gpu import gpu_families
from sparkwatch.telemetry.sources.nvml import NvmlSource
from tests.conftest import require_tool
from tests.helpers.fake_nvml import Err, FakeNvml, gb10, h200_like

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
GB10_PROC = FIXTURES / "gb10-proc"
H200_EXPOSITION = FIXTURES / "h200-exposition.prom"
H200_ALL = FIXTURES / "h200-expositions-all.txt"
H200_CONTEXT = FIXTURES / "h200-context.txt"
IDENTITY_LABELS = {"name", "driver_version", "bus_id", "unified"}


class _Families:
    def __init__(self, report: GpuReport | None) -> None:
        self.report = report

    def collect(self) -> Iterable[Metric]:
        return gpu_families(self.report)


def render(report: GpuReport | None) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Families(report))
    return generate_latest(reg).decode()


def gb10_report(fake: FakeNvml | None = None) -> GpuReport:
    src = NvmlSource(nvml=fake or FakeNvml([gb10()]), proc_root=GB10_PROC)
    try:
        return src.collect()
    finally:
        src.close()


def promtool_check(text: str) -> None:
    promtool = require_tool("promtool")
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "" and proc.stderr.strip() == "", proc.stdout + proc.stderr  # no lint warnings


def check_golden(name: str, text: str) -> None:
    path = FIXTURES / name
    if os.environ.get("SPARKWATCH_TEST_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(text: str, name: str) -> tuple[dict[str, str], float]:
    found = samples(text).get(name, [])
    assert len(found) == 1, (name, found)
    return found[0]


# --- GB10 (fake NVML) ---------------------------------------------------------------------------------------------


def test_gb10_golden_exposition_passes_promtool() -> None:
    text = render(gb10_report())
    check_golden("gb10-exposition.prom", text)
    promtool_check(text)


def test_gb10_unsupported_fields_have_no_series() -> None:
    s = samples(render(gb10_report()))
    for absent in (
        "sparkwatch_gpu_memory_total_bytes",
        "sparkwatch_gpu_memory_used_bytes",
        "sparkwatch_gpu_power_limit_watts",
    ):
        assert absent not in s, absent
    supported = {lab["field"]: v for lab, v in s["sparkwatch_gpu_field_supported"]}
    assert supported["memory"] == 0 and supported["power_limit"] == 0 and supported["memory_clock_max"] == 0
    assert supported["power"] == 1 and supported["utilization"] == 1
    # 0 % utilization is a real reading and is exported as 0
    assert s["sparkwatch_gpu_utilization_ratio"][0][1] == 0.0
    (info_labels, _), *_ = s["sparkwatch_gpu_info"]
    assert info_labels["unified"] == "true" and info_labels["name"] == "NVIDIA GB10"
    # pid 5150's memory is not available: no series rather than 0
    assert [lab["pid"] for lab, _ in s["sparkwatch_gpu_process_memory_bytes"]] == ["4242"]


def test_identity_labels_only_on_gpu_info() -> None:
    for name, rows in samples(render(gb10_report())).items():
        for labels, _ in rows:
            if name == "sparkwatch_gpu_info":
                assert set(labels) >= IDENTITY_LABELS
            else:
                assert not (IDENTITY_LABELS & set(labels)), (name, labels)
                if labels:
                    assert {"gpu", "uuid"} <= set(labels), (name, labels)


def test_driver_not_loaded_golden_exposition() -> None:
    fake = FakeNvml([gb10()])
    fake.init_error = pynvml.NVML_ERROR_DRIVER_NOT_LOADED
    text = render(gb10_report(fake))
    check_golden("gb10-driver-not-loaded.prom", text)
    promtool_check(text)
    assert one(text, "sparkwatch_gpu_up")[1] == 0
    assert one(text, "sparkwatch_gpu_nvml_return_code")[1] == 9
    assert "sparkwatch_gpu_info" not in text and "sparkwatch_gpu_power_watts" not in text


def test_a_failing_field_is_absent_with_its_error_code() -> None:
    text = render(gb10_report(FakeNvml([gb10(temperature_c=Err(pynvml.NVML_ERROR_UNKNOWN))])))
    promtool_check(text)
    assert "sparkwatch_gpu_temperature_celsius" not in text
    labels, value = one(text, "sparkwatch_gpu_field_error_code")
    assert labels["field"] == "temperature" and value == 999
    assert one(text, "sparkwatch_gpu_power_watts")[1] == pytest.approx(11.64)


def test_no_report_no_series() -> None:
    assert list(gpu_families(None)) == []


# --- the real H200 run --------------------------------------------------------------------------------------------


def context_driver_version() -> str:
    m = re.search(r"NVRM version: .*?\s(\d+\.\d+\.\d+)\s", H200_CONTEXT.read_text())
    assert m is not None
    return m.group(1)


def test_h200_real_exposition_under_load() -> None:
    text = H200_EXPOSITION.read_text()
    promtool_check(text)
    s = samples(text)
    assert one(text, "sparkwatch_gpu_up")[1] == 1
    assert one(text, "sparkwatch_gpu_nvml_return_code")[1] == 0
    info, _ = one(text, "sparkwatch_gpu_info")
    assert info["name"] == "NVIDIA H200"
    assert info["unified"] == "false"  # 143771 MiB of VRAM in a 128 GiB host is not the system pool
    assert info["driver_version"] == context_driver_version() == "580.159.04"
    assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]", info["bus_id"]), info["bus_id"]
    assert re.fullmatch(r"GPU-[0-9a-f-]{36}", info["uuid"]), info["uuid"]
    power = one(text, "sparkwatch_gpu_power_watts")[1]
    limit = one(text, "sparkwatch_gpu_power_limit_watts")[1]
    assert 150 < power < limit == 700  # idle was 79 W; the FMA load drew ~369 W (nvidia-smi agreed)
    assert one(text, "sparkwatch_gpu_utilization_ratio")[1] > 0.5
    assert one(text, "sparkwatch_gpu_sm_clock_hertz")[1] == one(text, "sparkwatch_gpu_sm_clock_max_hertz")[1]
    assert one(text, "sparkwatch_gpu_energy_joules_total")[1] > 0
    # the load process (4 GiB cudaMalloc plus context) shows with its pid; VRAM is exported since it is not unified
    (proc_labels, proc_bytes), *_ = s["sparkwatch_gpu_process_memory_bytes"]
    assert int(proc_labels["pid"]) > 0 and proc_bytes > 4 * 2**30
    total = one(text, "sparkwatch_gpu_memory_total_bytes")[1]
    assert total == 143771 * 2**20
    assert proc_bytes < one(text, "sparkwatch_gpu_memory_used_bytes")[1] < total
    supported = {lab["field"]: v for lab, v in s["sparkwatch_gpu_field_supported"]}
    assert all(v == 1 for v in supported.values()), supported


def test_h200_real_run_idle_then_load_then_idle() -> None:
    chunks = [c for c in re.split(r"^### sample \d+ .*\n", H200_ALL.read_text(), flags=re.M) if c.strip()]
    assert len(chunks) >= 10
    utils = [one(c, "sparkwatch_gpu_utilization_ratio")[1] for c in chunks]
    powers = [one(c, "sparkwatch_gpu_power_watts")[1] for c in chunks]
    energy = [one(c, "sparkwatch_gpu_energy_joules_total")[1] for c in chunks]
    assert utils[0] == 0 and max(utils) == 1.0 and utils[-1] == 0
    loaded = [p for p, u in zip(powers, utils, strict=True) if u > 0.5]
    assert min(loaded) > 2 * powers[0]  # ~369 W under load against 79 W idle
    assert energy == sorted(energy) and energy[-1] > energy[0]  # a counter
    for chunk in chunks:
        promtool_check(chunk)


def test_the_fake_non_unified_path_exports_the_same_families_as_the_real_h200() -> None:
    fake_text = render(gb10_report(FakeNvml([h200_like()], driver_version="580.159.04")))
    real_names = {fam.name for fam in text_string_to_metric_families(H200_EXPOSITION.read_text())}
    fake_names = {fam.name for fam in text_string_to_metric_families(fake_text)}
    assert fake_names == real_names
