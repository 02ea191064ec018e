"""An LLM-API script shaped like TensorRT-LLM's single-node MPI session (tensorrt_llm/llmapi/mpi_session.py,
MpiPoolSession): mpi4py.futures.MPIPoolExecutor spawns `python -m mpi4py.futures.server` workers (children of the
singleton's orted), and each worker loads the engine library. Here the "library" is the path given on the command
line (a shared object named libtensorrt_llm.so), or nothing with --no-lib.

Prints the worker pids as JSON once they hold the library, then waits for a line on stdin.
"""

from __future__ import annotations

import json
import sys


def load(lib: str) -> int:
    import ctypes
    import os

    if lib:
        ctypes.CDLL(lib)
    return os.getpid()


if __name__ == "__main__":
    from mpi4py.futures import MPIPoolExecutor

    lib = "" if sys.argv[1] == "--no-lib" else sys.argv[1]
    with MPIPoolExecutor(max_workers=2) as pool:
        pids = sorted(set(pool.map(load, [lib, lib])))
        print(json.dumps(pids), flush=True)
        sys.stdin.readline()
