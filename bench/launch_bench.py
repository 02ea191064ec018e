"""`sparkwatch launch`'s own costs: the plan, the log pass-through, and how soon a boot phase is seen.

    .venv/bin/python bench/launch_bench.py --rounds 3 --out bench/RESULTS-launch.md

1. Plan: `gather()` (core.launch.plan over common.sources.checkpoint: stat of every shard, a bounded config.json,
   meminfo, buddyinfo, the declarations, one /proc scan for running engines, the learned peaks) for a 40-shard sparse
   model directory, `--plans` times; and the whole `sparkwatch launch --plan --json` command, interpreter start
   included.
2. Pass-through: a stand-in `vllm serve` writes 10 MB/s of vLLM-shaped log lines (APIServer access lines, ~130 bytes)
   for `--spam-s` seconds through launch; launch's CPU time (user + system) over wall time, in % of one core.
   Episodes alternate A B A B: A while booting (every phase anchor still searched), B after `ready` (nothing searched,
   bytes only copied).
3. Phase latency: the stand-in writes the six vLLM phase lines between the spam, each after a wall-clock stamp;
   latency = the time launch's declaration records for the phase minus the stamp.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MiB = 1 << 20
SPAM = (
    '(APIServer pid=1234) INFO 12-02 03:00:00 [logger.py:71] 127.0.0.1:51234 - "POST /v1/completions HTTP/1.1" 200 OK\n'
)
# The phase lines of vLLM 0.33.0 (tests/helpers/boot_engine.py quotes the same, with their files).
_CORE = "(EngineCore_DP0 pid=1) INFO 12-02 03:00:00"
PHASES = (
    ("loading_weights", f"{_CORE} [gpu_model_runner.py:3381] Starting to load model m..."),
    ("profiling", f"{_CORE} [gpu_model_runner.py:3470] Model loading took 15.2 GiB memory and 2.5 seconds"),
    ("jit_compile", f"{_CORE} [backends.py:548] Dynamo bytecode transform time: 5.31 s"),
    ("profiling", f"{_CORE} [monitor.py:34] torch.compile took 20.10 s in total"),
    ("cuda_graphs", "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 67/67"),
    ("ready", "(APIServer pid=1) INFO 12-02 03:00:00 [entry.py:58] Starting vLLM server on http://0.0.0.0:8000"),
)


def spammer(mode: str, rate_mb: float, seconds: float, stamps: str) -> None:
    """The stand-in engine: `boot` spams then writes the phase lines one by one (stamped) with spam between;
    `ready` writes ready first, then spams; `phases` writes only stamped phase lines, 0.5 s apart, with spam."""
    out = sys.stdout.buffer
    chunk = SPAM.encode() * 64  # ~8 KiB
    per_s = rate_mb * 1_000_000

    def spam_for(span: float) -> None:
        start = time.monotonic()
        sent = 0
        while time.monotonic() - start < span:
            out.write(chunk)
            sent += len(chunk)
            ahead = sent / per_s - (time.monotonic() - start)
            if ahead > 0:
                out.flush()
                time.sleep(ahead)
        out.flush()

    log = open(stamps, "w", encoding="ascii")  # noqa: SIM115
    if mode == "ready":
        out.write((PHASES[-1][1] + "\n").encode())
        out.flush()
        spam_for(seconds)
    elif mode == "boot":
        spam_for(seconds)
    else:
        for phase, line in PHASES:
            spam_for(0.5)
            log.write(f"{phase} {time.time():.6f}\n")
            log.flush()
            out.write((line + "\n").encode())
            out.flush()
        spam_for(0.5)
    log.close()


def make_model(tmp: Path, shards: int = 40) -> Path:
    model = tmp / "model40"
    model.mkdir()
    for i in range(shards):
        with open(model / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as fh:
            fh.truncate(4 << 30)  # sparse: 160 GiB that use no disk
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"w{i}": f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)}})
    )
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
                    "hidden_size": 8192, "torch_dtype": "bfloat16", "max_position_embeddings": 131072})
    )  # fmt: skip
    return model


def env_for(tmp: Path, bin_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        PATH=f"{bin_dir}:{env.get('PATH', '')}",
        XDG_RUNTIME_DIR=str(tmp / "run"),
        SPARKWATCH_STATE_DIR=str(tmp / "state"),
        SPARKWATCH_FLOOR="1GiB",  # the smallest floor config accepts
    )
    (tmp / "run").mkdir(exist_ok=True)
    return env


def bench_plan(tmp: Path, env: dict[str, str], plans: int) -> tuple[list[float], list[float]]:
    from sparkwatch.cli.launch.gather import PlanInputs, gather
    from sparkwatch.config.settings import load_settings

    model = make_model(tmp)
    settings = load_settings(overrides={"state_dir": tmp / "state"})
    argv = ("vllm", "serve", str(model), "--gpu-memory-utilization", "0.8")
    inputs = PlanInputs(argv=argv, env=env)
    inproc = []
    for _ in range(plans):
        t0 = time.perf_counter()
        _plan, ctx = gather(settings, inputs)
        inproc.append((time.perf_counter() - t0) * 1000)
        assert ctx.facts.files == 40
    cli = []
    for _ in range(max(plans // 4, 3)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "sparkwatch", "launch", "--plan", "--json", "--", *argv], env=env,
                       capture_output=True, check=False)  # fmt: skip
        cli.append((time.perf_counter() - t0) * 1000)
    return inproc, cli


def run_launch(tmp: Path, env: dict[str, str], mode: str, rate_mb: float, seconds: float) -> tuple[float, Path]:
    """Launch the spammer; returns (launch's CPU % of one core while it ran, the stamps file)."""
    stamps = tmp / f"stamps-{mode}-{time.monotonic_ns()}"
    env = {**env, "BENCH_MODE": mode, "BENCH_RATE": str(rate_mb), "BENCH_SECONDS": str(seconds),
           "BENCH_STAMPS": str(stamps)}  # fmt: skip
    model = tmp / "small"
    if not model.exists():
        model.mkdir()
        (model / "model.safetensors").write_bytes(b"")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkwatch", "launch", "--force", "-q", "--settle-timeout", "0", "--", "vllm",
         "serve", str(model), "--gpu-memory-utilization", "0.2", "--enforce-eager"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ps = psutil.Process(proc.pid)
    time.sleep(1.5)  # interpreter start and the plan: not the pass-through
    cpu0 = sum(ps.cpu_times()[:2])
    t0 = time.monotonic()
    cpu1 = cpu0
    while proc.poll() is None:
        try:
            cpu1 = sum(ps.cpu_times()[:2])
        except psutil.NoSuchProcess:
            break
        t1 = time.monotonic()
        time.sleep(0.2)
    proc.wait()
    return (cpu1 - cpu0) / max(t1 - t0, 1e-9) * 100, stamps


def phase_latencies(tmp: Path, stamps: Path) -> list[float]:
    decls = sorted((tmp / "run" / "sparkwatch" / "launched").glob("[0-9]*.json"), key=os.path.getmtime)
    decl = json.loads(decls[-1].read_text())
    seen = [(p, t) for p, t in decl["phases"] if p not in ("starting", "exited")]
    wrote = [(line.split()[0], float(line.split()[1])) for line in stamps.read_text().splitlines()]
    assert [p for p, _ in seen] == [p for p, _ in wrote], (seen, wrote)
    return [(t_seen - t_wrote) * 1000 for (_p, t_seen), (_q, t_wrote) in zip(seen, wrote, strict=True)]


def main() -> None:
    if os.environ.get("BENCH_MODE"):
        spammer(os.environ["BENCH_MODE"], float(os.environ["BENCH_RATE"]), float(os.environ["BENCH_SECONDS"]),
                os.environ["BENCH_STAMPS"])  # fmt: skip
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--plans", type=int, default=20)
    ap.add_argument("--rate-mb", type=float, default=10.0)
    ap.add_argument("--spam-s", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sw-launch-bench-") as tmp_s:
        tmp = Path(tmp_s)
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        (bin_dir / "vllm").write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()}\n")
        (bin_dir / "vllm").chmod(0o755)
        env = env_for(tmp, bin_dir)
        inproc, cli = bench_plan(tmp, env, args.plans)
        cpu: dict[str, list[float]] = {"boot": [], "ready": []}
        for i in range(args.rounds):
            for mode in ("boot", "ready") if i % 2 == 0 else ("ready", "boot"):
                pct, _ = run_launch(tmp, env, mode, args.rate_mb, args.spam_s)
                cpu[mode].append(pct)
        latencies: list[float] = []
        for _ in range(args.rounds):
            _pct, stamps = run_launch(tmp, env, "phases", args.rate_mb, 0)
            latencies += phase_latencies(tmp, stamps)

    def fmt(xs: list[float], unit: str, digits: int = 1) -> str:
        return f"{statistics.median(xs):.{digits}f} {unit} (max {max(xs):.{digits}f})"

    lines = [
        "# sparkwatch launch: plan, pass-through, phase latency",
        "",
        f"Command: `python bench/launch_bench.py --rounds {args.rounds} --plans {args.plans} --rate-mb "
        f"{args.rate_mb:g} --spam-s {args.spam_s:g}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}, "
        f"Python {platform.python_version()}",
        "",
        "| what | measured | target |",
        "| --- | --- | --- |",
        f"| plan, 40-shard sparse directory (`gather()`, {args.plans} runs) | {fmt(inproc, 'ms')} | ≤ 200 ms |",
        f"| `sparkwatch launch --plan --json`, whole command (interpreter start, imports) | {fmt(cli, 'ms', 0)} | - |",
        f"| pass-through of {args.rate_mb:g} MB/s while booting (anchors searched), {args.rounds} episodes | "
        f"{fmt(cpu['boot'], '% of a core', 2)} | ≤ 1 % |",
        f"| pass-through of {args.rate_mb:g} MB/s after ready (bytes copied only), {args.rounds} episodes | "
        f"{fmt(cpu['ready'], '% of a core', 2)} | ≤ 1 % |",
        f"| phase seen after its line ({len(latencies)} phase lines amid {args.rate_mb:g} MB/s) | "
        f"{fmt(latencies, 'ms')} | ≤ 1 s |",
        "",
        "Episodes of the pass-through alternate A B A B (booting, ready). Launch's CPU is its user + system time from "
        "/proc over the spam's wall time, after the first 1.5 s (start and plan) are left out.",
        "",
        "This window (1.5 s after start to exit, 10 ms ticks, a VM shared with other work) is noisy: "
        "bench/RESULTS-passthrough.md measures the pass-through alone, A B against the baseline commit. "
        "Copying costs least when launch wakes at most every 50 ms under a stream (1 MiB pipes, 1 MiB reads): "
        "with 8 KiB reads at each write it took 2.2 % of a core, with a wake-up every 20 ms 1.0 %. While booting, "
        "every chunk is also screened for the anchors of the phases still to come (17 for vLLM) by one ahocorasick-rs "
        "pass, 0.1 ms per MB (one bytes.find each was 3.3 ms per MB, 4.4 % of a core at 10 MB/s: "
        "bench/RESULTS-passthrough.md), which is what the booting row adds; nothing is searched once the engine is "
        "ready. A phase is seen within one coalescing interval of its line.",
    ]
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
