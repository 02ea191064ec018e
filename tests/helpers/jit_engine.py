"""A fake vLLM EngineCore that JIT-compiles like flashinfer does: `ninja -C <module dir>` with its output on a pipe.

    python jit_engine.py <module dir> <jobs> <stall marker>

It titles itself VLLM::EngineCore (setproctitle, as vLLM does), runs the build, waiting in a pipe read as flashinfer
does while ninja -> nvcc -> cicc/ptxas run, then idles in sleep. When <stall marker> appears it blocks reading a pipe
nobody will ever write to: the shape of a stuck boot. Everything it starts is its own child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import setproctitle


def main() -> None:
    module_dir, jobs, marker = sys.argv[1], sys.argv[2], sys.argv[3]
    setproctitle.setproctitle("VLLM::EngineCore")
    env = {k: v for k, v in os.environ.items() if k != "MAX_JOBS"}  # the field's mistake: no MAX_JOBS
    done = subprocess.run(["ninja", "-C", module_dir, "-j", jobs], env=env, capture_output=True, check=False)
    with open(os.path.join(module_dir, "ninja.rc"), "w", encoding="ascii") as fh:
        fh.write(f"{done.returncode}\n{done.stdout.decode(errors='replace')[-2000:]}")
    while not os.path.exists(marker):
        time.sleep(0.2)
    r, _w = os.pipe()
    os.read(r, 1)  # blocks forever in pipe_read: our own write end is open and never written


if __name__ == "__main__":
    main()
