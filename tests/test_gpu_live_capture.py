"""What the whole daemon and doctor said on a real NVIDIA H200 (scripts/gpu-capture/live-check.sh on the device tool).

The capture is checked in; these tests hold it to the contract: promtool-clean, GPU up with real readings under load,
the driver judged ok on a machine whose /lib/modules is not visible (a container), and doctor's JSON shape.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import require_tool

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
METRICS = FIXTURES / "h200-daemon-metrics.prom"


def samples() -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(METRICS.read_text()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_live_exposition_passes_promtool() -> None:
    promtool = require_tool("promtool")
    out = subprocess.run([promtool, "check", "metrics"], input=METRICS.read_text(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_gpu_under_load_and_driver_ok() -> None:
    s = samples()
    assert s["sparkwatch_gpu_up"][0][1] == 1
    assert 100 < s["sparkwatch_gpu_power_watts"][0][1] < 700  # a real load on an H200 (700 W limit)
    assert s["sparkwatch_gpu_utilization_ratio"][0][1] > 0.5
    ((info_labels, _),) = s["sparkwatch_gpu_info"]
    assert info_labels["name"] == "NVIDIA H200" and info_labels["unified"] == "false"
    assert s["sparkwatch_driver_stranded"][0][1] == 0
    ((driver_labels, _),) = s["sparkwatch_driver_info"]
    assert driver_labels["verdict"] == "ok"
    assert driver_labels["loaded_version"] == driver_labels["library_version"] == info_labels["driver_version"]
    assert all(v == 1 for _, v in s["sparkwatch_collector_success"])
    # The daemon's pool series came from the same scrape: the contract names are all there.
    for name in (
        "sparkwatch_memory_available_bytes",
        "sparkwatch_memory_floor_bytes",
        "sparkwatch_guard_dry_run",
        "sparkwatch_build_info",
    ):
        assert name in s, name


def test_live_doctor_json_contract() -> None:
    report = json.loads((FIXTURES / "h200-doctor.json").read_text())
    assert report["ok"] is True
    by_id = {c["id"]: c for c in report["checks"]}
    assert by_id["driver-loaded"]["status"] == "ok"
    assert by_id["driver-version-match"]["status"] == "ok"
    assert by_id["driver-modules"]["status"] == "skip"  # /lib/modules not visible in that container
    for check in report["checks"]:
        assert set(check) <= {"id", "status", "summary", "fix", "detail"}
        assert check["status"] in {"ok", "warn", "fail", "skip"}
