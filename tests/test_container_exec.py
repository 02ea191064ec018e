"""An engine `docker exec`'d under a `sleep` PID 1, as eugr/spark-vllm-docker and sparkrun run it (`--network host
--ipc=host`), under a real dockerd (tests/dockerd.py) and a real `sparkwatch run`: the guard kills the engine's whole
tree (its workers and its hog) by a config budget, names the container, and leaves the `sleep` that holds the
container up; the shared memory files the engine held are then named as leftovers and removed by `--fix`.

The container's /dev/shm is a scratch directory of the host (the commands' `--root`), so no test ever removes a file
of the real /dev/shm. Memory stays bounded: a 300 MiB budget, an engine of at most 700 MiB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from tests.conftest import alive, require, wait_until
from tests.daemon import sparkwatch_run, wait_for_event
from tests.dockerd import Dockerd, fake_engine_argv, run_args

pytestmark = [pytest.mark.docker, pytest.mark.pressure]
MiB = 1 << 20
GiB = 1 << 30


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_an_execd_engine_is_killed_whole_and_its_shm_leftovers_are_named_then_fixed(
    dockerd: Dockerd, tmp_path: Path
) -> None:
    with MeminfoReader() as r:
        avail = r.read().available_bytes
    require(avail > 700 * MiB + 2 * GiB, f"needs 700 MiB more than the 2 GiB kept free; {avail >> 20} MiB available")
    name = f"sw-exec-{os.getpid()}"
    root = tmp_path / "root"
    shm = root / "dev" / "shm"
    shm.mkdir(parents=True)
    psm, sem = f"psm_swtest-{uuid.uuid4().hex[:8]}", f"sem.mp-swtest-{uuid.uuid4().hex[:8]}"
    budgets = json.dumps(["300MiB=sw-exec-engine"])
    dockerd.remove(name)
    try:
        flags = ("--network", "host", "--ipc=host", "-v", f"{shm}:/dev/shm", "--restart", "unless-stopped")
        cid = dockerd.docker(*run_args(dockerd, name, *flags), "sleep", "infinity").stdout.strip()
        sleeper = dockerd.container_pid(name)
        with sparkwatch_run(tmp_path, env={"DOCKER_HOST": dockerd.host, "SPARKWATCH_ENGINE_BUDGETS": budgets}) as agent:
            engine = fake_engine_argv(
                "--title", "VLLM::EngineCore_sw-exec-engine",
                "--worker", "VLLM::Worker_TP0",
                "--shm-file", f"{psm}:4", "--shm-file", f"{sem}:1",
                "--hog-rate-mib", "150", "--hog-limit-mib", "700",
            )  # fmt: skip
            dockerd.docker("exec", "-d", name, *engine)
            event: dict[str, Any] = wait_for_event(agent.events_path, "kill", timeout_s=60)
            assert event["trigger"] == "budget" and event["budget_source"] == "config", event
            victims = {v["pid"]: v["name"] for v in event["victims"]}
            [root_pid] = [p for p, n in victims.items() if n.startswith("VLLM::EngineCore")]
            assert any(n == "VLLM::Worker_TP0" for n in victims.values()) and len(victims) >= 3, victims
            assert sleeper not in victims  # the container's PID 1 is no part of the engine's tree
            [entry] = event["containers"]
            assert (entry["root_pid"], entry["id"], entry["name"]) == (root_pid, cid, name)
            assert wait_until(lambda: not any(alive(p) for p in victims), 15), victims
            time.sleep(1.0)
            assert alive(sleeper) and comm(sleeper) == "sleep"  # the container is still up: only the engine died
            kills = [e for e in read_events(agent.events_path) if e["kind"] == "kill"]
            assert len(kills) == 1, kills
        where = ("--root", str(root), "--proc-root", "/proc")
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        env["SPARKWATCH_ANCESTOR_PID"] = str(os.getpid())
        doctor = subprocess.run(
            [sys.executable, "-m", "sparkwatch", "doctor", "--json", *where],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        check = {c["id"]: c for c in json.loads(doctor.stdout)["checks"]}["shm-leftovers"]
        detail = check["detail"].splitlines()
        assert f"{psm}: 4.0 MiB, uid 0 (removable)" in detail and f"{sem}: 1.0 MiB, uid 0 (removable)" in detail, check
        fixed = subprocess.run(
            [sys.executable, "-m", "sparkwatch", "wait-settled", "--timeout", "60", "--tolerance", "64GiB", *where,
             "--fix"],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        assert fixed.returncode == 0 and "sparkwatch: fix: removed 2 files" in fixed.stderr, fixed.stderr
        assert not (shm / psm).exists() and not (shm / sem).exists()
    finally:
        dockerd.remove(name)
