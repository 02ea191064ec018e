"""`sparkwatch launch --plan` as a user runs it, in a child with a timeout (a hang fails the test, never blocks the
suite), against a fixture /proc that holds only a meminfo the test writes (no engines, no buddyinfo: the pool is what
the test says), with a state dir, runtime dir and config of the test's own. And small checkpoints of sparse files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

GiB = 1 << 30
GB10_TOTAL_KIB = 127_600_748  # MemTotal of a DGX Spark (XuehaiPan/nvitop#208)
PLAN_TIMEOUT_S = 30.0
# A Qwen3-0.6B-like shape (its config.json's fields).
SMALL_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "dtype": "bfloat16",
}


def proc_root(tmp: Path, available_gib: float) -> Path:
    root = tmp / "proc"
    root.mkdir(exist_ok=True)
    avail_kib = int(available_gib * (1 << 20))
    (root / "meminfo").write_text(
        f"MemTotal:       {GB10_TOTAL_KIB} kB\nMemFree:        {avail_kib} kB\nMemAvailable:   {avail_kib} kB\n"
        "Cached:         100000 kB\nShmem:          0 kB\n"
    )
    return root


def plan(
    tmp: Path, *args: str, env: dict[str, str] | None = None, available_gib: float | None = None
) -> subprocess.CompletedProcess[str]:
    """`sparkwatch launch --plan ARGS…` in a child; raises subprocess.TimeoutExpired (the child killed) on a hang."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKWATCH_", "MAX_JOBS", "HF_"))}
    full.update(
        SPARKWATCH_STATE_DIR=str(tmp / "state"),
        XDG_RUNTIME_DIR=str(tmp / "run"),
        XDG_CONFIG_HOME=str(tmp / "xdg"),
        HF_HOME=str(tmp / "hf"),
        SPARKWATCH_FLOOR="1GiB",
    )
    full.update(env or {})
    (tmp / "run").mkdir(exist_ok=True)
    where = [] if available_gib is None else ["--proc-root", str(proc_root(tmp, available_gib))]
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", "launch", "--plan", *where, *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=PLAN_TIMEOUT_S,
    )


def model_dir(path: Path, weights_bytes: int = 1 * GiB, config: dict[str, Any] | str | None = None) -> Path:
    """A safetensors checkpoint: one sparse shard and a config.json (SMALL_SHAPE, or the text given)."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "model.safetensors", "wb") as fh:
        fh.truncate(weights_bytes)
    text = config if isinstance(config, str) else json.dumps(SMALL_SHAPE if config is None else config)
    (path / "config.json").write_text(text)
    return path


def gguf(path: Path, kv: list[tuple[str, int, object]], size: int = 1 * GiB) -> Path:
    """A GGUF file: the header with `kv` (type 8 strings, type 4 uint32, type 9 a two-string array), then sparse
    tensors never read."""

    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, vtype, value in kv:
        out += s(key) + struct.pack("<I", vtype)
        if vtype == 8:
            assert isinstance(value, str)
            out += s(value)
        elif vtype == 9:
            out += struct.pack("<IQ", 8, 2) + s("a") + s("b")
        else:
            assert isinstance(value, int)
            out += struct.pack("<I", value)
    path.write_bytes(out)
    with open(path, "r+b") as fh:
        fh.truncate(size)
    return path


LLAMA_HEADER: list[tuple[str, int, object]] = [
    ("general.architecture", 8, "llama"),
    ("llama.block_count", 4, 32),
    ("llama.context_length", 4, 8192),
    ("llama.embedding_length", 4, 4096),
    ("llama.attention.head_count", 4, 32),
    ("llama.attention.head_count_kv", 4, 8),
    ("tokenizer.ggml.tokens", 9, None),
]


def applied(fix_text: str) -> tuple[dict[str, str], list[str]]:
    """A fix line's settings as a user applies them: `MAX_JOBS=N` into the environment, `--flag value` pairs appended
    to the command (the words before any parenthesis)."""
    env: dict[str, str] = {}
    argv: list[str] = []
    for word in fix_text.split(" (", 1)[0].split():
        if word.startswith("MAX_JOBS="):
            env["MAX_JOBS"] = word.split("=", 1)[1]
        else:
            argv.append(word)
    return env, argv
