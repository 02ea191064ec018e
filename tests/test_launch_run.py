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

from sparkwatch.common.events import EventLog, make_event
from sparkwatch.common.sources.meminfo import MeminfoReader
from tests.conftest import ROOT, alive

BOOT_ENGINE = ROOT / "tests" / "helpers" / "boot_engine.py"
GiB = 1 << 30


class Box:
    """A private PATH, runtime dir and state dir for one launch test."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.run_dir = tmp / "run"
        self.run_dir.mkdir()
        self.state = tmp / "state"
        self.marker = tmp / "engine-ran"
        self.pidfile = tmp / "pids"
        (self.bin / "vllm").write_text(
            f'#!/bin/sh\necho started > {self.marker}\nexec {sys.executable} {BOOT_ENGINE} --kind vllm "$@"\n'
        )
        (self.bin / "vllm").chmod(0o755)

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKWATCH_", "MAX_JOBS", "PYTHONUNBUFFERED"))}
        env.update(
            PATH=f"{self.bin}:{env.get('PATH', '')}",
            XDG_RUNTIME_DIR=str(self.run_dir),
            SPARKWATCH_STATE_DIR=str(self.state),
            SPARKWATCH_FLOOR="256MiB",
        )
        return env

    def launch(self, *args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", *args]
        return subprocess.Popen(cmd, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # type: ignore[call-overload,no-any-return]

    def declarations(self) -> list[dict[str, Any]]:
        d = self.run_dir / "sparkwatch" / "launched"
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json"))] if d.is_dir() else []


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    b = Box(tmp_path)
    yield b
    if b.pidfile.exists():  # never leave a stand-in behind, whatever the test did
        for line in b.pidfile.read_text().split():
            try:
                os.kill(int(line), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def small_model(tmp: Path, weights: int = 64 << 20) -> Path:
    model = tmp / "model"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as fh:
        fh.truncate(weights)
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 256,
                    "head_dim": 64, "torch_dtype": "bfloat16", "vocab_size": 1000, "max_position_embeddings": 2048})
    )  # fmt: skip
    return model


def small_args(model: Path, util: float = 0.25) -> list[str]:
    # --enforce-eager: no graph term; a small utilization that still holds weights, activations and overhead
    return ["vllm", "serve", str(model), "--gpu-memory-utilization", f"{util:.2f}", "--enforce-eager"]


def total_bytes() -> int:
    with MeminfoReader() as r:
        return r.read().total_bytes


def fitting_util() -> float:
    """A utilization whose footprint (utilization × MemTotal) holds the 3 GiB of fixed terms and stays small."""
    return min(0.9, max(0.12, 4.5 * GiB / total_bytes()))


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
    # The next plan for the same command uses the measured peak and shows the estimate's error.
    again = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "launch", "--plan", "--json", "--", *args],
        env=box.env, capture_output=True, check=False, timeout=60,
    )  # fmt: skip
    data = json.loads(again.stdout)
    assert data["learned"]["peak_bytes"] == record["recent"][0]
    assert data["needs_bytes"] == record["recent"][0]
    assert data["learned"]["estimate_error"] > 0  # the estimate is far above what the stand-in took


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


def _wait_ready(box: Box, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for decl in box.declarations():
            if decl["phase"] == "ready":
                return decl
        time.sleep(0.1)
    raise AssertionError(f"never ready: {box.declarations()}")


def test_ctrl_c_reaches_the_whole_tree_and_leaves_no_process_behind(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    # A worker that ignores SIGINT (busy mid-allocation): launch must still end it.
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.1", "--ignore-int",
                      "--pidfile", str(box.pidfile), start_new_session=True)  # fmt: skip
    try:
        _wait_ready(box)
        pids = [int(x) for x in box.pidfile.read_text().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGINT)  # what the terminal sends launch (the engine has its own process group)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), err.decode()
    assert proc.returncode == 130, err.decode()
    assert "sent SIGINT" in err.decode()


def test_a_guard_kill_is_reported_on_the_terminal_with_its_reason(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.05", "--pidfile", str(box.pidfile))
    try:
        decl = _wait_ready(box)
        root = int(decl["root_pid"])
        # The guard's record of a kill (guard.poolwatch writes it through EventLog after the reap): then the signal.
        EventLog(box.state / "events.jsonl").append(
            make_event(
                __import__("sparkwatch.core.eventkinds", fromlist=["EventKind"]).EventKind.KILL,
                f"Killed vllm (root pid {root}, 2 processes): footprint 9.1 GiB over its budget 8.0 GiB.",
                {"trigger": "budget", "dry_run": False, "victims": [{"pid": root, "engine": "vllm"}]},
            )
        )
        os.kill(root, signal.SIGKILL)
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 137
    line = next(x for x in err.decode().splitlines() if "the guard killed" in x)
    assert "trigger budget" in line and "over its budget" in line


def test_a_kill_that_is_not_the_guards_says_so(box: Box, tmp_path: Path) -> None:
    model = small_model(tmp_path)
    proc = box.launch("--", *small_args(model, fitting_util()), "--phase-s", "0.05", "--pidfile", str(box.pidfile))
    try:
        decl = _wait_ready(box)
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
