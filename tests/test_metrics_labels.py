"""/metrics labels hold to what events and logs hold to, scraped from a real daemon: text from the box (a process
title, a declared model) is redacted and cut to 128 characters, and a family keyed per engine carries at most 64
label sets, the rest counted in sparkwatch_metrics_series_dropped_total."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkwatch.common import launched
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.core.launch.bootphase import BootPhase
from tests.conftest import Spawner, wait_until
from tests.daemon import scrape, sparkwatch_run

LABEL_MAX_CHARS = 128  # docs/contract.md and docs/security.md give both figures
SERIES_SETS_MAX = 64
PASSWORD = "hunter2-canary-7f3a"
SCP_PASSWORD = "scp-canary-9c1e"
API_KEY = "sk-canaryq7W9xZ2mN4vB8cD1eF"


def declare(directory: Path, pid: int, model: str, kind: str = "vllm") -> None:
    """What `sparkwatch launch` writes for an engine it started (common.launched), for a real process of ours."""
    ticks = read_start_ticks("/proc", pid)
    assert ticks is not None
    now = time.time()
    decl = launched.Declaration(
        root_pid=pid,
        start_ticks=ticks,
        uid=os.geteuid(),
        kind=kind,
        model=model,
        key=f"{kind}:test",
        budget_bytes=None,
        launched_at=now,
        launcher_pid=os.getpid(),
        phase=BootPhase.LOADING_WEIGHTS,
        phase_since=now,
        phases=((BootPhase.STARTING, now), (BootPhase.LOADING_WEIGHTS, now)),
    )
    launched.write(directory, decl)


def label_values(text: str) -> list[str]:
    return [v for family in text_string_to_metric_families(text) for s in family.samples for v in s.labels.values()]


def test_no_secret_from_a_title_or_a_declared_model_reaches_metrics(spawner: Spawner, tmp_path: Path) -> None:
    """An engine-shaped tree whose title carries `--api-key sk-…` (the budget's `name` label) and whose declaration
    names the model `https://user:<password>@host/model` (the boot phase's `model` label), and another scp's
    `user:<password>@host:/path`."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"XDG_RUNTIME_DIR": str(run_dir), "SPARKWATCH_ENGINE_BUDGETS": json.dumps(["8GiB=sw-secret"])}
    with sparkwatch_run(tmp_path, "--dry-run", env=env) as daemon:
        pidfile = tmp_path / "tree.pids"
        spawner.engine("--title", f"VLLM::EngineCore_sw-secret --api-key {API_KEY}", pidfile=pidfile, wait_for=1)
        # A second engine, declared: its model is both its boot phase's `model` and its budget's `name` label.
        declared = spawner.popen([sys.executable, "-c", "import time; time.sleep(600)"])
        declare(run_dir / "sparkwatch" / "launched", declared.pid, f"https://user:{PASSWORD}@models.example/org/m")
        scp = spawner.popen([sys.executable, "-c", "import time; time.sleep(600)"])  # scp's form: no scheme
        declare(run_dir / "sparkwatch" / "launched", scp.pid, f"ubuntu:{SCP_PASSWORD}@nas.example:/models/m")
        text = ""

        def both_shown() -> bool:
            nonlocal text
            text = scrape(daemon.port)
            return "--api-key" in text and "models.example" in text and "nas.example" in text

        assert wait_until(both_shown, 30), text[-2000:]
    assert PASSWORD not in text and API_KEY not in text and SCP_PASSWORD not in text
    assert 'model="<redacted>@nas.example:/models/m"' in text
    assert "https://user:" not in text  # the userinfo goes whole: no name, no password
    assert 'model="https://<redacted>@models.example/org/m"' in text
    names = [line for line in text.splitlines() if line.startswith("sparkwatch_engine_budget_bytes{")]
    assert any('name="VLLM::EngineCore_sw-secret --api-key <redacted>"' in line for line in names), names


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait(5)


def test_100_declarations_with_long_models_keep_metrics_bounded(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    """64 declarations in the runtime dir and 36 in the state dir (each directory's most), each naming a 3 KB model:
    the labels are cut to 128 characters, the boot families keep 64 engines and count the rest as dropped. (A
    directory's declarations are read up to common.launched.MAX_DIR_BYTES, 256 KiB: 64 of 9 KB no longer all count,
    so the models are as long as 64 of them may be.) Before this, 64 declarations of 9 KB models made a 4.2 MB
    scrape, 100 made 6.6 MB; now about 150 KB."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dirs = [run_dir / "sparkwatch" / "launched"] * 64 + [tmp_path / "state" / "launched"] * 36
    with sparkwatch_run(tmp_path, "--dry-run", env={"XDG_RUNTIME_DIR": str(run_dir)}) as daemon:
        for i, directory in enumerate(dirs):
            sleepers.append(subprocess.Popen(["sleep", "600"]))
            declare(directory, sleepers[-1].pid, f"/models/{i:03d}-" + "m" * 3000)
        text = ""

        def all_seen() -> bool:  # every declaration exported, or those past the cap counted as dropped
            nonlocal text
            text = scrape(daemon.port)
            shown = len(_boot_pids(text))
            return shown == len(dirs) or (shown == SERIES_SETS_MAX and _dropped(text) >= len(dirs) - SERIES_SETS_MAX)

        assert wait_until(all_seen, 30), text[-2000:]
    size = len(text.encode())
    print(f"/metrics with {len(dirs)} declarations of 3 KB models: {size} bytes")
    assert size < 512 * 1024
    assert max(len(v) for v in label_values(text)) <= LABEL_MAX_CHARS
    assert len(_boot_pids(text)) == SERIES_SETS_MAX
    assert _dropped(text) >= len(dirs) - SERIES_SETS_MAX


def _boot_pids(text: str) -> set[str]:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get("sparkwatch_engine_boot_phase_since_timestamp_seconds")
    return set() if family is None else {s.labels["pid"] for s in family.samples}


def _dropped(text: str) -> float:
    for line in text.splitlines():
        if line.startswith("sparkwatch_metrics_series_dropped_total "):
            return float(line.split()[1])
    return 0.0


def test_two_jit_caches_named_alike_for_128_characters_are_one_series_not_a_broken_scrape(tmp_path: Path) -> None:
    """Two flashinfer version directories whose 201-character names differ only at the end: cut to 128 characters
    they would be the same series twice (Prometheus refuses such a scrape), so the second is left out and counted."""
    cache = tmp_path / "flashinfer"
    names = ["v" * 200 + "1", "v" * 200 + "2"]
    for name in names:
        (cache / name / "121a" / "cached_ops").mkdir(parents=True)
    cut = "v" * (LABEL_MAX_CHARS - 1) + "…"
    env = {"SPARKWATCH_JIT_CACHE_DIRS": json.dumps([str(cache)])}
    with sparkwatch_run(tmp_path, "--dry-run", env=env) as daemon:
        text = ""

        def shown() -> bool:
            nonlocal text
            text = scrape(daemon.port)
            return "sparkwatch_jit_cache_bytes{" in text

        assert wait_until(shown, 30), text[-2000:]
    series = [line for line in text.splitlines() if line.startswith("sparkwatch_jit_cache_bytes{")]
    assert len(series) == 1 and f'version="{cut}"' in series[0], series
    assert not any(name in text for name in names)
    assert _dropped(text) >= 1
