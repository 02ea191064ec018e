"""`sparkwatch launch` end to end with real processes: the gate, the pass-through, the phases, the environment, the
exit code, Ctrl-C, a guard kill on the terminal, and the gate against real page cache.

The engine is tests/helpers/boot_engine.py behind a `vllm` script on PATH: launch recognises `vllm serve DIR` as
vLLM does, and the stand-in prints vLLM's own log lines and allocates real memory per phase.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common import guardfile
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.core.report.guardstate import GuardState, KillWord
from tests.conftest import alive
from tests.launchbox import (
    BOOT_ENGINE,
    Box,
    GiB,
    box_for,
    fitting_util,
    small_args,
    small_model,
    total_bytes,
    wait_ready,
)


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    yield from box_for(tmp_path)


def test_a_sparse_model_larger_than_the_machine_is_refused_before_anything_starts(box: Box, tmp_path: Path) -> None:
    model = tmp_path / "huge"
    model.mkdir()
    shards = 40
    each = 2 * total_bytes() // shards
    for i in range(shards):
        with open(model / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as fh:
            fh.truncate(each)  # sparse: 2x the machine, no disk used, never read
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 80, "num_attention_heads": 64,
                                                    "num_key_value_heads": 8, "hidden_size": 8192}))  # fmt: skip
    started = time.monotonic()
    proc = box.launch("--", "vllm", "serve", str(model))
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 75, err.decode()
    line = err.decode().strip().splitlines()[-1]
    assert "does not fit" in line and "fix:" in line, line
    assert not box.marker.exists()  # the command never ran
    assert box.declarations() == []
    assert out == b""
    plan = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "launch", "--plan", "--json", "--", "vllm", "serve", str(model)],
        env=box.env, capture_output=True, check=False, timeout=60,
    )  # fmt: skip
    assert plan.returncode == 1
    data = json.loads(plan.stdout)
    assert data["fits"] is False and data["weight_files"] == shards
    assert data["needs_bytes"] > data["available_bytes"]
    assert {t["name"] for t in data["terms"]} >= {"weights", "kv_cache", "activation_peak", "cuda_graphs",
                                                  "jit_workers", "runtime_overhead"}  # fmt: skip
    assert data["plan_seconds"] < 1.0  # the plan itself; the whole refusal, interpreter start included:
    assert took < 30


def test_force_starts_what_the_plan_refuses_and_says_so(box: Box, tmp_path: Path) -> None:
    """--force: the owner's word over the plan. The same command is refused without it and starts with it; the
    stand-in touches only 16 MiB whatever the utilization says."""
    args = small_args(small_model(tmp_path), 0.95)  # 95 % of MemTotal: more than the box has available
    engine = ["--phase-mib", "loading_weights=16", "--phase-s", "0.1", "--serve-s", "0.3"]
    refused = box.launch("--", *args, *engine)
    _out, err = refused.communicate(timeout=60)
    assert refused.returncode == 75, err.decode()
    assert not box.marker.exists()
    forced = box.launch("--force", "--", *args, *engine)
    _out, err = forced.communicate(timeout=90)
    assert forced.returncode == 0, err.decode()
    assert "does not fit" in err.decode() and "--force: starting anyway" in err.decode()
    assert box.marker.exists()  # the command ran
    assert [d["exit_code"] for d in box.declarations()] == [0]


def _normalise(text: bytes) -> list[str]:
    out = re.sub(rb"pid=\d+", b"pid=N", text)
    out = re.sub(rb"\d\d-\d\d \d\d:\d\d:\d\d", b"TS", out)
    return out.decode().splitlines()


def test_a_fitting_engine_starts_its_output_passes_through_and_its_exit_code_comes_back(
    box: Box, tmp_path: Path
) -> None:
    model = small_model(tmp_path)
    args = small_args(model, fitting_util())
    engine = ["--phase-mib", "loading_weights=64,profiling=32", "--phase-s", "0.3", "--serve-s", "1.5",
              "--exit-code", "3"]  # fmt: skip
    proc = box.launch("--", *args, *engine)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 3, err.decode()
    direct = subprocess.run(
        [sys.executable, str(BOOT_ENGINE), "--kind", "vllm", "serve", str(model), *engine],
        capture_output=True, check=False, timeout=60,
    )  # fmt: skip
    assert _normalise(out) == _normalise(direct.stdout)  # stdout unchanged, byte for byte but pids and times
    decls = box.declarations()
    assert len(decls) == 1
    decl = decls[0]
    phases = [p for p, _t in decl["phases"]]
    assert phases == ["starting", "loading_weights", "profiling", "jit_compile", "profiling", "cuda_graphs",
                      "ready", "exited"]  # fmt: skip
    assert decl["exit_code"] == 3 and decl["exit_signal"] is None and decl["ready_s"] is not None
    peaks = json.loads((box.state / "peaks.json").read_text())["peaks"]
    (record,) = peaks.values()
    assert record["runs"] == 1 and record["recent"][0] >= 64 << 20  # at least what it touched
    assert "phase cuda_graphs" in err.decode() and "is ready after" in err.decode()
    # One run is one sample: the next plan keeps the estimate and shows what was measured beside it.
    data = plan_json(box, args)
    assert data["learned"] is None and data["needs_bytes"] == data["estimate_bytes"]
    assert data["measured_peaks_bytes"] == record["recent"]


def plan_json(box: Box, args: list[str]) -> dict[str, Any]:
    again = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "launch", "--plan", "--json", "--", *args],
        env=box.env, capture_output=True, check=False, timeout=60,
    )  # fmt: skip
    data: dict[str, Any] = json.loads(again.stdout)
    return data


def test_a_peak_replaces_the_estimate_only_after_two_runs_agree_and_forget_resets_it(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    args = small_args(model, fitting_util())
    engine = ["--phase-mib", "loading_weights=64,profiling=32", "--phase-s", "0.2", "--serve-s", "2.5"]
    for run in (1, 2):
        proc = box.launch("-q", "--", *args, *engine)
        _out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err.decode()
        data = plan_json(box, args)
        if run == 1:  # one run: the estimate stands
            assert data["learned"] is None and data["needs_bytes"] == data["estimate_bytes"]
        assert len(data["measured_peaks_bytes"]) == run
    first, second = data["measured_peaks_bytes"]
    assert max(first, second) <= 1.25 * min(first, second)  # the same stand-in twice: the runs agree
    # Two agreeing runs: the measured peak replaces the estimate (far above what the stand-in took).
    assert data["learned"]["peak_bytes"] == data["needs_bytes"] == max(first, second)
    assert data["learned"]["estimate_error"] > 0
    # --forget KEY: the estimate stands again; a second --forget has nothing to drop (exit 1, one line).
    forget = [sys.executable, "-m", "sparkwatch", "launch", "--forget", data["key"]]
    done = subprocess.run(forget, env=box.env, capture_output=True, check=False, timeout=60)
    assert done.returncode == 0 and "forgot the peaks learned for" in done.stderr.decode()
    data = plan_json(box, args)
    assert data["learned"] is None and data["measured_peaks_bytes"] == []
    assert data["needs_bytes"] == data["estimate_bytes"]
    again = subprocess.run(forget, env=box.env, capture_output=True, check=False, timeout=60)
    assert again.returncode == 1 and again.stderr.decode().count("\n") == 1
    assert "no peak was learned for" in again.stderr.decode()


def test_the_users_max_jobs_is_kept_and_what_was_set_is_printed(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    env = {**box.env, "MAX_JOBS": "1"}
    env_out = tmp_path / "env.txt"
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0", "--serve-s", "0",
                      "--env-out", str(env_out), env=env)  # fmt: skip
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    seen = dict(line.split("=", 1) for line in env_out.read_text().splitlines())
    assert seen["MAX_JOBS"] == "1"
    assert seen["RAY_memory_monitor_refresh_ms"] == "0" and seen["FLASHINFER_NVCC_THREADS"] == "1"
    text = err.decode()
    assert "kept yours: MAX_JOBS=1" in text and "set " in text and "RAY_memory_monitor_refresh_ms=0" in text


def test_ctrl_c_reaches_the_whole_tree_and_leaves_no_process_behind(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    # A worker that ignores SIGINT (busy mid-allocation): launch must still end it.
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.1", "--ignore-int",
                      "--pidfile", str(box.pidfile), start_new_session=True)  # fmt: skip
    try:
        wait_ready(box)
        pids = box.pids()
        assert len(pids) == 2 and all(alive(p, t) for p, t in pids)
        os.kill(proc.pid, signal.SIGINT)  # what the terminal sends launch (the engine has its own process group)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 5
    while any(alive(p, t) for p, t in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p, t) for p, t in pids), err.decode()
    assert proc.returncode == 130, err.decode()
    assert "sent SIGINT" in err.decode()


def test_a_guard_kill_is_reported_on_the_terminal_with_its_reason(box: Box, tmp_path: Path) -> None:
    """launch learns of the kill from the guard's published state (common.guardfile), keyed by its declaration:
    a live process stands in for the guard, and no events.jsonl exists anywhere launch could look."""
    model = small_model(tmp_path)
    guard = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.05", "--pidfile", str(box.pidfile))
    try:
        decl = wait_ready(box)
        root, ticks = int(decl["root_pid"]), int(decl["start_ticks"])
        # The guard's word (guard.poolwatch has it published right after its signals): then the signal.
        summary = f"Killed vllm (root pid {root}, 2 processes): footprint 9.1 GiB over its budget 8.0 GiB."
        guard_ticks = read_start_ticks("/proc", guard.pid)
        assert guard_ticks is not None
        state = GuardState(guard.pid, guard_ticks, os.geteuid(), False, 1 << 30, 0, 0, ((root, ticks),), time.time(),
                           kills=(KillWord(root, ticks, "budget", summary, False),))  # fmt: skip
        guardfile.write(box.run_dir / "sparkwatch", state)
        os.kill(root, signal.SIGKILL)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        guard.kill()
        guard.wait(10)
    assert proc.returncode == 137
    line = next(x for x in err.decode().splitlines() if "the guard killed" in x)
    assert line == f"sparkwatch: the guard killed vllm (pid {root}), trigger budget: {summary}"
    assert not (box.state / "events.jsonl").exists()


def test_a_kill_that_is_not_the_guards_says_so(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.05", "--pidfile", str(box.pidfile))
    try:
        decl = wait_ready(box)
        os.kill(int(decl["root_pid"]), signal.SIGKILL)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 137
    assert "no sparkwatch kill event names it" in err.decode()


@pytest.mark.pressure
def test_the_gate_holds_against_real_page_cache(box: Box, tmp_path: Path) -> None:
    """A file written just before launch is page cache: reclaimable for an engine that reads MemAvailable, used for
    one that reads MemFree (cudaMemGetInfo on a GB10, unslothai/unsloth#10704)."""
    with MeminfoReader() as r:
        before = r.read()
    size = min(6 * GiB, before.available_bytes // 3)
    path = tmp_path / "page-cache.bin"
    block = os.urandom(1 << 20)
    with open(path, "wb") as fh:
        for _ in range(size >> 20):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())  # clean page cache: the kernel may drop it, nobody must write it back first
    try:
        with MeminfoReader() as r:
            mem = r.read()
        assert mem.available_bytes - mem.free_bytes >= size // 2, "the file did not stay in the page cache"
        # vLLM wants utilization × total free; put that between MemFree and MemAvailable, half the file from each
        target = mem.free_bytes + (mem.available_bytes - mem.free_bytes) // 2
        util = target / mem.total_bytes
        model = small_model(tmp_path)
        base = [sys.executable, "-m", "sparkwatch", "launch", "--plan", "--json", "--margin", "0"]
        args = ["--", "vllm", "serve", str(model), "--gpu-memory-utilization", f"{util:.4f}", "--enforce-eager"]
        plans = {}
        for reads in ("MemAvailable", "MemFree"):
            done = subprocess.run([*base, "--engine-reads", reads, *args], env={**box.env, "MAX_JOBS": "1"},
                                  capture_output=True, check=False, timeout=60)  # fmt: skip
            plans[reads] = json.loads(done.stdout)
        assert plans["MemAvailable"]["engine_check"]["ok"] is True, plans["MemAvailable"]
        assert plans["MemFree"]["engine_check"]["ok"] is False, plans["MemFree"]
        assert plans["MemFree"]["fits"] is False
        assert plans["MemFree"]["fixes"][0]["action"] == "drop_caches"
    finally:
        path.unlink()


def test_a_command_that_is_no_known_engine_needs_a_budget(box: Box) -> None:
    proc = box.launch("--", sys.executable, "-c", "pass")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--budget" in err.decode()
    proc = box.launch("--budget", "64MiB", "-q", "--", sys.executable, "-c", "raise SystemExit(4)")
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err.decode()


def test_launch_waits_while_memory_is_still_coming_back_and_shmem_is_released(box: Box, tmp_path: Path) -> None:
    """A teardown hands memory back (MemAvailable climbs, Shmem falls): launch settles first, then plans and starts.
    A fixture proc root (meminfo only, no processes) this test rewrites; the quiet period is core.launch.settle's
    5 s."""
    from tests.conftest import rewrite_in_place

    root = tmp_path / "proc"
    root.mkdir()

    def meminfo(avail_gib: int, shmem_gib: int) -> None:
        rewrite_in_place(
            root / "meminfo",
            f"MemTotal:       {127600748:>12} kB\nMemFree:        {avail_gib << 20:>12} kB\n"
            f"MemAvailable:   {avail_gib << 20:>12} kB\nCached:         {1000000:>12} kB\n"
            f"Shmem:          {shmem_gib << 20:>12} kB\n",
        )

    meminfo(60, 20)
    marker = tmp_path / "started"
    cmd = [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"]
    proc = box.launch("--proc-root", str(root), "--settle-timeout", "30", "--budget", "64MiB", "--", *cmd)
    # launch's own --settle-timeout 0 from Box comes first; the later one wins (argparse): 30 s here.
    try:
        for step in range(1, 7):  # 3 s of a teardown: +4 GiB available and -3 GiB shmem every 0.5 s
            time.sleep(0.5)
            assert not marker.exists(), "started while memory was still coming back"
            meminfo(60 + 4 * step, max(20 - 3 * step, 2))
        climb_done = time.monotonic()
        while not marker.exists() and proc.poll() is None:
            time.sleep(0.05)
        started_at = time.monotonic()
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err.decode()
    assert started_at - climb_done >= 4.0  # the quiet period after the last change
    assert "settling" in err.decode() and "steady" in err.decode()
