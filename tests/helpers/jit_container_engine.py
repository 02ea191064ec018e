"""An engine in a container that JIT-builds like flashinfer, step by step, into its own file system.

    python3 jit_container_engine.py CONTROL_DIR

Titled VLLM::EngineCore (setproctitle, as vLLM does: its environ area is overwritten, so its HOME must be found
another way). It writes a flashinfer module as flashinfer does (tests/helpers/jit_build.py's build.ninja) under
$HOME/.cache/flashinfer/0.2.8/121a/cached_ops/rmsnorm/ in the container's own root, then, each time CONTROL_DIR/<step>
appears (small, heavy, link), the output of that step (an object, then the module's .so), and writes
CONTROL_DIR/<step>.done. The image has no nvcc: the files are what the view looks at, not how they were made.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import setproctitle

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository (/src in the container)
from tests.helpers.jit_build import BUILD_NINJA

STEPS = (("small", "norm_small.cuda.o"), ("heavy", "norm_heavy.cuda.o"), ("link", "rmsnorm.so"))


def main() -> None:
    control = Path(sys.argv[1])
    module_dir = Path(os.environ["HOME"]) / ".cache" / "flashinfer" / "0.2.8" / "121a" / "cached_ops" / "rmsnorm"
    setproctitle.setproctitle("VLLM::EngineCore")
    module_dir.mkdir(parents=True)
    (module_dir / "build.ninja").write_text(BUILD_NINJA.format(src="/tmp/src", module="rmsnorm"))
    (control / "started").write_text(str(module_dir))
    for step, output in STEPS:
        while not (control / step).exists():
            time.sleep(0.05)
        (module_dir / output).write_bytes(b"\x7fELF" + b"\0" * 4096)
        (control / f"{step}.done").write_text("")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
