"""A vLLM-shaped engine across two nodes without Ray, as vLLM's multiprocessing backend runs one (`vllm serve MODEL
--nnodes 2 --node-rank R --master-addr A --master-port P`, the non-zero ranks with `--headless`).

Installed by the test as a `vllm` script and run as `python .../vllm serve tiny-model --nnodes 2 ...`:
- node rank 0 listens on the master address and port (the rendezvous), rank 1 connects to it (retrying until it
  answers);
- each starts one child titled `VLLM::EngineCore` (setproctitle, as vllm/utils/system_utils.py does), which sleeps;
- each prints one JSON line (its pid and its child's) once the two are connected, and then blocks as vLLM does in a
  collective whose peer is gone: a dead peer is never noticed (vllm#32136: a headless node never exits after its
  head died; the head "blocks forever on the next collective").
The test signals only the processes it started.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

CHILD = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(3600)"


def option(name: str) -> str:
    return sys.argv[sys.argv.index(name) + 1]


def main() -> None:
    rank = int(option("--node-rank"))
    addr = (option("--master-addr"), int(option("--master-port")))
    if rank == 0:
        server = socket.create_server(addr)
        peer, _ = server.accept()
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                peer = socket.create_connection(addr, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    child = subprocess.Popen([sys.executable, "-c", CHILD])
    print(json.dumps({"pid": os.getpid(), "child": child.pid}), flush=True)
    while peer.fileno() >= 0:  # the connection stays open, and its loss is never looked at
        time.sleep(3600)


if __name__ == "__main__":
    main()
