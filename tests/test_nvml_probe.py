"""The live NVML probe: against a real driver where this machine has one, and bounded where it has none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkwatch.core.driver.drift import judge
from sparkwatch.core.model import NvmlFacts
from sparkwatch.telemetry.sources.driverfacts import read_driver_facts
from sparkwatch.telemetry.sources.nvml import probe_nvml


def test_probe_without_a_driver_answers_quickly() -> None:
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this machine has an NVIDIA driver (see test_probe_on_a_real_driver)")
    started = time.monotonic()
    facts = probe_nvml(timeout_s=5.0)
    assert time.monotonic() - started < 5.5
    assert facts.error is not None and facts.library_version is None


def test_probe_on_a_real_driver() -> None:
    if not Path("/proc/driver/nvidia/version").exists():
        pytest.skip("no NVIDIA driver on this machine (runs on a GPU host)")
    facts = read_driver_facts(Path("/"), probe_nvml)
    assert facts.nvml is not None and facts.nvml.error is None, facts.nvml
    assert facts.loaded_version is not None
    report = judge(facts)
    assert report.loaded is True and not report.version_mismatch
    assert report.library_version == facts.loaded_version  # NVML "12.580.95.05" -> "580.95.05"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    proc = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    checks = {c["id"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["driver-loaded"]["status"] == "ok"
    assert "NVML: ok" in checks["driver-loaded"]["detail"]
    assert checks["driver-version-match"]["status"] == "ok"


def test_a_hung_probe_is_not_piled_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver call that never returns (a wedged GPU) costs one thread, not one a minute."""
    import threading

    from sparkwatch.telemetry.sources import nvml

    release = threading.Event()

    def hang() -> NvmlFacts:
        release.wait(10)
        return NvmlFacts(library_version="12.580.95.05")

    monkeypatch.setattr(nvml, "_ask_nvml", hang)
    # A probe thread another test abandoned (a hanging fake NVML) may still be alive: start from none of ours.
    monkeypatch.setattr(nvml, "_last_probe", {})
    try:
        first = probe_nvml(timeout_s=0.1)
        assert first.error is not None and "did not answer" in first.error
        second = probe_nvml(timeout_s=0.1)
        assert second.error is not None and "still hung" in second.error
    finally:
        release.set()
    assert wait_for_thread_exit()
    assert probe_nvml(timeout_s=2).library_version == "12.580.95.05"


def wait_for_thread_exit() -> bool:
    from sparkwatch.telemetry.sources import nvml

    thread = nvml._last_probe.get("thread")
    if thread is not None:
        thread.join(5)
    return thread is None or not thread.is_alive()
