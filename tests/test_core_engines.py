"""Engine identity: by what a process is, never by a substring of its command line."""

from __future__ import annotations

import signal

import pytest

from sparkwatch.core.engines.identity import (
    EngineRules,
    Scope,
    engine_kind,
    entry_point,
    find_engine_trees,
    is_infrastructure,
    is_protected,
    may_touch,
    parent_wants_maps,
    unknown_gpu_holders,
    wants_parent_maps,
)
from sparkwatch.core.model import Proc

RULES = EngineRules.build()


def proc(
    pid: int,
    ppid: int,
    comm: str,
    *argv: str,
    uid: int = 1000,
    kthread: bool = False,
    exe: str | None = None,
    cgroup: str | None = None,
    lib: str | None = None,
) -> Proc:
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
        exe=exe,
        cgroup=cgroup,
        engine_lib=lib,
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
        ("MYAPP::EngineC", ("MYAPP::EngineCore_DP1",), "vllm"),  # VLLM_PROCESS_NAME_PREFIX=MYAPP
        ("acme::Worker_T", ("acme::Worker_TP1_PP0",), "vllm"),
        ("vllm", ("/venv/bin/vllm", "run-batch", "-i", "in.jsonl", "-o", "out.jsonl"), "vllm"),
        ("python3", ("python3", "-m", "vllm.entrypoints.cli.main", "serve", "m"), "vllm"),
        ("sgl_diffusion::", ("sgl_diffusion::scheduler_TP0",), "sglang"),
        ("sglang", ("/venv/bin/python3", "/venv/bin/sglang", "generate", "--model-path", "m"), "sglang"),
        ("python3", ("python3", "-m", "tensorrt_llm.llmapi.mgmn_worker_node"), "trtllm"),
        ("python3", ("python3", "-m", "tensorrt_llm.llmapi.mgmn_leader_node"), "trtllm"),
        ("rpc-server", ("./build/bin/rpc-server", "-p", "50052"), "llama.cpp"),
        ("python3", ("python3", "-m", "llama_cpp.server", "--model", "x.gguf"), "llama.cpp"),
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
        ("vllm", ("/venv/bin/python3", "/venv/bin/vllm", "bench", "serve", "--model", "m")),
        ("python3", ("python3", "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--model", "m")),
        ("python3", ("python3", "-m", "sglang.bench_serving", "--backend", "sglang")),
        ("trtllm-bench", ("/usr/local/bin/trtllm-bench", "--model", "m", "throughput")),
        ("pip", ("/venv/bin/python3", "/venv/bin/pip", "install", "vllm")),
        ("journalctl", ("journalctl", "-u", "vllm", "-f")),
        ("nano", ("nano", "VLLM::EngineCore")),
        ("python3", ("python3", "-m", "mpi4py.futures.server")),  # a generic MPI worker with no engine library
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
        proc(700, 600, "tmux: server", "tmux", exe="/usr/bin/tmux"),
        proc(1000, 600, "vllm", "/venv/bin/python3", "/venv/bin/vllm", "serve", "m"),
        proc(1001, 1000, "VLLM::EngineCor", "VLLM::EngineCore"),
        proc(1002, 1001, "raylet", "/venv/lib/ray/raylet"),
        proc(1003, 1002, "ray::RayWorkerW", "ray::RayWorkerWrapper"),
        proc(1004, 1003, "ninja", "ninja", "-v", "-j", "20"),
        proc(1005, 1004, "nvcc", "nvcc", "-gencode", "arch=compute_121a,code=sm_121a"),
        proc(1006, 1005, "cicc", "cicc"),
        proc(1007, 1000, "tmux: server", "tmux", "new", "-d", exe="/usr/bin/tmux"),  # a real tmux: protected
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
    # The raylet vLLM started is passed through (never a victim); the Ray worker and its compilers below are members.
    assert by_root[1000].pids == (1000, 1001, 1003, 1004, 1005, 1006)
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

    def looped(_signum: int, _frame: object) -> None:
        raise TimeoutError("find_engine_trees still walking a ppid cycle after 5 s")

    # A loop would hang the suite rather than fail it: an interval timer turns it into this test's failure.
    previous = signal.signal(signal.SIGALRM, looped)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        trees = find_engine_trees(table, RULES, Scope(self_pid=99, own_uid=1000))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert trees == []  # a cycle has no root: nothing to rank or kill until a scan sees the real parents


def test_protection_is_by_executable_and_unit_not_by_name() -> None:
    spoof = proc(10, 1, "sshd", "sshd", exe="/home/u/bin/sshd")  # a copy in the user's home: judged like any other
    assert not is_protected(spoof, RULES)
    assert is_protected(proc(11, 1, "sshd", "sshd: u [priv]", uid=0, exe="/usr/sbin/sshd"), RULES)
    assert is_protected(proc(12, 1, "sshd", "sshd", exe="/usr/sbin/sshd (deleted)"), RULES)  # after an upgrade
    assert is_protected(proc(13, 1, "x", "x", cgroup="/system.slice/ssh.service"), RULES)
    # A user unit of the same name is the user's own cgroup: not protected.
    assert not is_protected(
        proc(14, 1, "x", "x", cgroup="/user.slice/user-1000.slice/user@1000.service/app.slice/ssh.service"), RULES
    )
    # An engine titled like a protected process is still an engine and its tree is found.
    table = [
        proc(100, 1, "sshd", "/venv/bin/python3", "/venv/bin/vllm", "serve", "m", exe="/venv/bin/python3.12"),
        proc(101, 100, "tmux: server", "tmux: server", exe="/venv/bin/python3.12"),
    ]
    trees = find_engine_trees(table, RULES, Scope(self_pid=5, own_uid=1000))
    assert [t.pids for t in trees] == [(100, 101)]


def test_user_protect_patterns_match_the_executable_path() -> None:
    rules = EngineRules.build(protect_patterns=[r"^/opt/precious/"])
    assert is_protected(proc(5, 1, "llama-server", "llama-server", exe="/opt/precious/llama-server"), rules)
    assert not is_protected(proc(6, 1, "llama-server", "llama-server", exe="/opt/other/llama-server"), rules)


def test_ray_infrastructure_is_never_a_victim() -> None:
    for comm, argv in [
        ("raylet", ("/venv/lib/python3.12/site-packages/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=x")),
        ("gcs_server", ("/venv/lib/python3.12/site-packages/ray/core/src/ray/gcs/gcs_server", "--gcs_server_port=1")),
        ("ray::Dashboard", ("ray::DashboardAgent",)),
        ("ray::RuntimeEn", ("ray::RuntimeEnvAgent",)),
        ("ray::IDLE_Spil", ("ray::IDLE_SpillWorker",)),
        ("ray::RestoreWo", ("ray::RestoreWorker",)),
        ("python3", ("/venv/bin/python3", "/venv/lib/python3.12/site-packages/ray/_private/log_monitor.py", "--x")),
        ("python3", ("/venv/bin/python3", "-u", "/venv/lib/python3.12/site-packages/ray/dashboard/dashboard.py")),
    ]:
        p = proc(50, 1, comm, *argv)
        assert engine_kind(p, RULES) is None, argv
        assert is_infrastructure(p, RULES), argv
        assert not may_touch(p, RULES, Scope(self_pid=5, own_uid=1000))
    # A user's own monitor.py is neither.
    assert not is_infrastructure(proc(51, 1, "python3", "python3", "/home/u/monitor.py"), RULES)
    assert engine_kind(proc(52, 1, "ray::IDLE", "ray::IDLE"), RULES) == "ray"


VLLM_C = "/venv/lib/python3.12/site-packages/vllm/_C.abi3.so"
SGL_KERNEL = "/venv/lib/python3.12/site-packages/sgl_kernel/sm100/common_ops.abi3.so"


def test_offline_llm_script_parents_are_adopted_only_with_the_engines_library_mapped() -> None:
    table = [
        proc(600, 1, "bash", "-bash", exe="/usr/bin/bash"),
        proc(700, 600, "python3", "/venv/bin/python3", "offline.py", "--model", "m", lib=VLLM_C),
        proc(701, 700, "VLLM::EngineCor", "VLLM::EngineCore"),
        proc(702, 701, "VLLM::Worker_TP", "VLLM::Worker_TP0"),
        proc(750, 600, "python3", "python3", "sgl_offline.py", lib=SGL_KERNEL),
        proc(751, 750, "sglang::schedul", "sglang::scheduler_TP0"),
        # a shell that somehow parents an EngineCore is never adopted
        proc(800, 600, "bash", "bash", "run.sh", exe="/usr/bin/bash"),
        proc(801, 800, "VLLM::EngineCor", "VLLM::EngineCore"),
        # nor a supervisor written in Python
        proc(900, 1, "supervisord", "/usr/bin/python3", "/usr/bin/supervisord", "-n"),
        proc(901, 900, "sglang::schedul", "sglang::scheduler_TP0"),
        # nor a test runner whose tests start processes titled like engines (no engine library mapped)
        proc(1000, 600, "python3", "/venv/bin/python3", "-m", "pytest", "-x", "tests/"),
        proc(1001, 1000, "VLLM::EngineCor", "VLLM::EngineCore"),
        proc(1002, 1000, "bash", "bash", "-c", "sleep 1", exe="/usr/bin/bash"),
        # nor a parent mapping another engine's library than its child's
        proc(1100, 600, "python3", "python3", "mixed.py", lib=SGL_KERNEL),
        proc(1101, 1100, "VLLM::EngineCor", "VLLM::EngineCore"),
    ]
    trees = {t.root.pid: t for t in find_engine_trees(table, RULES, Scope(self_pid=5, own_uid=1000))}
    assert set(trees) == {700, 750, 801, 901, 1001, 1101}
    assert trees[700].kind == "vllm" and trees[700].pids == (700, 701, 702)
    assert trees[750].kind == "sglang" and trees[750].pids == (750, 751)
    assert trees[1001].pids == (1001,)


def test_which_parents_the_scanner_reads_maps_for() -> None:
    """Only the plain Python parent of an adopting shape is worth a maps read; nothing for anyone else."""
    assert wants_parent_maps("VLLM::EngineCor", ("VLLM::EngineCore",))
    assert wants_parent_maps("sglang::schedul", ("sglang::scheduler_TP0",))
    assert not wants_parent_maps("VLLM::Worker_TP", ("VLLM::Worker_TP0",))
    assert not wants_parent_maps("python3", ("python3", "train.py"))
    assert parent_wants_maps(proc(3, 1, "python3", "python3", "-m", "pytest"))
    assert not parent_wants_maps(proc(3, 1, "python3", "python3", "offline.py", lib=VLLM_C))  # already read
    assert not parent_wants_maps(proc(3, 1, "vllm", "/venv/bin/python3", "/venv/bin/vllm", "serve", "m"))
    assert not parent_wants_maps(proc(3, 1, "bash", "bash", "run.sh"))
    assert not parent_wants_maps(proc(3, 1, "supervisord", "/usr/bin/python3", "/usr/bin/supervisord"))


def test_llama_server_under_ollama_is_ollama() -> None:
    table = [
        proc(700, 1, "ollama", "/usr/local/bin/ollama", "serve"),
        proc(701, 700, "llama-server", "/usr/local/lib/ollama/llama-server", "--model", "/x/blobs/sha256-1"),
        proc(800, 1, "llama-server", "/opt/llama.cpp/build/bin/llama-server", "-m", "x.gguf"),
    ]
    kinds = {t.root.pid: t.kind for t in find_engine_trees(table, RULES, Scope(self_pid=5, own_uid=1000))}
    assert kinds == {701: "ollama", 800: "llama.cpp"}


def test_generic_mpi_workers_need_an_engine_library_or_an_engine_parent() -> None:
    lib = "/venv/lib/python3.12/site-packages/tensorrt_llm/libs/libtensorrt_llm.so"
    table = [
        proc(700, 1, "orted", "orted", "--singleton"),
        proc(701, 700, "python3", "python3", "-m", "mpi4py.futures.server", lib=lib),
        proc(702, 700, "python3", "python3", "-m", "mpi4py.futures.server"),  # a scientist's own MPI job
        proc(800, 1, "trtllm-serve", "/usr/local/bin/trtllm-serve", "serve", "m"),
        proc(801, 800, "python3", "python3", "-m", "mpi4py.futures.server"),
    ]
    trees = {t.root.pid: t for t in find_engine_trees(table, RULES, Scope(self_pid=5, own_uid=1000))}
    assert set(trees) == {701, 800}
    assert trees[701].kind == "trtllm"
    assert trees[800].pids == (800, 801)


def test_unknown_gpu_holders_are_listed_and_opt_in_makes_them_engines() -> None:
    table = [
        proc(700, 1, "python3", "python3", "train.py"),
        proc(800, 1, "llama-server", "llama-server", "-m", "x.gguf"),
        proc(900, 1, "raylet", "/x/ray/raylet"),
    ]
    used = {700: 5 << 30, 800: 20 << 30, 900: None, 12345: 1 << 30}
    trees = find_engine_trees(table, RULES, Scope(self_pid=5, own_uid=1000))
    holders = unknown_gpu_holders(table, trees, used, RULES)
    assert [(h.proc.pid, h.used_gpu_memory_bytes) for h in holders] == [(700, 5 << 30)]
    opted = EngineRules.build(gpu_holders_are_engines=True)
    keys = {p.key for p in table if p.pid in used}
    trees = find_engine_trees(table, opted, Scope(self_pid=5, own_uid=1000), gpu_holders=keys)
    assert {t.root.pid: t.kind for t in trees} == {700: "gpu", 800: "llama.cpp"}


def test_may_touch_excludes_ancestors_given_by_the_killer() -> None:
    p = proc(77, 1, "bash", "bash")
    assert may_touch(p, RULES, Scope(self_pid=5, own_uid=1000))
    assert not may_touch(p, RULES, Scope(self_pid=5, own_uid=1000, self_ancestors=frozenset({77})))
    assert not may_touch(p, RULES, Scope(self_pid=5, own_uid=1000), untouchable={77})


def test_a_launched_roots_orphans_stay_in_its_tree_and_the_launcher_never_joins() -> None:
    """A worker that double-forked (setsid) is reparented to `sparkwatch launch` (the subreaper) or stays in launch's
    scope: it is the declared root's, so it is counted and killed with it. Only for the declared launcher (same uid,
    really the root's parent) and only the scope the root is in."""
    scope_cg = "/user.slice/user-1000.slice/user@1000.service/app.slice/sparkwatch-launch-50.scope"
    procs = [
        proc(50, 10, "python3", "python3", "-m", "sparkwatch", "launch", "--", "vllm", "serve", "m"),  # the launcher
        proc(60, 50, "vllm", "/venv/bin/vllm", "serve", "m", cgroup=scope_cg),  # the declared root
        proc(61, 50, "python3", "python3", "worker.py"),  # double-forked, reparented to the subreaper
        proc(62, 61, "python3", "python3", "worker.py"),  # and its own child
        proc(70, 1, "VLLM::EngineCor", "VLLM::EngineCore_DP0", cgroup=scope_cg),  # left the tree, still in the scope
        proc(80, 1, "python3", "python3", "elsewhere.py"),  # nobody's
    ]
    declared = {(60, 600): ("vllm", 1000)}
    scope = Scope(self_pid=999, own_uid=1000)
    (tree,) = find_engine_trees(procs, RULES, scope, declared=declared, launchers={(60, 600): 50})
    assert tree.root.pid == 60 and sorted(tree.pids) == [60, 61, 62, 70]
    # Without the launcher's word only the scope adopts; a launcher that is not the root's parent adopts nothing.
    (tree,) = find_engine_trees(procs, RULES, scope, declared=declared)
    assert sorted(tree.pids) == [60, 70]
    (tree,) = find_engine_trees(procs[:-2] + procs[-1:], RULES, scope, declared=declared, launchers={(60, 600): 10})
    assert sorted(tree.pids) == [60]
    # Only the declaring uid's processes are adopted, even by a guard that runs as root.
    mixed = [*procs[:3], proc(63, 50, "python3", "python3", "sudo-child.py", uid=0)]
    (tree,) = find_engine_trees(
        mixed, RULES, Scope(self_pid=999, own_uid=0), declared=declared, launchers={(60, 600): 50}
    )
    assert sorted(tree.pids) == [60, 61]
    # Another user's launcher is no one's word.
    other = [proc(50, 10, "python3", "python3", "x.py", uid=0), *procs[1:4]]
    (tree,) = find_engine_trees(
        other, RULES, Scope(self_pid=999, own_uid=0), declared=declared, launchers={(60, 600): 50}
    )
    assert sorted(tree.pids) == [60]
