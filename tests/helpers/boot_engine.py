"""An engine stand-in that boots like vLLM, SGLang or llama.cpp: it prints the engines' real log lines, phase by
phase, and allocates real (touched) memory in each phase. For `sparkwatch launch` tests and benchmarks.

    python boot_engine.py --kind vllm [--phase-mib loading_weights=200,profiling=100,cuda_graphs=20] [--phase-s 0.3]
        [--serve-s 5] [--exit-code 3] [--ignore-int] [--grow-mib-per-s 500 --grow-limit-mib 2000] [--env-out F]
        [--pidfile F] [--grow-in-orphan F] [ENGINE ARGS…]

The root is the API server (it prints the banner and the ready lines, as vLLM's APIServer process does); a child
titled like the engine's core (VLLM::EngineCore_DP0, sglang::scheduler_TP0, or the root itself for llama.cpp) prints
the boot lines and holds the memory. With --ignore-int the child shrugs off SIGINT (a busy worker): the launcher must
still leave no process behind. After ready it serves for --serve-s seconds (forever when absent), growing by
--grow-mib-per-s up to --grow-limit-mib if asked (a runaway), then exits with --exit-code. With --grow-in-orphan F
the growth happens in a grandchild that left the tree as a daemonising worker does (fork, setsid, fork, the middle
exits): titled `sw-orphan-grower` (no engine's name), it records its pid and start time in F and in --pidfile.

The lines are quoted from the engines' sources (docs/launch.md cites each): vLLM 0.33.0
(vllm/v1/worker/gpu_model_runner.py, vllm/compilation/backends.py, monitor.py, vllm/v1/worker/gpu_worker.py,
vllm/entrypoints/launchers/api_server/entry.py, uvicorn/lifespan/on.py), SGLang 0.5.23
(sglang/srt/model_executor/model_runner.py, mem_cache/memory_pool.py, cuda_graph_setup.py,
entrypoints/http_server.py), llama.cpp 0c1e5709 (src/llama-model-loader.cpp, src/llama-model.cpp,
src/llama-context.cpp, tools/server/server.cpp) and flashinfer 0.7.4 (flashinfer/jit/core.py).
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import sys
import time

import setproctitle

MiB = 1 << 20
CHUNK_MIB = 32


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[19])


def _stamp() -> str:
    return time.strftime("%m-%d %H:%M:%S")


def vllm_line(proc: str, file: str, line: int, msg: str) -> str:
    # vllm/logger.py _FORMAT: "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"  # noqa: E501
    return f"({proc} pid={os.getpid()}) INFO {_stamp()} [{file}:{line}] {msg}"


def sglang_line(msg: str) -> str:
    # sglang/srt/utils/common.py configure_logger: "[%(asctime)s TP0] %(message)s"
    return f"[{time.strftime('%Y-%m-%d %H:%M:%S')} TP0] {msg}"


# (phase, stream, line) per engine, in boot order. stream 1 = stdout, 2 = stderr (tqdm bars).
def script(kind: str, model: str) -> dict[str, list[tuple[int, str]]]:
    if kind == "vllm":
        core = "EngineCore_DP0"
        return {
            "starting": [
                (1, vllm_line("APIServer", "startup.py", 71, f"vLLM server version 0.33.0, serving model {model}"))
            ],
            "loading_weights": [
                (1, vllm_line(core, "gpu_model_runner.py", 3381, f"Starting to load model {model}...")),
                (2, "Loading safetensors checkpoint shards: 100% Completed | 4/4 [00:02<00:00,  1.52it/s]"),
            ],
            "profiling": [
                (1, vllm_line(core, "default_loader.py", 291, "Loading weights took 2.31 seconds")),
                (
                    1,
                    vllm_line(
                        core, "gpu_model_runner.py", 3470, "Model loading took 15.2 GiB memory and 2.512 seconds"
                    ),
                ),
            ],
            "jit_compile": [
                (1, vllm_line(core, "backends.py", 548, "Dynamo bytecode transform time: 5.31 s")),
                (
                    1,
                    "2026-12-02 03:00:00,000 - INFO - core.py:277 - flashinfer.jit: Building JIT module "
                    "fused_moe_120; this can take several minutes on first use.",
                ),
            ],
            "profiling_2": [
                (1, vllm_line(core, "monitor.py", 34, "torch.compile took 20.10 s in total")),
                (1, vllm_line(core, "gpu_worker.py", 312, "Available KV cache memory: 80.51 GiB")),
            ],
            "cuda_graphs": [
                (2, "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 67/67 [00:08<00:00]"),
                (1, vllm_line(core, "gpu_model_runner.py", 4120, "Graph capturing finished in 8 secs, took 0.31 GiB")),
            ],
            "ready": [
                (1, vllm_line("APIServer", "entry.py", 58, "Starting vLLM server on http://0.0.0.0:8000")),
                (1, "INFO:     Application startup complete."),
            ],
        }
    if kind == "sglang":
        return {
            "starting": [(1, sglang_line(f"server_args=ServerArgs(model_path='{model}')"))],
            "loading_weights": [(1, sglang_line("Load weight begin. avail mem=110.52 GB"))],
            "profiling": [
                (
                    1,
                    sglang_line(
                        "Load weight end. elapsed=12.31 s, type=Qwen3ForCausalLM, avail mem=94.10 GB, mem usage=16.42 GB."  # noqa: E501 (the engine's line, quoted whole)
                    ),
                ),
                (
                    1,
                    sglang_line(
                        "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 399740, K size: 1.52 GB, V size: 1.52 GB"  # noqa: E501 (the engine's line, quoted whole)
                    ),
                ),
            ],
            "jit_compile": [],
            "profiling_2": [],
            "cuda_graphs": [
                (
                    1,
                    sglang_line(
                        "Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, avail mem=12.02 GB"
                    ),
                ),
                (
                    1,
                    sglang_line(
                        "Capture target decode CUDA graph end. bs=[1, 2, 4], elapsed=8.01 s, mem usage=0.93 GB, avail mem=11.09 GB."  # noqa: E501 (the engine's line, quoted whole)
                    ),
                ),
            ],
            "ready": [(1, sglang_line("The server is fired up and ready to roll!"))],
        }
    return {
        "starting": [(2, "build: 6153 (0c1e5709) with cc for aarch64-linux-gnu")],
        "loading_weights": [
            (
                2,
                f"llama_model_loader: loaded meta data with 35 key-value pairs and 291 tensors from {model} (version GGUF V3 (latest))",  # noqa: E501 (the engine's line, quoted whole)
            ),
            (2, "load_tensors: offloaded 49/49 layers to GPU"),
        ],
        "profiling": [
            (2, "llama_context: constructing llama_context"),
            (2, "llama_kv_cache:      CUDA0 KV buffer size =  4096.00 MiB"),
        ],
        "jit_compile": [],
        "profiling_2": [],
        "cuda_graphs": [],
        "ready": [(2, "srv  llama_server: model loaded"), (2, "srv  llama_server: listening on http://127.0.0.1:8080")],
    }


def emit(stream: int, text: str) -> None:
    os.write(stream, (text + "\n").encode())


class Memory:
    def __init__(self) -> None:
        self.maps: list[mmap.mmap] = []
        self.mib = 0

    def take(self, mib: int) -> None:
        block = b"\xa5" * (CHUNK_MIB * MiB)
        left = mib
        while left > 0:
            size = min(CHUNK_MIB, left)
            mm = mmap.mmap(-1, size * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mm.write(block[: size * MiB])  # every page touched: real RSS, a real MemAvailable drop
            self.maps.append(mm)
            left -= size
            self.mib += size


def core(args: argparse.Namespace, model: str, phase_mib: dict[str, int]) -> None:
    lines = script(args.kind, model)  # built here: the lines carry this process's pid, as vLLM's do
    mem = Memory()
    for phase in ("loading_weights", "profiling", "jit_compile", "profiling_2", "cuda_graphs"):
        for stream, text in lines[phase]:
            emit(stream, text)
        mem.take(phase_mib.get(phase, 0))
        time.sleep(args.phase_s)
    if args.signal_ready:
        os.kill(os.getppid(), signal.SIGUSR1)
    if args.grow_in_orphan:
        grow_in_orphan(args, phase_mib)
        args.grow_mib_per_s = 0  # the orphan grows; this process serves as it is
    end = None if args.serve_s is None else time.monotonic() + args.serve_s
    start = time.monotonic()
    while end is None or time.monotonic() < end:
        if args.grow_mib_per_s and mem.mib < args.grow_limit_mib + sum(phase_mib.values()):
            target = sum(phase_mib.values()) + min(
                args.grow_limit_mib, int((time.monotonic() - start) * args.grow_mib_per_s)
            )
            if target > mem.mib:
                mem.take(min(target - mem.mib, CHUNK_MIB))
                continue
        time.sleep(0.05)


def grow_in_orphan(args: argparse.Namespace, phase_mib: dict[str, int]) -> None:
    """Fork, setsid, fork again and let the middle exit: the grandchild is reparented to the nearest child subreaper
    (`sparkwatch launch`) or PID 1, out of this process's tree and session, and grows there."""
    middle = os.fork()
    if middle:
        os.waitpid(middle, 0)
        return
    os.setsid()
    if os.fork():
        os._exit(0)
    setproctitle.setproctitle("sw-orphan-grower")
    line = f"{os.getpid()} {start_ticks(os.getpid())}\n"
    for path in filter(None, (args.pidfile, args.grow_in_orphan)):
        with open(path, "a", encoding="ascii") as fh:
            fh.write(line)
    mem = Memory()
    start = time.monotonic()
    while True:
        target = min(args.grow_limit_mib, int((time.monotonic() - start) * args.grow_mib_per_s))
        if target > mem.mib:
            mem.take(min(target - mem.mib, CHUNK_MIB))
        else:
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="vllm", choices=("vllm", "sglang", "llama.cpp"))
    ap.add_argument("--phase-mib", default="")
    ap.add_argument("--phase-s", type=float, default=0.2)
    ap.add_argument("--serve-s", type=float, default=None)
    ap.add_argument("--exit-code", type=int, default=0)
    ap.add_argument("--ignore-int", action="store_true")
    ap.add_argument("--grow-mib-per-s", type=float, default=0)
    ap.add_argument("--grow-limit-mib", type=int, default=0)
    ap.add_argument("--env-out")
    ap.add_argument("--pidfile")
    ap.add_argument("--grow-in-orphan")
    ap.add_argument("--signal-ready", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.env_out:
        with open(args.env_out, "w", encoding="utf-8") as fh:
            for key in ("MAX_JOBS", "FLASHINFER_NVCC_THREADS", "NVCC_THREADS", "TORCHINDUCTOR_COMPILE_THREADS",
                        "RAY_memory_monitor_refresh_ms", "PYTHONUNBUFFERED"):  # fmt: skip
                fh.write(f"{key}={os.environ.get(key, '')}\n")
    model = next((a for a in rest if not a.startswith("-") and a not in ("serve",)), "model")
    lines = script(args.kind, model)
    phase_mib = {}
    for part in filter(None, args.phase_mib.split(",")):
        name, _, value = part.partition("=")
        phase_mib[name] = int(value)
    for stream, text in lines["starting"]:
        emit(stream, text)
    if args.kind == "llama.cpp":
        setproctitle.setproctitle("llama-server")
        core(args, model, phase_mib)
        for stream, text in lines["ready"]:
            emit(stream, text)
        sys.exit(args.exit_code)
    title = "VLLM::EngineCore_DP0" if args.kind == "vllm" else "sglang::scheduler_TP0"
    ready = []
    signal.signal(signal.SIGUSR1, lambda *_: ready.append(True))
    args.signal_ready = True
    pid = os.fork()
    if pid == 0:
        setproctitle.setproctitle(title)
        if args.ignore_int:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if args.pidfile:
            with open(args.pidfile, "a", encoding="ascii") as fh:
                fh.write(f"{os.getpid()} {start_ticks(os.getpid())}\n")
        try:
            core(args, model, phase_mib)
        except KeyboardInterrupt:
            pass
        os._exit(0)
    if args.pidfile:
        with open(args.pidfile, "a", encoding="ascii") as fh:
            fh.write(f"{os.getpid()} {start_ticks(os.getpid())}\n")
    try:
        while not ready:
            if os.waitpid(pid, os.WNOHANG)[0]:
                sys.exit(1)
            time.sleep(0.02)
        for stream, text in lines["ready"]:
            emit(stream, text)
        os.waitpid(pid, 0)
    except KeyboardInterrupt:
        emit(1, "INFO:     Shutting down")
        sys.exit(130)
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
