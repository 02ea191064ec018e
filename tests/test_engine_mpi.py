"""Real Open MPI (Debian openmpi-bin, python3-mpi4py) in TensorRT-LLM's process layouts.

- `mpirun` ranks running tensorrt_llm.llmapi.mgmn_leader_node / mgmn_worker_node (trtllm-llmapi-launch's layout):
  every rank is a trtllm engine, mpirun is not.
- An LLM-API script's mpi4py.futures workers (`python -m mpi4py.futures.server` under the singleton's orted): engines
  only with the engine library mapped, read from /proc/PID/maps; the same workers without it are someone's MPI job.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.model import EngineTree
from tests.conftest import Spawner, descendants, require, require_tool, wait_until
from tests.helpers.shapes import ShapeKit

HELPER = Path(__file__).resolve().parent / "helpers" / "trtllm_llmapi.py"
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, where python3-mpi4py installs
RULES = EngineRules.build()


def mpi_env() -> dict[str, str]:
    return {
        **os.environ,
        # Open MPI refuses root unless told twice (CI runs as root); 2 cores: allow more ranks than cores.
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        # Shared memory between local ranks without cross-memory attach (ptrace may be denied in a container).
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    }


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> ShapeKit:
    require_tool("cc")
    return ShapeKit(tmp_path_factory.mktemp("mpi-shapes"))


def has_mpi4py() -> bool:
    if not os.path.exists(SYSTEM_PYTHON):
        return False
    return subprocess.run([SYSTEM_PYTHON, "-c", "import mpi4py.futures"], capture_output=True).returncode == 0


def trees_under(pid: int) -> list[EngineTree]:
    scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=pid)
    return find_engine_trees(ProcScanner().scan().procs, RULES, scope)


def test_mpirun_ranks_of_trtllm_llmapi_launch(kit: ShapeKit, spawner: Spawner) -> None:
    mpirun = require_tool("mpirun")
    env = {**mpi_env(), **kit.env()}
    py = sys.executable
    argv = [
        mpirun,
        "-n",
        "1",
        py,
        "-m",
        "tensorrt_llm.llmapi.mgmn_leader_node",
        ":",
        "-n",
        "1",
        py,
        "-m",
        "tensorrt_llm.llmapi.mgmn_worker_node",
    ]
    launcher = spawner.popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def ranks() -> list[int]:
        scan = {p.pid: p for p in ProcScanner().scan().procs}
        return [pid for pid in descendants(launcher.pid) if pid in scan and "-m" in scan[pid].argv]

    assert wait_until(lambda: len(ranks()) == 2, 30), "mpirun did not start both ranks"
    trees = trees_under(launcher.pid)
    assert {t.root.pid: t.kind for t in trees} == dict.fromkeys(ranks(), "trtllm")
    assert launcher.pid not in {pid for t in trees for pid in t.pids}  # mpirun itself is no engine


@pytest.mark.parametrize("with_lib", [True, False], ids=["libtensorrt_llm-mapped", "plain-mpi-job"])
def test_llmapi_mpi4py_workers(with_lib: bool, kit: ShapeKit, spawner: Spawner) -> None:
    require_tool("mpirun")
    require(has_mpi4py(), "python3-mpi4py is not installed (apt packages are listed in .ci/run)")
    lib = str(kit.trtllm_lib) if with_lib else "--no-lib"
    script = spawner.popen(
        [SYSTEM_PYTHON, str(HELPER), lib], env=mpi_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert script.stdout is not None
    ready, _, _ = select.select([script.stdout], [], [], 90)  # MPI's singleton start-up: seconds on 2 busy cores
    assert ready, "the MPI pool did not start within 90 s"
    line = script.stdout.readline()
    assert line, "the MPI pool did not start"
    workers = json.loads(line)
    assert len(workers) == 2
    assert all(pid in descendants(script.pid) for pid in workers)  # under the singleton's orted, as upstream
    trees = trees_under(script.pid)
    if with_lib:
        assert {t.root.pid: t.kind for t in trees} == dict.fromkeys(workers, "trtllm")
    else:
        assert trees == []
