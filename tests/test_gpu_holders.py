"""GPU holders no engine rule names: visible in `engines --all`, `status` and a metric; with `guard_gpu_holders` the
guard treats them as engines.

The processes are real (an engine titled like vLLM's EngineCore, a training script that is no engine); NVML is the
fake built from the real pynvml module (tests/helpers/fake_nvml.py), listing those real pids as holders, since a
GB10 cannot exist here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sparkwatch.config.settings import Settings, load_settings
from sparkwatch.telemetry.exporter.collector import SparkwatchCollector
from sparkwatch.telemetry.loop import Telemetry
from sparkwatch.telemetry.sources.nvml import NvmlSource
from tests.conftest import Spawner, wait_until
from tests.helpers.fake_nvml import FakeNvml, gb10

GiB = 1 << 30


def settings(tmp_path: Path, **extra: Any) -> Settings:
    return load_settings(
        None,
        {
            "ancestor_pid": os.getpid(),
            "state_dir": tmp_path / "state",
            "jit_cache_dirs": [tmp_path / "none"],
            "vllm_cache_dirs": [tmp_path / "none"],
            **extra,
        },
    )


@pytest.fixture
def holders(spawner: Spawner) -> tuple[int, int]:
    """(engine pid, trainer pid): both real, both listed by NVML."""
    engine = spawner.popen(
        [
            sys.executable,
            "-c",
            "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(600)",
        ]
    )
    trainer = spawner.popen([sys.executable, "-c", "import time; time.sleep(600)", "train.py"])

    def titled() -> bool:
        with open(f"/proc/{engine.pid}/cmdline", "rb") as fh:
            return fh.read().startswith(b"VLLM::EngineCore")

    assert wait_until(titled, 20)
    return engine.pid, trainer.pid


def fake_gpu(engine: int, trainer: int) -> FakeNvml:
    return FakeNvml([gb10(compute_procs=[(engine, 80 * GiB), (trainer, 5 * GiB)], graphics_procs=[])])


def test_unknown_holder_in_the_snapshot_the_metric_and_status(tmp_path: Path, holders: tuple[int, int]) -> None:
    engine, trainer = holders
    s = settings(tmp_path)
    telemetry = Telemetry(s, gpu_source=NvmlSource(nvml=fake_gpu(engine, trainer)))
    snap = telemetry.collect()
    assert [t.root.pid for t in snap.engines] == [engine]
    assert [(h.proc.pid, h.used_gpu_memory_bytes) for h in snap.gpu_unknown] == [(trainer, 5 * GiB)]
    assert telemetry.gpu_holder_keys >= {(trainer, snap.gpu_unknown[0].proc.start_ticks)}

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SparkwatchCollector(lambda: snap, settings=s))
    text = generate_latest(registry).decode()
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("sparkwatch_gpu_unknown")
    }
    assert values == {"sparkwatch_gpu_unknown_holders": 1, "sparkwatch_gpu_unknown_holder_memory_bytes": 5 * GiB}

    from rich.console import Console

    from sparkwatch.tui.status_view import gpu_lines

    console = Console(width=160, record=True, file=open(os.devnull, "w"))  # noqa: SIM115 - closed by the console
    for line in gpu_lines(snap.gpu, snap.gpu_unknown):
        console.print(line)
    out = console.export_text()
    console.file.close()
    assert f"not an engine: {trainer} " in out and "5.0 GiB" in out
    telemetry.close()


def test_opt_in_makes_the_holder_an_engine(tmp_path: Path, holders: tuple[int, int]) -> None:
    engine, trainer = holders
    telemetry = Telemetry(
        settings(tmp_path, guard_gpu_holders=True), gpu_source=NvmlSource(nvml=fake_gpu(engine, trainer))
    )
    telemetry.collect()  # learns the holders
    snap = telemetry.collect()
    assert {t.root.pid: t.kind for t in snap.engines} == {engine: "vllm", trainer: "gpu"}
    assert snap.gpu_unknown == ()
    telemetry.close()


def test_engines_all_lists_the_holder(
    tmp_path: Path, holders: tuple[int, int], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    engine, trainer = holders
    from sparkwatch.cli import engines as engines_cli
    from sparkwatch.cli import main

    monkeypatch.setattr(engines_cli, "gpu_source", lambda _s: NvmlSource(nvml=fake_gpu(engine, trainer)))
    monkeypatch.setenv("SPARKWATCH_ANCESTOR_PID", str(os.getpid()))
    assert main(["engines", "--all", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["root_pid"] for e in out["engines"]] == [engine]
    assert [(h["pid"], h["used_gpu_memory_bytes"]) for h in out["gpu_unknown"]] == [(trainer, 5 * GiB)]
    assert main(["engines", "--all"]) == 0
    text = capsys.readouterr().out
    assert "GPU holders that are not engines" in text and str(trainer) in text


def test_engines_all_without_nvml_says_so() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "engines", "--all", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "SPARKWATCH_ANCESTOR_PID": str(os.getpid())},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["gpu_unknown"] == [] and doc["gpu_note"]  # no GPU on this machine: said, not hidden
