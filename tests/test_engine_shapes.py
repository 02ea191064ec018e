"""Every engine shape of core.engines.identity.SHAPES, spawned as real processes: titles through setproctitle, argv
through real interpreters, console scripts and binaries installed under the real names, parents as upstream makes them.

Each case is a tree; each process says what the guard must make of it: the root of an engine tree of some kind, a
member of one, or spared. The guard is confined to this test's descendants (ancestor_pid), and the spawner kills only
what the test started.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.model import EngineTree, Proc
from tests.conftest import Spawner, descendants, require_tool, wait_until
from tests.helpers.shapes import RUN_HELPER, Node, ShapeKit, spawn_child

RULES = EngineRules.build()


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> ShapeKit:
    require_tool("cc")
    return ShapeKit(tmp_path_factory.mktemp("shapes"))


def case(kit: ShapeKit, name: str) -> Node:
    py = sys.executable

    def script(name: str, *args: str, expect: str, children: list[Node] | None = None, **kw: str) -> Node:
        return Node([str(kit.bin(name)), *args], expect, shebang=py, children=children or [], **kw)

    def module(mod: str, *args: str, expect: str, children: list[Node] | None = None, **kw: str) -> Node:
        return Node([py, "-m", mod, *args], expect, children=children or [], **kw)

    def binary(rel: str, *args: str, expect: str, children: list[Node] | None = None) -> Node:
        return Node([kit.binary(rel), *args], expect, children=children or [])

    workers = [spawn_child("VLLM::Worker_TP0"), spawn_child("VLLM::Worker_TP1")]
    table: dict[str, Node] = {
        # vLLM: vllm/entrypoints/cli/main.py, v1/engine/core.py, v1/executor/multiproc_executor.py
        "vllm-serve": script(
            "vllm",
            "serve",
            "Qwen/Qwen3-32B",
            expect="root:vllm",
            children=[
                spawn_child("VLLM::EngineCore", children=workers),
                spawn_child("VLLM::DPCoordinator"),
                spawn_child("VLLM::APIServer_1"),
            ],
        ),
        "vllm-custom-prefix": module(
            "vllm.entrypoints.openai.api_server",
            "--model",
            "m",
            expect="root:vllm",
            children=[spawn_child("ACME::EngineCore_DP0", children=[spawn_child("ACME::Worker_TP0_EP0")])],
        ),
        "vllm-run-batch": script(
            "vllm",
            "run-batch",
            "-i",
            "in.jsonl",
            "-o",
            "out.jsonl",
            "--model",
            "m",
            expect="root:vllm",
            children=[spawn_child("VLLM::EngineCore")],
        ),
        # An offline LLM() script maps vLLM's _C extension before it starts the EngineCore (vllm/platforms/cuda.py
        # imports vllm._C): that is the evidence that adopts it.
        "vllm-offline-llm": Node(
            [py, str(kit.root / "offline_infer.py"), "--model", "m"],
            "root:vllm",
            lib=str(kit.vllm_lib),
            children=[spawn_child("VLLM::EngineCore", children=[spawn_child("VLLM::Worker_TP0")])],
        ),
        # The same script without the library (a test harness starting fake engines): the EngineCore is its own root.
        "python-parent-without-engine-library": Node(
            [py, str(kit.root / "offline_infer.py"), "--model", "m"],
            "spared",
            children=[spawn_child("VLLM::EngineCore", "root:vllm", children=[spawn_child("VLLM::Worker_TP0")])],
        ),
        "vllm-cli-module": module(
            "vllm.entrypoints.cli.main", "serve", "m", expect="root:vllm", children=[spawn_child("VLLM::EngineCore")]
        ),
        "vllm-orphaned-engine-core": spawn_child("VLLM::EngineCore", expect="root:vllm"),
        "vllm-bench-module": module("vllm.entrypoints.cli.main", "bench", "serve", "--model", "m", expect="spared"),
        "vllm-bench-script": script("vllm", "bench", "serve", "--model", "m", expect="spared"),
        "vllm-installer": script("pip", "install", "vllm", expect="spared"),
        # SGLang: srt/managers/scheduler.py, multimodal_gen (sgl_diffusion::), cli/main.py
        "sglang-launch-server": module(
            "sglang.launch_server",
            "--model-path",
            "m",
            expect="root:sglang",
            children=[spawn_child("sglang::scheduler_TP0"), spawn_child("sglang::detokenizer")],
        ),
        "sglang-generate": script(
            "sglang",
            "generate",
            "--model-path",
            "m",
            expect="root:sglang",
            children=[spawn_child("sgl_diffusion::scheduler_TP0")],
        ),
        "sglang-diffusion-serve": module(
            "sglang.multimodal_gen.runtime.entrypoints.cli.main",
            "serve",
            "--model-path",
            "m",
            expect="root:sglang",
            children=[spawn_child("sgl_diffusion::scheduler_TP0")],
        ),
        "sglang-offline-engine": Node(
            [py, str(kit.root / "sgl_offline.py")],
            "root:sglang",
            lib=str(kit.sgl_lib),
            children=[spawn_child("sglang::scheduler_TP0")],
        ),
        "sglang-bench": module("sglang.bench_serving", "--backend", "sglang", expect="spared"),
        # TensorRT-LLM: commands/serve.py, llmapi/trtllm-llmapi-launch ranks (see test_engine_mpi.py for mpirun)
        "trtllm-serve": script("trtllm-serve", "serve", "m", expect="root:trtllm"),
        "trtllm-worker-node": module("tensorrt_llm.llmapi.mgmn_worker_node", expect="root:trtllm"),
        "trtllm-serve-module": module("tensorrt_llm.commands.serve", "serve", "m", expect="root:trtllm"),
        "trtllm-bench": script("trtllm-bench", "--model", "m", "throughput", expect="spared"),
        # llama.cpp and llama-cpp-python
        "llama-server": binary("build/bin/llama-server", "-m", "x.gguf", "--port", "8080", expect="root:llama.cpp"),
        "llama-cli": binary("build/bin/llama-cli", "-m", "x.gguf", expect="root:llama.cpp"),
        "rpc-server": binary("build/bin/rpc-server", "-p", "50052", expect="root:llama.cpp"),
        "llama-cpp-python": module("llama_cpp.server", "--model", "x.gguf", expect="root:llama.cpp"),
        # Ollama: runner/runner.go (>= 0.5), llm/server.go (llama-server >= 0.30, ollama_llama_server < 0.5)
        "ollama-runner": binary(
            "usr/local/bin/ollama",
            "serve",
            expect="spared",
            children=[binary("usr/local/bin/ollama", "runner", "--model", "/o/blobs/sha256-1", expect="root:ollama")],
        ),
        "ollama-llama-server": binary(
            "usr/local/bin/ollama",
            "serve",
            expect="spared",
            children=[
                binary("usr/local/lib/ollama/llama-server", "--model", "/o/blobs/sha256-2", expect="root:ollama")
            ],
        ),
        "ollama-old-runner": binary(
            "usr/local/bin/ollama",
            "serve",
            expect="spared",
            children=[
                binary("tmp/ollama123/runners/cuda_v12/ollama_llama_server", "--model", "b", expect="root:ollama")
            ],
        ),
        # Decoys: a log viewer, a shell naming an engine, a filter, inline code.
        "tail-log": Node(["/usr/bin/tail", "-f", str(kit.root / "vllm.log")], "spared"),
        "bash-c": Node(["/usr/bin/bash", "-c", "sleep 600; vllm serve m", "vllm"], "spared"),
        "python-c": Node([py, "-c", "import time; time.sleep(600)", "vllm", "serve"], "spared"),
        # Protection that cannot be spoofed: an engine calling itself sshd is an engine; its worker titled like a tmux
        # server dies with it; a copy of a binary named sshd is judged like any other process.
        "engine-named-sshd": script(
            "vllm",
            "serve",
            "m",
            expect="root:vllm",
            comm="sshd",
            children=[spawn_child("tmux: server"), spawn_child("sparkwatch")],
        ),
        "user-copy-named-sshd": binary(
            "bin/sshd",
            "-D",
            expect="spared",
            children=[binary("build/bin/llama-server", "-m", "y", expect="root:llama.cpp")],
        ),
    }
    return table[name]


CASES = [
    "vllm-serve",
    "vllm-custom-prefix",
    "vllm-run-batch",
    "vllm-offline-llm",
    "python-parent-without-engine-library",
    "vllm-cli-module",
    "vllm-orphaned-engine-core",
    "vllm-bench-module",
    "vllm-bench-script",
    "vllm-installer",
    "sglang-launch-server",
    "sglang-generate",
    "sglang-diffusion-serve",
    "sglang-offline-engine",
    "sglang-bench",
    "trtllm-serve",
    "trtllm-worker-node",
    "trtllm-serve-module",
    "trtllm-bench",
    "llama-server",
    "llama-cli",
    "rpc-server",
    "llama-cpp-python",
    "ollama-runner",
    "ollama-llama-server",
    "ollama-old-runner",
    "tail-log",
    "bash-c",
    "python-c",
    "engine-named-sshd",
    "user-copy-named-sshd",
]


def _matches(node: Node, proc: Proc) -> bool:
    if node.title:
        return bool(proc.argv) and proc.argv[0].strip() == node.title
    return proc.argv == node.seen_argv()


def locate(nodes: list[Node], procs: list[Proc]) -> dict[int, Proc] | None:
    """id(node) -> its process, once every node runs with its final title; None while some are still starting."""
    found: dict[int, Proc] = {}
    for node in nodes:
        hit = [p for p in procs if _matches(node, p)]
        if len(hit) != 1:
            return None
        found[id(node)] = hit[0]
    return found


def verdict(pid: int, trees: list[EngineTree]) -> str:
    for tree in trees:
        if tree.root.pid == pid:
            return f"root:{tree.kind}"
        if pid in tree.pids:
            return "member"
    return "spared"


@pytest.mark.parametrize("name", CASES)
def test_engine_shape(name: str, kit: ShapeKit, spawner: Spawner) -> None:
    # The user's scripts (`LLM(model='m').generate(...)`, `sgl.Engine(model_path='m')`): their engine children come
    # from the helper, as multiprocessing would start them.
    (kit.root / "offline_infer.py").write_text(RUN_HELPER + "\n")
    (kit.root / "sgl_offline.py").write_text(RUN_HELPER + "\n")
    (kit.root / "vllm.log").write_text("INFO vllm serve started\n")
    root = case(kit, name)
    proc = spawner.popen(root.argv, env={**kit.env(), **root.env()}, stdout=subprocess.DEVNULL)
    nodes = root.walk()
    scanner = ProcScanner()
    located: dict[int, Proc] | None = None

    def ready() -> bool:
        nonlocal located
        mine = {proc.pid, *descendants(proc.pid)}
        located = locate(nodes, [p for p in scanner.scan().procs if p.pid in mine])
        return located is not None

    assert wait_until(ready, 30, 0.05), f"{name}: not every process of the shape started"
    assert located is not None
    procs = list(scanner.scan().procs)
    trees = find_engine_trees(procs, RULES, Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=proc.pid))
    got = {n.title or " ".join(n.argv[:3]): verdict(located[id(n)].pid, trees) for n in nodes}
    want = {n.title or " ".join(n.argv[:3]): n.expect for n in nodes}
    assert got == want


def test_every_shape_row_is_spawned() -> None:
    """The table above covers every victim row of SHAPES (Ray's rows: tests/test_engine_ray.py; the generic MPI
    worker and the mgmn leader: tests/test_engine_mpi.py)."""
    from sparkwatch.core.engines.identity import SHAPES

    kit_free = ShapeKit(Path("/k"), build=False)
    spawned = [p for name in CASES for n in case(kit_free, name).walk() for p in _as_procs(n)]
    elsewhere = {"ray", "mpi"}
    for shape in SHAPES:
        if not shape.victim or shape.kind in elsewhere:
            continue
        rules = EngineRules(shapes=((shape, re.compile(shape.regex)),), protect=())
        assert any(_matches_shape(p, rules) for p in spawned), f"no spawned process has the shape {shape.regex!r}"


def _as_procs(node: Node) -> list[Proc]:
    argv = (node.title,) if node.title else node.seen_argv()
    base = os.path.basename(argv[0])[:15]
    return [Proc(pid=1, ppid=0, uid=0, comm=base, state="S", start_ticks=0, rss_bytes=0, argv=argv)]


def _matches_shape(proc: Proc, rules: EngineRules) -> bool:
    from sparkwatch.core.engines.identity import classify

    return classify(proc, rules) is not None


def test_docs_list_every_shape_with_its_source() -> None:
    from sparkwatch.core.engines.identity import SHAPES

    doc = (Path(__file__).resolve().parent.parent / "docs" / "engines.md").read_text()
    for shape in SHAPES:
        assert f"`{shape.example}`" in doc and shape.source in doc, shape.example


INNER_TEST = """
import json, os, subprocess, sys, time

def test_starts_fake_engines():
    env = {{**os.environ, "SHAPE_TITLE": "VLLM::EngineCore"}}
    argv = [sys.executable, "-c", {helper!r}, "--multiprocessing-fork"]
    kids = [subprocess.Popen(argv, env=env) for _ in range(2)]
    time.sleep(600)
"""


def test_a_test_runner_with_fake_engines_is_not_adopted_but_an_llm_script_is(
    kit: ShapeKit, spawner: Spawner, tmp_path: Path
) -> None:
    """Issue 20: as root, a `python -m pytest` whose tests started fake EngineCores was adopted as a "vllm engine" of
    536 processes. Here a real pytest runs a test that starts two processes titled VLLM::EngineCore: each is a root
    of its own, and pytest is no engine. Beside it, an offline-LLM-shaped script that maps vllm/_C.abi3.so (as vLLM's
    front end does) and starts the same child is still adopted: the guard kills the whole offline job."""
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(INNER_TEST.format(helper=RUN_HELPER))
    runner = spawner.popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(test_file)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (kit.root / "offline_infer.py").write_text(RUN_HELPER + "\n")
    script = Node(
        [sys.executable, str(kit.root / "offline_infer.py")],
        "root:vllm",
        lib=str(kit.vllm_lib),
        children=[spawn_child("VLLM::EngineCore")],
    )
    offline = spawner.popen(script.argv, env={**kit.env(), **script.env()}, stdout=subprocess.DEVNULL)
    scanner = ProcScanner()

    def cores(root: int) -> list[Proc]:
        mine = {root, *descendants(root)}
        return [p for p in scanner.scan().procs if p.pid in mine and p.argv[:1] == ("VLLM::EngineCore",)]

    assert wait_until(lambda: len(cores(runner.pid)) == 2 and len(cores(offline.pid)) == 1, 60, 0.1)
    procs = list(scanner.scan().procs)
    scope = Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=os.getpid())
    trees = find_engine_trees(procs, RULES, scope)
    roots = {t.root.pid: t for t in trees}
    in_trees = {pid for t in trees for pid in t.pids}
    assert runner.pid not in in_trees, "the test runner was taken for an engine"
    assert {p.pid for p in cores(runner.pid)} <= set(roots), "each fake EngineCore is a root of its own"
    assert offline.pid in roots and roots[offline.pid].kind == "vllm", "the LLM() script that maps vllm/_C is adopted"
    assert cores(offline.pid)[0].pid in roots[offline.pid].pids
