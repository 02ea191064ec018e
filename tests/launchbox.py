"""`sparkwatch launch` in a private box for tests: a `vllm` on PATH that is tests/helpers/boot_engine.py, a runtime
dir and a state dir of the test's own, and small models made of sparse files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.sources.procs import read_start_ticks
from tests.conftest import ROOT

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
            SPARKWATCH_FLOOR="1GiB",  # the smallest floor config accepts
        )
        return env

    def launch_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", *args]

    def launch(self, *args: str, env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen[bytes]:
        cmd = self.launch_argv(*args)
        return subprocess.Popen(cmd, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # type: ignore[call-overload,no-any-return]

    def pids(self) -> list[tuple[int, int]]:
        """(pid, start ticks) of every stand-in process that recorded itself."""
        if not self.pidfile.exists():
            return []
        out = []
        for line in self.pidfile.read_text().splitlines():
            pid, ticks = line.split()
            out.append((int(pid), int(ticks)))
        return out

    def declarations(self) -> list[dict[str, Any]]:
        d = self.run_dir / "sparkwatch" / "launched"
        if not d.is_dir():
            return []
        # Written atomically (a temporary `.tmp-…` file renamed into place): only the real files count.
        return [json.loads(p.read_text()) for p in sorted(d.glob("*.json")) if not p.name.startswith(".")]


def box_for(tmp_path: Path) -> Iterator[Box]:
    """A Box, and on the way out a SIGKILL for every stand-in it recorded: never leave one behind."""
    b = Box(tmp_path)
    yield b
    for pid, ticks in b.pids():  # never leave a stand-in behind, whatever the test did; never a reused pid
        if read_start_ticks("/proc", pid) == ticks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
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


def wait_ready(box: Box, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for decl in box.declarations():
            if decl["phase"] == "ready":
                return decl
        time.sleep(0.1)
    raise AssertionError(f"never ready: {box.declarations()}")
