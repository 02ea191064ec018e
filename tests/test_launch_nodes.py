"""`sparkwatch launch` plans an engine that spans nodes node by node (core.launch.nodeplan, cli.launch.nodes): each
node's share against that node's own pool, read from its own agent, and a refusal that names the node.

The other node is a real `sparkwatch run` whose /proc is a fixture meminfo (its pool is what the test says; it holds
no process, so its guard has nothing to act on), read through its real peer endpoint.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkwatch.core.engines.enginecli import recognise
from sparkwatch.core.launch.nodeplan import (
    HEAD_SERVING_BYTES,
    RAY_HEAD_BYTES,
    RAY_WORKER_BYTES,
    NodeInput,
    Role,
    ViewSource,
    plan_nodes,
    rank_facts,
    span_of,
)
from sparkwatch.core.launch.plan import Fix, FixAction, MemoryView, ModelFacts
from tests.conftest import wait_until
from tests.daemon import sparkwatch_run
from tests.planbox import GB10_TOTAL_KIB, model_dir, plan, proc_root

GB = 10**9
GiB = 1 << 30
# The two checkpoints the field ran across two Sparks: 157 GB over -tp 2, 169 GB over -pp 2. A large MoE's shape
# (its config.json's fields; 64 layers, grouped KV heads).
BIG_SHAPE = {
    "num_hidden_layers": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "dtype": "bfloat16",
}


def gb10(available_gib: float, floor_gib: float = 1) -> MemoryView:
    return MemoryView(
        GB10_TOTAL_KIB * 1024, int(available_gib * GiB), int(available_gib * GiB), 0, int(floor_gib * GiB)
    )


@pytest.mark.parametrize(
    ("argv", "ray", "nodes"),
    [
        ("vllm serve m -tp 2 --distributed-executor-backend ray", True, 2),
        ("vllm serve m --tensor-parallel-size 2", False, None),  # one node's GPUs (mp backend, no --nnodes)
        ("vllm serve m -pp 2", True, 2),
        ("vllm serve m -tp 2 -pp 2", True, 4),
        ("vllm serve m -tp 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1", False, 2),
        ("python -m sglang.launch_server --model-path m --tp 2 --nnodes 2 --node-rank 0", False, 2),
        ("vllm serve m", True, None),
        ("llama-server -m m.gguf", True, None),
    ],
)
def test_the_nodes_an_engine_spans(argv: str, ray: bool, nodes: int | None) -> None:
    span = span_of(recognise(tuple(argv.split())), ray)
    assert (None if span is None else span.nodes) == nodes, span


def test_a_pipeline_stage_holds_its_share_of_the_weights_and_the_layers() -> None:
    facts = ModelFacts("m", weights_bytes=169 * GB, files=34, format="safetensors", layers=61, kv_heads=8,
                       head_dim=128, dtype_bytes=2)  # fmt: skip
    span = span_of(recognise(("vllm", "serve", "m", "-pp", "2")), True)
    assert span is not None
    stage = rank_facts(facts, span)
    assert stage.weights_bytes == 169 * GB // 2 and stage.layers == 31


def test_each_node_holds_its_share_and_the_head_more_than_its_share() -> None:
    facts = ModelFacts("m", weights_bytes=157 * GB, files=32, format="safetensors", layers=64, kv_heads=8,
                       head_dim=128, dtype_bytes=2, hidden_size=8192, intermediate_size=28672, vocab_size=151936,
                       max_len=32768)  # fmt: skip
    cmd = recognise(("vllm", "serve", "m", "-tp", "2", "--distributed-executor-backend", "ray",
                     "--gpu-memory-utilization", "0.8"))  # fmt: skip
    span = span_of(cmd, True)
    assert span is not None
    head, worker = plan_nodes(
        cmd, facts, span, [NodeInput("a", Role.HEAD, gb10(110), ViewSource.LOCAL),
                           NodeInput("b", Role.WORKER, gb10(110), ViewSource.AGENT)],
    )  # fmt: skip
    assert head.plan is not None and worker.plan is not None
    weights = {p.node: next(t.bytes for t in p.plan.terms if t.name == "weights") for p in (head, worker) if p.plan}
    assert weights == {"a": 157 * GB // 2, "b": 157 * GB // 2}
    # the head's API server, engine core and Ray's head processes; the worker's raylet and agents
    assert head.plan.needs_bytes - worker.plan.needs_bytes == HEAD_SERVING_BYTES + RAY_HEAD_BYTES - RAY_WORKER_BYTES
    assert head.fits and worker.fits
    (short,) = plan_nodes(cmd, facts, span, [NodeInput("spark-b", Role.WORKER, gb10(52), ViewSource.AGENT)])
    assert short.fits is False
    assert short.line().startswith("does not fit on spark-b (worker, memory as sparkwatch reports it): needs ")
    (unknown,) = plan_nodes(cmd, facts, span, [NodeInput("spark-b", Role.WORKER, None, ViewSource.NONE)])
    assert unknown.fits is None and "not checked" in unknown.line()


def _peer(tmp_path: Path, available_gib: float) -> tuple[Path, dict[str, str]]:
    """A real agent whose pool is a fixture meminfo with `available_gib` available."""
    root = proc_root(tmp_path / "peer", available_gib)
    return root, {"SPARKWATCH_PROC_ROOT": str(root), "SPARKWATCH_FLOOR": "4GiB"}


def _served(daemon_port: int) -> bool:
    """Whether the agent's peer document carries its pool yet (after telemetry's first cycle)."""
    import urllib.request

    from sparkwatch.telemetry import peerdoc

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon_port}{peerdoc.PATH}", timeout=5) as resp:
            return peerdoc.parse(resp.read()).memory is not None
    except OSError:
        return False


@pytest.mark.parametrize(("shape", "size_gb", "worker_gib", "fits"), [("-tp", 157, 40, False), ("-pp", 169, 110, True)])
def test_a_worker_node_whose_agent_reports_too_little_is_named(
    tmp_path: Path, shape: str, size_gb: int, worker_gib: float, fits: bool
) -> None:
    model = model_dir(tmp_path / "model", size_gb * GB, BIG_SHAPE)
    (tmp_path / "peer").mkdir()
    _root, peer_env = _peer(tmp_path, worker_gib)
    with sparkwatch_run(tmp_path / "peer", env=peer_env) as b:
        assert wait_until(lambda: _served(b.port), 30)
        env = {"SPARKWATCH_PEERS": json.dumps([f"127.0.0.1:{b.port}"]), "RAY_ADDRESS": "127.0.0.1:1",
               "SPARKWATCH_RAY_DASHBOARD_URL": "http://127.0.0.1:1"}  # fmt: skip
        cmd = ("--", "vllm", "serve", str(model), shape, "2", "--distributed-executor-backend", "ray",
               "--gpu-memory-utilization", "0.8")  # fmt: skip
        done = plan(tmp_path, "--json", *cmd, env=env, available_gib=110)
        text = plan(tmp_path, *cmd, env=env, available_gib=110)
    doc = json.loads(done.stdout)
    head, worker = doc["nodes"]
    assert (head["role"], head["source"], worker["role"], worker["source"]) == (
        "head",
        "this node",
        "worker",
        "sparkwatch",
    )
    assert worker["available_bytes"] == int(worker_gib * GiB) - 4 * GiB - GiB  # its own floor, launch's margin
    for node in (head, worker):
        terms = {t["name"]: t["bytes"] for t in node["terms"]}
        assert terms["weights"] == size_gb * GB // 2, node  # one rank or one stage a node
        assert node["needs_bytes"] > terms["weights"]
    assert {"head_serving", "ray_head"} <= {t["name"] for t in head["terms"]}
    assert "ray_worker" in {t["name"] for t in worker["terms"]}
    assert worker["fits"] is fits and doc["fits"] is (fits and head["fits"])
    assert done.returncode == (0 if doc["fits"] else 1)
    node_b = socket.gethostname()  # the agent's node name (one host here; on two Sparks, spark-b's)
    if not fits:
        assert f"does not fit on {node_b} (worker, memory as sparkwatch reports it): needs " in text.stdout, text.stdout


def _fake_vllm(tmp_path: Path, marker: Path) -> Path:
    """A `vllm` of the test's own on PATH: it writes the time it ran to `marker`, and nothing else."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f"#!/bin/sh\ndate +%s.%N > {marker}\n")
    (bin_dir / "vllm").chmod(0o755)
    return bin_dir


def _launch_on_a(
    tmp_path: Path, peer_port: int, bin_dir: Path, model: Path, *args: str
) -> tuple[list[str], dict[str, str]]:
    """`sparkwatch launch ARGS -- vllm serve MODEL -tp 2 --nnodes 2 --node-rank 0 …` on node A (a fixture /proc with
    110 GiB available), the agent on `peer_port` its peer: argv and environment."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SPARKWATCH_PEERS": json.dumps([f"127.0.0.1:{peer_port}"]),
           "SPARKWATCH_STATE_DIR": str(tmp_path / "s"), "XDG_RUNTIME_DIR": str(tmp_path / "run"),
           "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "SPARKWATCH_FLOOR": "1GiB"}  # fmt: skip
    (tmp_path / "run").mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "sparkwatch", "launch", *args, "--no-scope", "--proc-root",
            str(proc_root(tmp_path, 110)), "--", "vllm", "serve", str(model), "-tp", "2", "--nnodes", "2",
            "--node-rank", "0", "--master-addr", "127.0.0.1"]  # fmt: skip
    return argv, env


def test_the_launch_refuses_before_anything_starts_and_names_the_node(tmp_path: Path) -> None:
    """Without --plan, over --nnodes (no Ray): exit 75, the worker named, and the command never ran (a `vllm` of the
    test's own that would leave a file)."""
    model = model_dir(tmp_path / "model", 157 * GB, BIG_SHAPE)
    (tmp_path / "peer").mkdir()
    _root, peer_env = _peer(tmp_path, 40)
    marker = tmp_path / "started"
    bin_dir = _fake_vllm(tmp_path, marker)
    with sparkwatch_run(tmp_path / "peer", env=peer_env) as b:
        assert wait_until(lambda: _served(b.port), 30)
        argv, env = _launch_on_a(tmp_path, b.port, bin_dir, model, "--settle-timeout", "0")
        done = subprocess.run([*argv, "--gpu-memory-utilization", "0.8"], capture_output=True, text=True, env=env,
                              timeout=60)  # fmt: skip
    assert done.returncode == 75, done.stderr
    assert "does not fit on " in done.stderr and "(worker, memory as sparkwatch reports it)" in done.stderr
    assert not marker.exists()


def test_launch_waits_while_the_other_node_is_still_handing_memory_back(tmp_path: Path) -> None:
    """Node B's pool is still coming back (its MemAvailable climbs a GiB every 0.4 s for 3 s, as after a teardown):
    launch on A waits until B's agent has shown it steady for the quiet period, then starts the command."""
    model = model_dir(tmp_path / "model", 1 * GB)
    (tmp_path / "peer").mkdir()
    _root, peer_env = _peer(tmp_path, 60)
    marker = tmp_path / "started"
    bin_dir = _fake_vllm(tmp_path, marker)
    with sparkwatch_run(tmp_path / "peer", env=peer_env) as b:
        assert wait_until(lambda: _served(b.port), 30)
        argv, env = _launch_on_a(tmp_path, b.port, bin_dir, model, "--settle-timeout", "30")
        launch = subprocess.Popen([*argv, "--gpu-memory-utilization", "0.3"], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)  # fmt: skip
        last_rise = 0.0
        for step in range(1, 9):  # B's teardown hands memory back
            proc_root(tmp_path / "peer", 60 + step)
            last_rise = time.time()
            time.sleep(0.4)
        _out, err = launch.communicate(timeout=60)
    assert launch.returncode == 0, err
    assert "sparkwatch: settling on " in err and "sparkwatch: the other nodes settled (waited " in err, err
    started = float(marker.read_text())
    # B's agent reads its pool once a second: the rise is seen up to a cycle late, then 5 s steady are waited for
    assert started - last_rise >= 4.0, (started - last_rise, err)
    print(f"started {started - last_rise:.1f} s after the last rise:\n{err}")


def test_a_budget_per_role_each_node_s_launch_taking_its_own(tmp_path: Path) -> None:
    """`--budget head=70GiB,worker=60GiB`: the head's launch declares 70 GiB, the launch on a worker node (its
    `--node-rank 1 --headless` half of the same engine) 60 GiB, each to its own node's guard; each plans its own
    role's share, and learns its peaks under its own role's key."""
    model = model_dir(tmp_path / "model", 1 * GB)
    shape = ("--", "vllm", "serve", str(model), "-tp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1",
             "--gpu-memory-utilization", "0.3")  # fmt: skip
    budget = ("--budget", "head=70GiB,worker=60GiB")
    head = json.loads(plan(tmp_path, "--json", *budget, *shape, "--node-rank", "0", available_gib=110).stdout)
    worker = json.loads(
        plan(tmp_path, "--json", *budget, *shape, "--node-rank", "1", "--headless", available_gib=110).stdout
    )
    assert (head["budget_bytes"], worker["budget_bytes"]) == (70 * GiB, 60 * GiB)
    assert head["key"].endswith("|role=head") and worker["key"].endswith("|role=worker")
    assert [n["role"] for n in head["nodes"]] == ["head", "worker"] and [n["role"] for n in worker["nodes"]] == [
        "worker"
    ]
    head_terms = {t["name"] for t in head["terms"]}
    worker_terms = {t["name"] for t in worker["terms"]}
    assert "head_serving" in head_terms and "head_serving" not in worker_terms
    assert head["needs_bytes"] - worker["needs_bytes"] == HEAD_SERVING_BYTES  # over --nnodes: no Ray processes


@pytest.mark.parametrize(
    ("text", "error"),
    [("boss=1GiB", "ROLE one of head, worker"), ("head=1GiB,head=2GiB", "head: given twice"),
     ("worker=0", "larger than 0"), ("head=lots", "lots")],
)  # fmt: skip
def test_a_role_budget_that_is_not_one_is_refused_by_name(tmp_path: Path, text: str, error: str) -> None:
    done = plan(tmp_path, "--budget", text, "--", "vllm", "serve", "m", available_gib=110)
    assert done.returncode == 2 and error in done.stderr, done.stderr


def test_worker_auto_is_one_budget_for_the_role_the_largest_share_plus_slack() -> None:
    """Over Ray the workers' guards are told one size for the group: `worker=auto` is the largest worker share plus
    10 %, the same on every worker node whose share is known."""
    from sparkwatch.cli.launch.nodes import _with_budget
    from sparkwatch.core.launch.plan import auto_budget

    facts = ModelFacts("m", weights_bytes=40 * GB, files=8, format="safetensors", layers=64, kv_heads=8,
                       head_dim=128, dtype_bytes=2)  # fmt: skip
    cmd = recognise(("vllm", "serve", "m", "-tp", "3", "--gpu-memory-utilization", "0.5",
                     "--distributed-executor-backend", "ray"))  # fmt: skip
    span = span_of(cmd, True)
    assert span is not None
    small = MemoryView(64 << 30, 60 << 30, 60 << 30, 0, 1 << 30)  # a smaller box: a smaller share at 0.5 × total
    workers = plan_nodes(cmd, facts, span, [NodeInput("b", Role.WORKER, gb10(110), ViewSource.AGENT),
                                            NodeInput("c", Role.WORKER, small, ViewSource.AGENT),
                                            NodeInput("d", Role.WORKER, None, ViewSource.NONE)])  # fmt: skip
    needs = [n.plan.needs_bytes for n in workers if n.plan is not None]
    assert len(set(needs)) == 2  # the shares differ
    budgeted = _with_budget(workers, "auto")
    want = max(auto_budget(n, 1 << 30) for n in needs)
    assert [None if n.plan is None else n.plan.budget_bytes for n in budgeted] == [want, want, None]
    assert [n.plan.budget_bytes for n in _with_budget(workers, 60 << 30) if n.plan is not None] == [60 << 30] * 2


def _applied(argv: tuple[str, ...], fix: Fix) -> tuple[tuple[str, ...], int | None]:
    return (*argv, *(word for pair in fix.flags for word in pair)), fix.max_jobs


def test_the_worker_fix_of_the_issue_fits_once_applied_its_ray_worker_term_included() -> None:
    """A worker over Ray on a 24 GiB VM: the fix was the arithmetic's `--gpu-memory-utilization 0.84`, which left
    out the worker's `ray_worker` term, and once applied the plan said "needs 20.1 GiB, 19.8 GiB free" and suggested
    0.84 again (three times). The fix now comes from planning that node again with it applied: 0.82, which fits."""
    facts = ModelFacts("m", weights_bytes=4 * GiB, files=1, format="safetensors", layers=28, kv_heads=8,
                       head_dim=128, dtype_bytes=2, hidden_size=1024, intermediate_size=3072, vocab_size=151936,
                       max_len=4096)  # fmt: skip
    argv = ("vllm", "serve", "m", "-tp", "2", "--distributed-executor-backend", "ray",
            "--gpu-memory-utilization", "0.9")  # fmt: skip
    vm = MemoryView(24 * GiB, 22 * GiB, 22 * GiB, 0, 1 * GiB)
    cmd = recognise(argv)
    span = span_of(cmd, True)
    assert span is not None
    (worker,) = plan_nodes(cmd, facts, span, [NodeInput("vm", Role.WORKER, vm, ViewSource.AGENT)], jobs=1)
    assert worker.plan is not None and worker.fits is False
    (fix,) = worker.plan.fixes
    assert fix.text == "--gpu-memory-utilization 0.82", fix.text
    fixed_argv, _jobs = _applied(argv, fix)
    (again,) = plan_nodes(recognise(fixed_argv), facts, span, [NodeInput("vm", Role.WORKER, vm, ViewSource.AGENT)],
                          jobs=1)  # fmt: skip
    assert again.fits, again.line()


@settings(max_examples=200, deadline=None)
@given(
    shape=st.sampled_from([("-tp", "2", "--distributed-executor-backend", "ray"),
                           ("-pp", "2", "--distributed-executor-backend", "ray"),
                           ("-tp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1")]),
    util=st.sampled_from([None, "0.3", "0.6", "0.9"]),
    total_gib=st.sampled_from([24, 119]),
    head_free=st.floats(0.2, 1.0),
    worker_free=st.floats(0.2, 1.0),
    weights_gib=st.integers(0, 60),
    jobs=st.sampled_from([None, 1, 3]),
)  # fmt: skip
def test_each_node_s_fix_fits_that_node_once_applied(
    *,
    shape: tuple[str, ...],
    util: str | None,
    total_gib: int,
    head_free: float,
    worker_free: float,
    weights_gib: int,
    jobs: int | None,
) -> None:
    """Each node of a two-node plan: every flag fix it suggests, applied (its flags appended, its MAX_JOBS), and
    that node planned again, passes there; a node that misses always has a fix, and "no setting fits" is said only
    where none does."""
    facts = ModelFacts("m", weights_bytes=weights_gib * GiB, files=1, format="safetensors", layers=28, kv_heads=8,
                       head_dim=128, dtype_bytes=2, hidden_size=1024, intermediate_size=3072, vocab_size=151936,
                       max_len=4096)  # fmt: skip
    argv = ("vllm", "serve", "m", *shape, *(("--gpu-memory-utilization", util) if util else ()))
    cmd = recognise(argv)
    span = span_of(cmd, "ray" in shape)
    assert span is not None

    def views() -> list[NodeInput]:
        total = total_gib * GiB
        return [
            NodeInput("a", Role.HEAD, MemoryView(total, int(total * head_free), int(total * head_free), 0, GiB),
                      ViewSource.LOCAL),
            NodeInput("b", Role.WORKER, MemoryView(total, int(total * worker_free), int(total * worker_free), 0,
                                                   GiB), ViewSource.AGENT),
        ]  # fmt: skip

    for i, node in enumerate(plan_nodes(cmd, facts, span, views(), jobs=jobs)):
        assert node.plan is not None
        assert node.fits or node.plan.fixes, node.line()
        for fix in node.plan.fixes:
            assert "free 0 B" not in fix.text, fix.text
            if fix.action != FixAction.LOWER_FLAG:
                continue
            fixed_argv, fixed_jobs = _applied(argv, fix)
            again = plan_nodes(recognise(fixed_argv), facts, span, views(), jobs=fixed_jobs or jobs)[i]
            assert again.plan is not None
            assert again.plan.short_bytes == 0 and not again.plan.estimate.problems, (node.line(), fix.text,
                                                                                     again.line())  # fmt: skip


def test_the_fix_a_worker_s_agent_is_told_fits_that_worker_once_applied(tmp_path: Path) -> None:
    """With a real agent on the worker node: `--plan --json` names the worker's fix (its flags), and the same plan
    with them appended says the worker fits, its role's `ray_worker` term included."""
    model = model_dir(tmp_path / "model", 1 * GB)
    (tmp_path / "peer").mkdir()
    _root, peer_env = _peer(tmp_path, 100)
    with sparkwatch_run(tmp_path / "peer", env=peer_env) as b:
        assert wait_until(lambda: _served(b.port), 30)
        env = {"SPARKWATCH_PEERS": json.dumps([f"127.0.0.1:{b.port}"]), "RAY_ADDRESS": "127.0.0.1:1",
               "SPARKWATCH_RAY_DASHBOARD_URL": "http://127.0.0.1:1", "MAX_JOBS": "1"}  # fmt: skip
        cmd = ("--", "vllm", "serve", str(model), "-tp", "2", "--distributed-executor-backend", "ray",
               "--gpu-memory-utilization", "0.9")  # fmt: skip
        worker = json.loads(plan(tmp_path, "--json", *cmd, env=env, available_gib=110).stdout)["nodes"][1]
        assert worker["fits"] is False and "ray_worker" in {t["name"] for t in worker["terms"]}, worker
        (fix,) = worker["fixes"]
        assert fix["action"] == "lower_flag" and fix["flags"][0][0] == "--gpu-memory-utilization", fix
        applied = [word for pair in fix["flags"] for word in pair]
        again = json.loads(plan(tmp_path, "--json", *cmd, *applied, env=env, available_gib=110).stdout)["nodes"][1]
    assert again["fits"] is True, (fix, again)
