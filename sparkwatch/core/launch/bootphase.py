"""Which boot phase an engine is in, recognised from its own log lines. Pure: feed bytes, get phase changes.

The strings are the engines' own (docs/launch.md cites each with its file and version):
- vLLM 0.33.0 / 0.11.0: vllm/v1/worker/gpu_model_runner.py ("Starting to load model %s...", "Model loading took",
  "Graph capturing finished in"), vllm/v1/worker/gpu/model_runner.py ("Loading model from scratch..."),
  vllm/model_executor/model_loader/weight_utils.py (tqdm "Loading safetensors checkpoint shards"),
  vllm/compilation/backends.py and monitor.py ("Dynamo bytecode transform time", "Compiling a graph for",
  "Starting torch.compile", "torch.compile took"/"takes … in total"), vllm/v1/worker/gpu_worker.py
  ("Available KV cache memory"), gpu_model_runner.py (tqdm "Capturing CUDA graphs", "Profiling CUDA graph memory"),
  vllm/entrypoints/launchers/api_server/entry.py ("Starting vLLM server on"; 0.11.0 "Starting vLLM API server"),
  uvicorn/lifespan/on.py ("Application startup complete.");
- SGLang 0.5.23 / 0.5.10: sglang/srt/model_executor/model_runner.py ("Load weight begin", "Load weight end"),
  memory_pool.py ("KV Cache is allocated"), cuda_graph_setup.py / model_runner.py ("CUDA graph begin",
  "Capture cuda graph begin", "Capture cuda graph end", "CUDA graph end"), http_server.py ("The server is fired
  up and ready to roll!");
- llama.cpp 0c1e5709: src/llama-model-loader.cpp ("loaded meta data with"), src/llama-model.cpp ("load_tensors:"),
  src/llama-context.cpp ("constructing llama_context"), tools/server/server.cpp ("model loaded"); llama-cpp-python
  0.3.36's server (`python -m llama_cpp.server`, kind llama.cpp too) prints the same loader lines (its vendored
  llama.cpp, verbose by default) and never "model loaded": its boot ends with uvicorn's "Application startup
  complete." (captured from a real run: tests/fixtures/engines/llama-cpp-python-0.3.36-server.stderr);
- flashinfer: jit/core.py ("Building JIT module" in 0.7.4, "Loading JIT ops" up to 0.2.5).

Cost: the launcher scans every chunk of output it passes through, so only the anchors of phases that can still come
are searched, and nothing once the engine is ready. An anchor split across two reads is found: the tail of the
previous chunk is kept. One bytes.find per live anchor (17 for vLLM) cost 3.3 ms per MB; the caller may pass
`any_of`, a factory of one compiled multi-pattern test over the live anchors (launch passes ahocorasick-rs's, 0.1 ms
per MB, cli/launch/anchorsearch.py: core stays pure), that screens each chunk; only a chunk it says may hold an anchor
is searched anchor by anchor, so the phases found and where are the same with or without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class BootPhase(StrEnum):
    STARTING = "starting"
    LOADING_WEIGHTS = "loading_weights"
    JIT_COMPILE = "jit_compile"
    PROFILING = "profiling"
    CUDA_GRAPHS = "cuda_graphs"
    READY = "ready"
    EXITED = "exited"


# The order phases normally come in; a phase recognised out of order is still taken (JIT compiles can come during
# profiling and again before graphs), except that nothing leaves READY or EXITED.
PHASE_ORDER: tuple[BootPhase, ...] = tuple(BootPhase)
BOOTING = frozenset(PHASE_ORDER[:-2])


@dataclass(frozen=True, slots=True)
class Anchor:
    text: bytes
    phase: BootPhase


_JIT = (
    Anchor(b"Building JIT module", BootPhase.JIT_COMPILE),  # flashinfer 0.7.4 jit/core.py
    Anchor(b"Loading JIT ops:", BootPhase.JIT_COMPILE),  # flashinfer <= 0.2.5 jit/core.py
)
ANCHORS: Mapping[str, tuple[Anchor, ...]] = {
    "vllm": (
        Anchor(b"Starting to load model", BootPhase.LOADING_WEIGHTS),
        Anchor(b"Loading model from scratch", BootPhase.LOADING_WEIGHTS),
        Anchor(b"Loading safetensors checkpoint shards", BootPhase.LOADING_WEIGHTS),
        Anchor(b"Model loading took", BootPhase.PROFILING),
        Anchor(b"Starting torch.compile", BootPhase.JIT_COMPILE),
        Anchor(b"Dynamo bytecode transform time", BootPhase.JIT_COMPILE),
        Anchor(b"Compiling a graph for", BootPhase.JIT_COMPILE),
        Anchor(b"torch.compile took", BootPhase.PROFILING),
        Anchor(b"torch.compile takes", BootPhase.PROFILING),
        Anchor(b"Available KV cache memory", BootPhase.PROFILING),
        Anchor(b"Profiling CUDA graph memory", BootPhase.CUDA_GRAPHS),
        Anchor(b"Capturing CUDA graphs", BootPhase.CUDA_GRAPHS),
        Anchor(b"Starting vLLM server on", BootPhase.READY),
        Anchor(b"Starting vLLM API server", BootPhase.READY),
        Anchor(b"Application startup complete", BootPhase.READY),
        *_JIT,
    ),
    "sglang": (
        Anchor(b"Load weight begin", BootPhase.LOADING_WEIGHTS),
        Anchor(b"Load weight end", BootPhase.PROFILING),
        Anchor(b"KV Cache is allocated", BootPhase.PROFILING),
        Anchor(b"Capture cuda graph begin", BootPhase.CUDA_GRAPHS),
        Anchor(b"CUDA graph begin", BootPhase.CUDA_GRAPHS),
        Anchor(b"The server is fired up and ready to roll!", BootPhase.READY),
        *_JIT,
    ),
    "llama.cpp": (
        Anchor(b"loaded meta data with", BootPhase.LOADING_WEIGHTS),
        Anchor(b"load_tensors:", BootPhase.LOADING_WEIGHTS),
        Anchor(b"constructing llama_context", BootPhase.PROFILING),
        Anchor(b"model loaded", BootPhase.READY),  # llama-server
        Anchor(b"Application startup complete", BootPhase.READY),  # llama-cpp-python's server (uvicorn)
    ),
    "other": _JIT,
}


def anchors_for(kind: str) -> tuple[Anchor, ...]:
    return ANCHORS.get(kind, ANCHORS["other"])


@dataclass(frozen=True, slots=True)
class PhaseState:
    phase: BootPhase = BootPhase.STARTING
    tails: tuple[bytes, ...] = (b"", b"")  # per stream (stdout, stderr): the end of the last chunk


def _live(anchors: Sequence[Anchor], phase: BootPhase) -> tuple[Anchor, ...]:
    """The anchors that can still change the phase: none once ready or exited, and none of the current phase."""
    if phase not in BOOTING:
        return ()
    return tuple(a for a in anchors if a.phase != phase)


# Given the texts of the live anchors, a test of whether some bytes may hold one of them: never False when one is
# there (a false True only costs the anchor-by-anchor search).
AnyOf = Callable[[bytes], bool]
AnyOfFactory = Callable[[tuple[bytes, ...]], AnyOf]


class PhaseRecognizer:
    """Feed it the engine's output as it comes; `feed` returns the phases entered, in order. Not thread-safe."""

    def __init__(self, kind: str, any_of: AnyOfFactory | None = None) -> None:
        self.anchors = anchors_for(kind)
        self.state = PhaseState()
        self._any_of_factory = any_of
        self._any_of_by_live: dict[tuple[Anchor, ...], AnyOf] = {}  # at most one per phase
        self._any_of: AnyOf | None = None
        self._set_live(_live(self.anchors, self.state.phase))
        self._keep = max((len(a.text) for a in self.anchors), default=1) - 1

    def _set_live(self, live: tuple[Anchor, ...]) -> None:
        self._live = live
        if self._any_of_factory is None or not live:
            self._any_of = None
            return
        if live not in self._any_of_by_live:
            self._any_of_by_live[live] = self._any_of_factory(tuple(a.text for a in live))
        self._any_of = self._any_of_by_live[live]

    @property
    def phase(self) -> BootPhase:
        return self.state.phase

    def feed(self, chunk: bytes, stream: int = 0) -> list[BootPhase]:
        """The phases `chunk` (the next bytes of `stream`: 0 stdout, 1 stderr) enters, in order."""
        if not self._live or not chunk:
            return []
        tails = list(self.state.tails)
        data = tails[stream] + chunk
        entered: list[BootPhase] = []
        phase = self.state.phase
        while self._any_of is None or self._any_of(data):
            best: tuple[int, Anchor] | None = None
            for anchor in self._live:
                at = data.find(anchor.text)
                if at >= 0 and (best is None or at < best[0]):
                    best = (at, anchor)
            if best is None:
                break
            at, anchor = best
            data = data[at + len(anchor.text) :]
            phase = anchor.phase
            entered.append(phase)
            self._set_live(_live(self.anchors, phase))
            if not self._live:
                break
        tails[stream] = data[-self._keep :] if self._keep and self._live else b""
        self.state = PhaseState(phase, (tails[0], tails[1]))
        return entered

    def exited(self) -> None:
        self.state = PhaseState(BootPhase.EXITED)
        self._set_live(())
