"""Golden exposition: the real Telemetry and collector on a fixture /proc and fixture caches, byte for byte.

Regenerate after an intended change with SPARKWATCH_TEST_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from sparkwatch.telemetry.exporter.contract import BY_NAME, METRICS
from sparkwatch.telemetry.exporter.groupmetric import GroupCollector
from sparkwatch.telemetry.exporter.internal import InternalCollector
from sparkwatch.telemetry.exporter.peermetric import PeerCollector
from sparkwatch.telemetry.exporter.server import build_registry, render
from sparkwatch.telemetry.loop import Telemetry
from tests.conftest import require_tool
from tests.helpers.proctree import FIXED_MTIME
from tests.helpers.scenario import (
    StaticEvents,
    StaticGpu,
    StaticGuard,
    StaticKernelLog,
    build_scenario,
    group_view,
    guard_stats,
    kernel_log_stats,
    peer_view,
    shm_leftovers,
    stranded_driver,
    zero_durations,
)

MiB = 1 << 20
GOLDEN = Path(__file__).parent / "golden" / "telemetry.prom"


def scenario_exposition(tmp_path: Path) -> bytes:
    settings = build_scenario(tmp_path)
    telemetry = Telemetry(
        settings,
        gpu_source=StaticGpu(),
        wall_clock=lambda: FIXED_MTIME + 100.0,
        driver=stranded_driver,
        shm=shm_leftovers,
    )
    telemetry.page_size_bytes = 4096  # the H200's (and DGX OS's default arm64 kernel's); not this machine's
    snap = zero_durations(telemetry.collect())
    registry = build_registry(
        settings,
        lambda: snap,
        StaticGuard(guard_stats()),
        StaticEvents(),
        kernel_log=StaticKernelLog(kernel_log_stats()),
    )
    registry.register(
        InternalCollector(
            lambda: {
                "guard": {"sd_notify": {"notify_send_errors": 1}, "telemetry": {"telemetry_restarts": 2}},
                "telemetry": {"driver": {"errors": 3}, "outbox": {"alerts_suppressed": 4}},
            },
            lambda: {"guard": 23 << 20, "telemetry": 46 << 20},
            lambda: True,
            lambda: 2,
        )
    )
    registry.register(GroupCollector(group_view))
    registry.register(PeerCollector(peer_view, lambda: 0.0))
    return render(registry)


def test_golden_exposition(tmp_path: Path) -> None:
    text = scenario_exposition(tmp_path)
    if os.environ.get("SPARKWATCH_TEST_UPDATE_GOLDEN") == "1":
        GOLDEN.write_bytes(text)
    assert text.decode() == GOLDEN.read_text()


def test_golden_passes_promtool(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    out = subprocess.run([promtool, "check", "metrics"], input=GOLDEN.read_bytes(), capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()


def test_golden_names_follow_the_contract() -> None:
    """Every family in the golden file is in the one list (telemetry/exporter/contract.py) with its type and labels,
    and every family the list promises for this scenario (no outbox, no discrete GPU; a group over Ray) is there."""
    families = {f.name: f for f in text_string_to_metric_families(GOLDEN.read_text())}
    for family in families.values():
        name = family.name + "_total" if family.type == "counter" else family.name
        spec = BY_NAME.get(name)
        assert spec is not None and spec.type == family.type, name
        assert family.samples, name
        for s in family.samples:
            assert set(s.labels) - {"le"} == set(spec.labels), (name, s.labels)
    promised = {"always", "meminfo", "guard", "kill", "events", "telemetry", "psi", "gpu", "driver", "ray", "ray_group",
                "shm"}  # fmt: skip
    listed = {
        m.name.removesuffix("_total") if m.type == "counter" else m.name for m in METRICS if m.present in promised
    }
    assert not listed - set(families), sorted(listed - set(families))


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def test_golden_values_mean_the_scenario() -> None:
    """The numbers the golden file holds are the scenario's, checked one by one rather than trusted."""
    text = GOLDEN.read_text()
    assert sample(text, "sparkwatch_memory_available_bytes") == 118566368 * 1024
    assert sample(text, "sparkwatch_memory_used_bytes") == (127600748 - 118566368) * 1024
    assert sample(text, "sparkwatch_memory_pressure_stalled_seconds_total", kind="some") == 12.345678
    assert sample(text, "sparkwatch_compile_processes", tool="nvcc") == 3
    assert sample(text, "sparkwatch_compile_processes", tool="cicc") == 2
    assert sample(text, "sparkwatch_compile_processes", tool="ninja") == 2
    assert sample(text, "sparkwatch_compile_processes", tool="gcc") == 1  # gcc-13, outside any engine
    assert sample(text, "sparkwatch_compile_parallel_jobs") == 5
    assert sample(text, "sparkwatch_shm_orphaned_bytes") == 640 * MiB + 4096  # the scenario's psm_ and sem.mp- files
    assert sample(text, "sparkwatch_shm_orphaned_files") == 2
    assert sample(text, "sparkwatch_compile_arch_processes", arch="121a") == 5
    assert sample(text, "sparkwatch_compile_arch_processes", arch="90a") == 1
    assert sample(text, "sparkwatch_compile_outside_engine_processes") == 1
    assert sample(text, "sparkwatch_compile_max_jobs", engine="vllm", pid="1000", state="unset") == 1
    assert sample(text, "sparkwatch_compile_max_jobs", engine="ray", pid="4001", state="set") == 1  # the raylet's
    assert sample(text, "sparkwatch_compile_max_jobs", engine="llama.cpp", pid="2000", state="unknown") == 1
    assert sample(text, "sparkwatch_jit_build_objects", version="0.4.1", arch="121a", state="done") == 2
    assert sample(text, "sparkwatch_jit_build_objects", version="0.4.1", arch="121a", state="total") == 4
    assert sample(text, "sparkwatch_jit_cache_files", cache="vllm") == 1
    assert sample(text, "sparkwatch_jit_cache_last_change_timestamp_seconds", version="0.4.1") == FIXED_MTIME
    assert sample(text, "sparkwatch_jit_state", engine="vllm", pid="1000", state="compiling") == 1
    assert sample(text, "sparkwatch_jit_state", engine="llama.cpp", pid="2000", state="idle") == 1
    assert sample(text, "sparkwatch_guard_kill_duration_seconds_bucket", le="0.15") == 1
    assert sample(text, "sparkwatch_guard_kill_duration_seconds_bucket", le="0.1") == 0
    assert sample(text, "sparkwatch_event_log_write_errors_total") == 2
    gib = 1 << 30
    assert sample(text, "sparkwatch_engine_gpu_memory_bytes", engine="vllm") == 70 * gib
    assert sample(text, "sparkwatch_engine_gpu_memory_bytes", engine="ray") == 2 * gib
    assert sample(text, "sparkwatch_engine_gpu_memory_bytes", engine="other") == 512 << 20  # the unknown share: out
    assert sample(text, "sparkwatch_gpu_power_watts", gpu="0") == 12.5
    assert "sparkwatch_gpu_memory_total_bytes" not in text  # unified: absent, never 0
    assert sample(text, "sparkwatch_driver_stranded") == 1
    assert sample(text, "sparkwatch_driver_info", kernel="6.11.0-1016-nvidia", verdict="stranded") == 1
    # The H200's buddyinfo: orders 9 and 10 of three zones (8+0+1 of 2 MiB, 37+753+3 of 4 MiB)
    assert sample(text, "sparkwatch_memory_free_contiguous_bytes", min_block="2MiB") == (9 * 2 + 793 * 4) * MiB
    assert sample(text, "sparkwatch_memory_free_contiguous_bytes", min_block="64KiB") > (9 * 2 + 793 * 4) * MiB
    assert sample(text, "sparkwatch_kernel_nvrm_errors_total", kind="no_memory") == 2
    assert sample(text, "sparkwatch_kernel_nvrm_errors_total", kind="insufficient_resources") == 0
    assert sample(text, "sparkwatch_kernel_xid_total", code="79") == 1
    assert sample(text, "sparkwatch_kernel_xid_total", code="999") == 2  # uncatalogued codes are counted too
    assert sample(text, "sparkwatch_kernel_xid_total", code="48") == 0  # catalogued codes exist from the start
    assert sample(text, "sparkwatch_kernel_log_dropped_lines_total") == 5
    assert sample(text, "sparkwatch_guard_kills_total", trigger="driver_alloc_failed") == 0
