"""The boot-phase recogniser as launch runs it (core.launch.bootphase with cli/launch/anchorsearch.py's one-pass
screen): over the engines' own boot logs, cut into chunks anywhere, it enters the same phases at the same bytes as a
plain reference search that walks the whole stream byte by byte, and as the anchor-by-anchor search alone.

The streams are tests/helpers/boot_engine.py's lines (the engines' real ones) in boot order, or drawn in any order
with the chatter a boot writes between them (tqdm bars with carriage returns, NCCL and warning lines).
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sparkwatch.cli.launch.anchorsearch import any_anchor
from sparkwatch.core.launch.bootphase import BOOTING, BootPhase, PhaseRecognizer, anchors_for
from tests.helpers.boot_engine import script

KINDS = ("vllm", "sglang", "llama.cpp")
MODEL = "/models/Qwen3-8B"
CHATTER = (
    "(APIServer pid=1) INFO 12-02 03:00:00 [utils.py:253] non-default args: {'model': '/models/Qwen3-8B', "
    "'gpu_memory_utilization': 0.8}",
    "(EngineCore_DP0 pid=1) INFO 12-02 03:00:00 [cuda.py:403] Using FLASH_ATTN backend on V1 engine.",
    "gpu-node:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>",
    "/usr/lib/python3/dist-packages/torch/cuda/__init__.py:63: FutureWarning: The pynvml package is deprecated.",
    "Loading safetensors checkpoint shards:  50% Completed | 2/4 [00:01<00:01,  1.52it/s]\r",
    "Capturing CUDA graphs (decode, FULL):  42%|####      | 28/67 [00:03<00:04,  9.01it/s]\r",
    "[2026-12-02 03:00:00 TP0] Prefill batch. #new-seq: 1, #new-token: 6, #cached-token: 0",
    "llama_kv_cache:      CUDA0 KV buffer size =  4096.00 MiB",
    "srv  llama_server: listening on http://127.0.0.1:8080",
)


def boot_lines(kind: str) -> list[str]:
    return [line for lines in script(kind, MODEL).values() for _stream, line in lines]


def boot_stream(kind: str) -> bytes:
    return "".join(line + "\n" for line in boot_lines(kind)).encode()


def reference(kind: str, data: bytes) -> list[tuple[BootPhase, int]]:
    """(phase, the offset just past the anchor's last byte): at each byte, the first anchor (in the table's order)
    that starts there, of a phase other than the current one, while booting; scanning goes on after it."""
    anchors = anchors_for(kind)
    phase = BootPhase.STARTING
    found: list[tuple[BootPhase, int]] = []
    at = 0
    while at < len(data) and phase in BOOTING:
        hit = next((a for a in anchors if a.phase != phase and data.startswith(a.text, at)), None)
        if hit is None:
            at += 1
            continue
        phase = hit.phase
        at += len(hit.text)
        found.append((phase, at))
    return found


def fed(recognizer: PhaseRecognizer, data: bytes, cuts: list[int]) -> list[tuple[BootPhase, int]]:
    """(phase, the end of the chunk that entered it), the stream fed in chunks cut at `cuts`."""
    found: list[tuple[BootPhase, int]] = []
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    for start, end in pairwise(bounds):
        found += [(phase, end) for phase in recognizer.feed(data[start:end])]
    return found


def expected(data: bytes, cuts: list[int], kind: str) -> list[tuple[BootPhase, int]]:
    """The reference's phases, each at the end of the chunk that holds its anchor's last byte."""
    bounds = [*sorted({c for c in cuts if 0 < c < len(data)}), len(data)]
    return [(phase, next(b for b in bounds if b >= end)) for phase, end in reference(kind, data)]


def test_every_phase_is_entered_in_boot_order_at_the_byte_its_anchor_ends_when_every_byte_is_a_chunk() -> None:
    for kind in KINDS:
        data = boot_stream(kind)
        cuts = list(range(len(data)))
        want = reference(kind, data)
        assert [p for p, _ in want][-1] == BootPhase.READY, kind
        assert fed(PhaseRecognizer(kind, any_of=any_anchor), data, cuts) == want, kind


def test_a_boot_cut_in_two_anywhere_enters_the_same_phases_at_the_same_bytes_as_the_reference() -> None:
    for kind in KINDS:
        data = boot_stream(kind)
        for cut in range(1, len(data)):
            assert fed(PhaseRecognizer(kind, any_of=any_anchor), data, [cut]) == expected(data, [cut], kind), (
                kind,
                cut,
            )


@st.composite
def streams(draw: st.DrawFn) -> tuple[str, bytes, list[int]]:
    kind = draw(st.sampled_from(KINDS))
    lines = draw(st.lists(st.sampled_from(boot_lines(kind) + list(CHATTER)), min_size=1, max_size=40))
    data = "".join(line + draw(st.sampled_from(("\n", "\r", ""))) for line in lines).encode()
    cuts = draw(st.lists(st.integers(0, len(data)), max_size=30))
    return kind, data, cuts


@settings(max_examples=300, deadline=None)
@given(streams())
def test_any_log_cut_anywhere_enters_the_same_phases_at_the_same_bytes_as_the_reference(
    stream: tuple[str, bytes, list[int]],
) -> None:
    kind, data, cuts = stream
    assert fed(PhaseRecognizer(kind, any_of=any_anchor), data, cuts) == expected(data, cuts, kind)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(KINDS),
    st.lists(st.tuples(st.integers(0, 1), st.sampled_from(CHATTER), st.integers(0, 200)), max_size=60),
)
def test_stdout_and_stderr_interleaved_give_what_the_anchor_by_anchor_search_gives(
    kind: str, pieces: list[tuple[int, str, int]]
) -> None:
    """Two streams keep a tail each: the screen must see what the plain search sees, pieces cut mid-line."""
    lines = boot_lines(kind)
    screened, plain = PhaseRecognizer(kind, any_of=any_anchor), PhaseRecognizer(kind)
    for i, (stream, chatter, cut) in enumerate(pieces):
        text = (lines[i % len(lines)] + "\n" + chatter + "\n").encode()
        for chunk in (text[:cut], text[cut:]):
            assert screened.feed(chunk, stream) == plain.feed(chunk, stream)
        assert screened.state == plain.state


REAL_LLAMA_CPP_PYTHON = Path(__file__).parent / "fixtures" / "engines" / "llama-cpp-python-0.3.36-server.stderr"


def test_a_real_llama_cpp_python_server_boot_reaches_ready() -> None:
    """The whole stderr of a real `python -m llama_cpp.server` (0.3.36, SmolLM2-135M on CPU, scripts/real-engine):
    before uvicorn's ready line was an anchor its boot never ended (the phases stopped at profiling). Fed in pieces of
    any size, it enters loading_weights, profiling and ready, in that order, ready at uvicorn's line."""
    data = REAL_LLAMA_CPP_PYTHON.read_bytes()
    for size in (3, 4096, len(data)):
        rec = PhaseRecognizer("llama.cpp", any_of=any_anchor)
        entered = [p for i in range(0, len(data), size) for p in rec.feed(data[i : i + size], 1)]
        assert entered[0] == BootPhase.LOADING_WEIGHTS and entered[-1] == BootPhase.READY, (size, entered)
        assert BootPhase.PROFILING in entered
        assert rec.phase == BootPhase.READY
    ready_at = data.index(b"Application startup complete")
    rec = PhaseRecognizer("llama.cpp")
    assert BootPhase.READY not in rec.feed(data[:ready_at], 1)
    assert rec.feed(data[ready_at:], 1) == [BootPhase.READY]
