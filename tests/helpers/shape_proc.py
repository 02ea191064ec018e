"""One process of an engine's real shape, for the table test (tests/test_engine_shapes.py).

Installed by the test under the real names (a `vllm` console script with a Python shebang, a `vllm/entrypoints/...`
module on PYTHONPATH, an `offline_infer.py` script) or run as `python -c ... --multiprocessing-fork` the way
multiprocessing's spawn starts vLLM's EngineCore. Everything comes from the environment so that argv stays exactly
what the real engine shows:

- SHAPE_TITLE: setproctitle() to this, as vLLM (vllm/utils/system_utils.py) and SGLang do;
- SHAPE_COMM: prctl(PR_SET_NAME) only, leaving argv alone (a process that merely *calls* itself sshd);
- SHAPE_LIB: ctypes-load this shared object (a generic MPI worker with an engine library mapped);
- SHAPE_CHILDREN: JSON list of {"argv": [...], "env": {...}} to start as children, each with its own env.

Then it sleeps until killed. The test signals only the processes it started.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import time


def main() -> None:
    env = dict(os.environ)
    children = json.loads(env.pop("SHAPE_CHILDREN", "[]"))
    title = env.pop("SHAPE_TITLE", "")
    comm = env.pop("SHAPE_COMM", "")
    lib = env.pop("SHAPE_LIB", "")
    if lib:
        ctypes.CDLL(lib)
    if title:
        import setproctitle

        setproctitle.setproctitle(title)
    if comm:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, comm.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    for child in children:
        subprocess.Popen(child["argv"], env={**env, **child.get("env", {})})
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
