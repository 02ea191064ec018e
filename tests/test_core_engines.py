"""Engine identity: by what a process is, never by a substring of its command line."""

from __future__ import annotations

import pytest

from sparkwatch.core.engines import EngineRules, Scope, engine_kind, entry_point, find_engine_trees, is_protected
from sparkwatch.model import Proc

RULES = EngineRules.build()


def proc(pid: int, ppid: int, comm: str, *argv: str, uid: int = 1000, kthread: bool = False) -> Proc:
    return Proc(
        pid=pid,
        ppid=ppid,
        uid=uid,
        comm=comm,
        state="S",
        start_ticks=pid * 10,
        rss_bytes=pid << 20,
        argv=tuple(argv),
        is_kernel_thread=kthread,
    )


@pytest.mark.parametrize(
    ("comm", "argv", "kind"),
    [
        ("VLLM::EngineCor", ("VLLM::EngineCore" + " " * 40,), "vllm"),  # setproctitle pads; comm cut to 15
        ("VLLM::Worker_TP", ("VLLM::Worker_TP0_EP0",), "vllm"),
        ("VLLM::APIServer", ("VLLM::APIServer_0",), "vllm"),
        ("vllm", ("/venv/bin/python3", "/venv/bin/vllm", "serve", "Qwen/Qwen3-32B"), "vllm"),
        ("vllm", ("/venv/bin/vllm", "serve", "--model", "m"), "vllm"),
        ("python3", ("python3", "-u", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"), "vllm"),
        ("python3", ("python3", "-X", "faulthandler", "-m", "vllm.entrypoints.api_server"), "vllm"),
        ("ray::RayWorkerW", ("ray::RayWorkerWrapper.execute_method",), "ray"),
        ("ray::IDLE", ("ray::IDLE",), "ray"),
        ("llama-server", ("/opt/llama.cpp/build/bin/llama-server", "-m", "x.gguf"), "llama.cpp"),
        ("llama-cli", ("./llama-cli", "-m", "x.gguf"), "llama.cpp"),
        ("python3", ("python3", "-m", "sglang.launch_server", "--model-path", "m"), "sglang"),
        ("sglang::schedu", ("sglang::scheduler_TP0",), "sglang"),
        ("trtllm-serve", ("/usr/local/bin/trtllm-serve", "serve", "m"), "trtllm"),
        ("ollama", ("/usr/local/bin/ollama", "runner", "--model", "/root/.ollama/blobs/sha256-x"), "ollama"),
    ],
)
def test_engines_are_recognised_by_identity(comm: str, argv: tuple[str, ...], kind: str) -> None:
    assert engine_kind(proc(100, 1, comm, *argv), RULES) == kind


@pytest.mark.parametrize(
    ("comm", "argv"),
    [
        ("tail", ("tail", "-f", "vllm.log")),
        ("vim", ("vim", "serve_vllm.sh")),
        ("grep", ("grep", "vllm")),
        ("bash", ("bash", "-c", "vllm serve meta-llama/Llama-3.1-8B")),
        ("bash", ("/bin/bash", "./run.sh", "vllm", "serve")),
        ("python3", ("python3", "-c", "import vllm; vllm.serve()", "vllm", "serve")),
        ("ollama", ("/usr/local/bin/ollama", "serve")),  # the server: the runner holds the model
        ("raylet", ("/venv/lib/ray/core/src/ray/raylet/raylet", "--node_ip_address=10.0.0.2")),
        ("less", ("less", "VLLM::EngineCore")),
        ("python3", ("python3", "train.py", "--note", "ray::IDLE")),
        ("sshd", ("sshd: user@pts/0",)),
    ],
)
def test_substrings_are_not_engines(comm: str, argv: tuple[str, ...]) -> None:
    assert engine_kind(proc(100, 1, comm, *argv), RULES) is None


def test_kernel_threads_are_never_engines() -> None:
    assert engine_kind(proc(100, 2, "VLLM::x", kthread=True), RULES) is None


def test_entry_point_skips_interpreter_options() -> None:
    assert entry_point(("python3.12", "-O", "-W", "ignore", "-m", "vllm.entrypoints.cli.main", "serve")) == (
        "vllm.entrypoints.cli.main",
        ("serve",),
    )
    assert entry_point(("python", "/x/bin/vllm", "serve")) == ("vllm", ("serve",))
    assert entry_point(()) == ("", ())


def test_user_patterns_extend_the_defaults() -> None:
    rules = EngineRules.build(["myengine=my-server$"], [r"precious$"])
    assert engine_kind(proc(5, 1, "my-server", "/opt/my-server"), rules) == "myengine"
    assert is_protected(proc(6, 1, "precious", "precious"), rules)
    with pytest.raises(ValueError, match="kind=regex"):
        EngineRules.build(["no-equals-sign"])
    with pytest.raises(ValueError, match="not a valid regex"):
        EngineRules.build(["x=("])


def vllm_ray_table() -> list[Proc]:
    """A vLLM server that started its own Ray: api server -> engine core -> raylet -> workers -> compilers."""
    return [
        proc(1, 0, "systemd", "/sbin/init", uid=0),
        proc(2, 0, "kthreadd", kthread=True, uid=0),
        proc(500, 1, "sshd", "sshd: user [priv]", uid=0),
        proc(600, 500, "bash", "-bash"),
        proc(700, 600, "tmux: server", "tmux"),
        proc(1000, 600, "vllm", "/venv/bin/python3", "/venv/bin/vllm", "serve", "m"),
        proc(1001, 1000, "VLLM::EngineCor", "VLLM::EngineCore"),
        proc(1002, 1001, "raylet", "/venv/lib/ray/raylet"),
        proc(1003, 1002, "ray::RayWorkerW", "ray::RayWorkerWrapper"),
        proc(1004, 1003, "ninja", "ninja", "-v", "-j", "20"),
        proc(1005, 1004, "nvcc", "nvcc", "-gencode", "arch=compute_121a,code=sm_121a"),
        proc(1006, 1005, "cicc", "cicc"),
        proc(1007, 1000, "tmux: server", "tmux", "new", "-d"),  # protected even inside the tree
        proc(1008, 1007, "bash", "bash"),
        proc(2000, 1, "VLLM::Worker_TP", "VLLM::Worker_TP0"),  # orphaned worker (parent 1) still holding the pool
        proc(3000, 600, "tail", "tail", "-f", "vllm.log"),
        proc(4000, 1, "llama-server", "llama-server", uid=1001),  # another user's
        proc(5000, 600, "sparkwatch", "/venv/bin/python3", "/venv/bin/sparkwatch", "run"),
    ]


def test_trees_include_every_descendant_and_skip_protected_subtrees() -> None:
    trees = find_engine_trees(vllm_ray_table(), RULES, Scope(self_pid=5000, own_uid=1000))
    by_root = {t.root.pid: t for t in trees}
    assert set(by_root) == {1000, 2000}
    assert by_root[1000].kind == "vllm"
    assert by_root[1000].pids == (1000, 1001, 1002, 1003, 1004, 1005, 1006)
    assert by_root[2000].pids == (2000,)


def test_root_sees_other_users_engines_and_scope_confines() -> None:
    table = vllm_ray_table()
    as_root = find_engine_trees(table, RULES, Scope(self_pid=5000, own_uid=0))
    assert 4000 in {t.root.pid for t in as_root}
    confined = find_engine_trees(table, RULES, Scope(self_pid=5000, own_uid=1000, ancestor_pid=600))
    assert {t.root.pid for t in confined} == {1000}


def test_never_touches_itself_its_ancestors_or_pid_1() -> None:
    table = [
        proc(1, 0, "VLLM::EngineCor", "VLLM::EngineCore"),  # even if PID 1 had an engine's title
        proc(10, 1, "VLLM::EngineCor", "VLLM::EngineCore"),  # our ancestor (sparkwatch run inside an engine's tree)
        proc(11, 10, "sparkwatch", "sparkwatch"),
    ]
    assert find_engine_trees(table, RULES, Scope(self_pid=11, own_uid=1000)) == []


def test_ppid_cycles_from_racy_scans_terminate() -> None:
    table = [proc(10, 11, "VLLM::EngineCor", "VLLM::EngineCore"), proc(11, 10, "VLLM::Worker_TP", "VLLM::Worker")]
    find_engine_trees(table, RULES, Scope(self_pid=99, own_uid=1000))  # must not hang
