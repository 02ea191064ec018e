"""The pure parts of the telemetry: compiler census, arch parsing, burst alerts, build.ninja, JIT state."""

from __future__ import annotations

import pytest

from sparkwatch.core.engines import compile as cc
from sparkwatch.core.engines import jit
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.enums import MaxJobsState
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import CompileCensus, Proc
from sparkwatch.core.report.alerts import dedup_key, is_alerting


def proc(pid: int, ppid: int, comm: str, argv: tuple[str, ...] = (), *, rss: int = 0, state: str = "S") -> Proc:
    return Proc(pid, ppid, 0, comm, state, 100 + pid, rss, argv or (comm,))


@pytest.mark.parametrize(
    ("argv", "archs"),
    [
        (("nvcc", "-gencode", "arch=compute_121a,code=sm_121a", "-c", "x.cu"), {"121a"}),
        (("nvcc", "-gencode=arch=compute_90a,code=[sm_90a,compute_90a]"), {"90a"}),
        (("nvcc", "-arch=sm_121a", "x.cu"), {"121a"}),
        (("nvcc", "-arch", "sm_80"), {"80"}),
        (("nvcc", "--gpu-architecture=compute_100a", "--gpu-code=sm_100a"), {"100a"}),
        (("nvcc", "--generate-code", "arch=compute_120,code=sm_120"), {"120"}),
        (("cicc", "-arch", "compute_121a", "-o", "x.ptx"), {"121a"}),
        (("ptxas", "-arch=sm_121a", "-m64"), {"121a"}),
        (("nvcc", "-c", "x.cu", "-o", "sm_121a.o"), set()),  # a file name is not an arch flag
        (("nvcc", "-arch"), set()),  # truncated argv: no crash
    ],
)
def test_parse_archs(argv: tuple[str, ...], archs: set[str]) -> None:
    assert cc.parse_archs(argv) == archs


@pytest.mark.parametrize(
    ("comm", "tool"),
    [
        ("nvcc", "nvcc"),
        ("cicc", "cicc"),
        ("ptxas", "ptxas"),
        ("fatbinary", "fatbinary"),
        ("cudafe++", "cudafe++"),
        ("ninja", "ninja"),
        ("cc1plus", "cc1plus"),
        ("gcc-13", "gcc"),
        ("aarch64-linux-g", None),  # comm cut to 15 characters hides the tool: not guessed
        ("g++", "g++"),
        ("c++", "c++"),
        ("clang++-18", "clang++"),
        ("python3", None),
        ("vim", None),
        ("nvcc-wrapper", None),
    ],
)
def test_tool_of(comm: str, tool: str | None) -> None:
    assert cc.tool_of(proc(10, 1, comm)) == tool


def test_kernel_threads_are_never_compilers() -> None:
    p = Proc(10, 2, 0, "ninja", "S", 1, 0, (), is_kernel_thread=True)
    assert cc.tool_of(p) is None


def burst_tree(max_jobs: str | None, jobs: int) -> tuple[list[Proc], CompileCensus]:
    procs = [proc(1, 0, "systemd"), proc(100, 1, "VLLM::EngineCor", ("VLLM::EngineCore",))]
    if jobs:
        procs.append(proc(101, 100, "ninja"))
    for i in range(jobs):
        procs.append(proc(200 + i, 101, "nvcc", ("nvcc", "-gencode", "arch=compute_121a,code=sm_121a"), rss=1 << 30))
        procs.append(proc(300 + i, 200 + i, "cicc", ("cicc", "-arch", "compute_121a"), rss=4 << 30))
    trees = find_engine_trees(procs, EngineRules.build(), Scope(self_pid=99999, own_uid=0))
    env = {101: cc.EnvReading(None if max_jobs is None else ({"MAX_JOBS": max_jobs} if max_jobs else {}))}
    env[100] = cc.EnvReading({"HOME": "/root"})
    return procs, cc.census(procs, trees, env)


def test_census_attributes_compilers_to_the_engine() -> None:
    _procs, census = burst_tree("4", 3)
    assert census.tools["nvcc"] == 3 and census.tools["cicc"] == 3 and census.tools["ninja"] == 1
    assert census.parallel_jobs == 6
    assert census.archs == {"121a": 6}
    assert census.rss_bytes == 3 * (5 << 30)
    (engine,) = census.engines
    assert engine.root_pid == 100 and sum(engine.tools.values()) == 7
    assert (engine.max_jobs_state, engine.max_jobs, engine.max_jobs_source) == ("set", "4", "compiler")


def test_max_jobs_falls_back_when_the_compiler_environ_is_unreadable() -> None:
    _procs, census = burst_tree(None, 1)
    # ninja's environ unreadable -> the engine root's environ decides: no MAX_JOBS there.
    assert (census.engines[0].max_jobs_state, census.engines[0].max_jobs_source) == ("unset", "engine")


def test_environ_request_names_compiler_raylet_and_root() -> None:
    procs = [
        proc(1, 0, "systemd"),
        proc(50, 1, "raylet"),
        proc(60, 50, "ray::RayWorkerW", ("ray::RayWorkerWrapper.execute_method",)),
        proc(61, 60, "ninja"),
        proc(62, 61, "nvcc"),
    ]
    trees = find_engine_trees(procs, EngineRules.build(), Scope(self_pid=99999, own_uid=0))
    assert cc.environ_request(procs, trees).pids == {61: "compiler", 50: "raylet", 60: "engine"}
    env = {61: cc.EnvReading(None), 50: cc.EnvReading({"MAX_JOBS": "2"}), 60: cc.EnvReading({})}
    (engine,) = cc.census(procs, trees, env).engines
    assert (engine.max_jobs_state, engine.max_jobs, engine.max_jobs_source) == ("set", "2", "raylet")


def kinds(alerts: tuple[cc.BurstAlert, ...]) -> list[str]:
    return [a.kind for a in alerts]


def test_burst_alerts_once_per_burst_and_per_reason() -> None:
    state = cc.BurstState()
    _p, wide = burst_tree("4", 10)  # 20 jobs > 8
    _p, quiet = burst_tree("4", 0)
    state, alerts = cc.burst_step(state, wide, 8, now=0.0)
    assert kinds(alerts) == [EventKind.COMPILE_BURST]
    assert "20 parallel nvcc/cicc jobs exceed 8" in alerts[0].summary
    for t in range(1, 20):  # the same burst, second after second: silence
        state, alerts = cc.burst_step(state, wide, 8, now=float(t))
        assert alerts == ()
    _p, unset = burst_tree("", 10)
    state, alerts = cc.burst_step(state, unset, 8, now=20.0)  # MAX_JOBS now unset in the burst: said once
    assert kinds(alerts) == [EventKind.MAX_JOBS_MISSING]
    state, alerts = cc.burst_step(state, unset, 8, now=21.0)
    assert alerts == ()
    state, alerts = cc.burst_step(state, quiet, 8, now=21.0)
    state, alerts = cc.burst_step(state, wide, 8, now=25.0)  # a 4 s gap between modules: same burst
    assert alerts == ()
    state, alerts = cc.burst_step(state, quiet, 8, now=26.0)
    state, alerts = cc.burst_step(state, quiet, 8, now=26.0 + cc.BURST_QUIET_S)
    assert not state.active
    state, alerts = cc.burst_step(state, wide, 8, now=100.0)  # a new burst alerts again
    assert kinds(alerts) == [EventKind.COMPILE_BURST]


def test_max_jobs_missing_names_the_engine_even_in_a_narrow_burst() -> None:
    """Two nvcc jobs are no burst yet, but with MAX_JOBS unset the next module runs one per core: say so early."""
    _p, narrow = burst_tree("", 1)
    _state, alerts = cc.burst_step(cc.BurstState(), narrow, 8, now=0.0)
    (alert,) = alerts
    assert alert.kind == EventKind.MAX_JOBS_MISSING
    assert alert.fields["root_pid"] == 100 and alert.fields["engine"] == "vllm"
    assert alert.fields["max_jobs_source"] == "compiler" and alert.fields["parallel_jobs"] == 2
    assert "MAX_JOBS unset" in alert.summary and "MAX_JOBS=4" in alert.summary
    # the alert layer rate-limits it per engine, an hour apart
    assert is_alerting(alert.kind)
    assert dedup_key(alert.kind, alert.fields) == "max_jobs_missing:root_pid=100"


def test_max_jobs_unknown_is_never_reported_missing() -> None:
    """An environ nobody could read (another user's engine, hidepid) is not evidence: no alert on a guess."""
    procs = [proc(1, 0, "systemd"), proc(100, 1, "VLLM::EngineCor", ("VLLM::EngineCore",)), proc(101, 100, "ninja")]
    procs += [proc(200, 101, "nvcc")]
    trees = find_engine_trees(procs, EngineRules.build(), Scope(self_pid=99999, own_uid=0))
    census = cc.census(procs, trees, {101: cc.EnvReading(None), 100: cc.EnvReading(None)})
    assert census.engines[0].max_jobs_state == MaxJobsState.UNKNOWN
    assert cc.burst_step(cc.BurstState(), census, 8, now=0.0)[1] == ()


def test_narrow_burst_with_max_jobs_is_silent() -> None:
    _p, ok = burst_tree("4", 4)
    state, alerts = cc.burst_step(cc.BurstState(), ok, 8, now=0.0)
    assert alerts == () and state.active


FLASHINFER_NINJA = """ninja_required_version = 1.3
cxx = c++
nvcc = /usr/local/cuda/bin/nvcc
builddir = /home/u/.cache/flashinfer/0.4.1/121a/cached_ops/batch_prefill
cuda_cflags = -gencode=arch=compute_121a,code=sm_121a

rule cuda_compile
  command = $nvcc $cuda_cflags -c $in -o $out
  depfile = $out.d

build $builddir/batch_prefill.cuda.o: cuda_compile /src/csrc/batch_prefill.cu
build ${builddir}/batch_prefill_kernel_mask_0.cuda.o: cuda_compile $
    /src/csrc/kernel_mask_0.cu
build with$ space.o | implicit.o: cuda_compile /src/x.cu
build page.o page.h: cuda_compile /src/page.cu
build batch_prefill.so: link batch_prefill.cuda.o
"""


def test_ninja_object_targets() -> None:
    base = "/home/u/.cache/flashinfer/0.4.1/121a/cached_ops/batch_prefill"
    assert jit.ninja_object_targets(FLASHINFER_NINJA) == (
        f"{base}/batch_prefill.cuda.o",
        f"{base}/batch_prefill_kernel_mask_0.cuda.o",
        "with space.o",
        "page.o",
    )


def test_ninja_garbage_is_no_targets() -> None:
    assert jit.ninja_object_targets("\x00\xff garbage\nbuild\nbuild :\n") == ()


def obs(compilers: int = 0, pipe: bool = False, asleep: bool = True) -> jit.EngineObservation:
    return jit.EngineObservation("vllm", 100, 5, compilers, pipe_waiting=pipe, all_asleep=asleep)


def test_jit_state_compiling_idle_stalled() -> None:
    params = jit.JitParams(stall_s=60, settle_s=5)
    tracks: dict[tuple[int, int], jit.JitTrack] = {}
    tracks, states, changes = jit.jit_step(tracks, [obs()], False, params, 0.0)
    assert states[0].state == jit.IDLE and not changes  # never compiled: idle, silently
    tracks, states, changes = jit.jit_step(tracks, [obs(compilers=7)], False, params, 1.0)
    assert states[0].state == jit.COMPILING and changes[0].new == jit.COMPILING
    tracks, states, _ = jit.jit_step(tracks, [obs(pipe=True)], False, params, 3.0)
    assert states[0].state == jit.COMPILING  # within settle_s
    tracks, states, _ = jit.jit_step(tracks, [obs(pipe=True)], True, params, 30.0)  # cache growing
    assert states[0].state == jit.COMPILING
    tracks, states, changes = jit.jit_step(tracks, [obs(pipe=True)], False, params, 40.0)
    assert states[0].state == jit.IDLE and changes[0].new == jit.IDLE
    tracks, states, changes = jit.jit_step(tracks, [obs(pipe=True)], False, params, 95.0)
    assert states[0].state == jit.STALLED and changes[0].kind == "vllm" and changes[0].new == jit.STALLED
    assert states[0].since_ts == 95.0
    tracks, states, changes = jit.jit_step(tracks, [obs(pipe=True)], False, params, 96.0)
    assert states[0].state == jit.STALLED and not changes and states[0].since_ts == 95.0
    tracks, states, changes = jit.jit_step(tracks, [obs(compilers=1)], False, params, 97.0)
    assert states[0].state == jit.COMPILING and changes[0].old == jit.STALLED


def test_idle_server_in_epoll_is_never_stalled() -> None:
    params = jit.JitParams(stall_s=60)
    tracks, _, _ = jit.jit_step({}, [obs(compilers=3)], False, params, 0.0)
    tracks, states, _ = jit.jit_step(tracks, [obs(pipe=False)], False, params, 1000.0)
    assert states[0].state == jit.IDLE


def test_gone_engines_are_dropped() -> None:
    params = jit.JitParams(stall_s=60)
    tracks, _, _ = jit.jit_step({}, [obs(compilers=3)], False, params, 0.0)
    tracks, states, changes = jit.jit_step(tracks, [], False, params, 1.0)
    assert tracks == {} and states == () and changes == ()


def test_a_fork_before_exec_is_not_a_second_job() -> None:
    nvcc_argv = ("nvcc", "-gencode", "arch=compute_121a,code=sm_121a", "-c", "a.cu")
    procs = [proc(1, 0, "systemd"), proc(10, 1, "nvcc", nvcc_argv), proc(11, 10, "nvcc", nvcc_argv)]
    census = cc.census(procs, [], {})
    assert census.tools["nvcc"] == 1 and census.parallel_jobs == 1
    # caught inside execve: the new program's command line, the parent's name still; and, once renamed, a cicc
    cicc_argv = ("/usr/local/cuda/nvvm/bin/cicc", "--c++17", "-arch", "compute_121a", "a.cpp1.ii")
    for name, tools in (("nvcc", {"nvcc": 1}), ("cicc", {"nvcc": 1, "cicc": 1})):
        census = cc.census([*procs[:2], proc(11, 10, name, cicc_argv)], [], {})
        assert {t: n for t, n in census.tools.items() if n} == tools
    # the parent read while it was still the wrapper script (`/bin/sh /usr/local/bin/nvcc …`, comm nvcc), its fork
    # read after its exec of the real nvcc: one job
    wrapper = proc(10, 1, "nvcc", ("/bin/sh", "/usr/local/bin/nvcc", *nvcc_argv[1:]))
    census = cc.census([procs[0], wrapper, proc(11, 10, "nvcc", ("/usr/local/cuda/bin/nvcc", *nvcc_argv[1:]))], [], {})
    assert census.tools["nvcc"] == 1


def test_a_busy_gpu_is_never_stalled() -> None:
    params = jit.JitParams(stall_s=60)
    busy = jit.EngineObservation("vllm", 100, 5, 0, pipe_waiting=True, all_asleep=True, gpu_busy=True)
    tracks, _, _ = jit.jit_step({}, [obs(compilers=3)], False, params, 0.0)
    tracks, states, _ = jit.jit_step(tracks, [busy], False, params, 1000.0)
    assert states[0].state == jit.IDLE
    tracks, states, _ = jit.jit_step(tracks, [obs(pipe=True)], False, params, 1030.0)
    assert states[0].state == jit.IDLE  # the stall clock restarted when the GPU last worked
    tracks, states, _ = jit.jit_step(tracks, [obs(pipe=True)], False, params, 1061.0)
    assert states[0].state == jit.STALLED


def test_another_users_test_runner_is_not_flagged_for_max_jobs() -> None:
    """Issue 20: as root, another user's `python -m pytest` whose tests start processes titled VLLM::EngineCore and
    compile with nvcc was adopted as a vllm engine and flagged max_jobs_missing. Without vLLM's library mapped it is
    no engine: its compilers are nobody's engine's, and nothing is announced for it."""
    procs = [
        proc(1, 0, "systemd"),
        Proc(500, 1, 1001, "python3", "S", 600, 0, ("/usr/bin/python3", "-m", "pytest", "tests/")),
        Proc(501, 500, 1001, "VLLM::EngineCor", "S", 601, 0, ("VLLM::EngineCore",)),
        Proc(502, 500, 1001, "ninja", "S", 602, 0, ("ninja",)),
        Proc(503, 502, 1001, "nvcc", "S", 603, 1 << 30, ("nvcc", "-gencode", "arch=compute_121a,code=sm_121a")),
    ]
    trees = find_engine_trees(procs, EngineRules.build(), Scope(self_pid=99999, own_uid=0))
    assert [t.root.pid for t in trees] == [501]  # the fake EngineCore is its own tree; pytest is no engine
    census = cc.census(procs, trees, {502: cc.EnvReading({}), 500: cc.EnvReading({})})
    _state, alerts = cc.burst_step(cc.BurstState(), census, jobs_alert=8, now=0.0)
    assert all(a.kind != EventKind.MAX_JOBS_MISSING for a in alerts), alerts
