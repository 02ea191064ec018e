"""An engine root that has `--children` children and keeps forking more, as a ninja or a worker pool does.

The root sets its title the way vLLM does (setproctitle), forks `--children` children that exec `sleep TOKEN` (a
real binary, a few hundred KiB each), then keeps forking one more every `--every-ms` until `--max-children`. Each
child's 'pid start_ticks role' line is appended to `--pidfile` by the root right after the fork. The `sleep` argument
is a duration unique to the test (`--token`), so a child forked but not yet recorded can still be found by its argv.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time

import setproctitle


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[19])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--children", type=int, default=1000)
    ap.add_argument("--max-children", type=int, default=2500)
    ap.add_argument("--every-ms", type=float, default=2.0)
    ap.add_argument("--token", required=True)
    ap.add_argument("--pidfile", required=True)
    args = ap.parse_args()
    setproctitle.setproctitle("VLLM::EngineCore")
    sleep = shutil.which("sleep") or "/bin/sleep"
    fh = open(args.pidfile, "a", encoding="ascii", buffering=1)  # noqa: SIM115 - held for the process's life

    def fork_one() -> None:
        pid = os.fork()
        if pid == 0:
            os.execv(sleep, [sleep, args.token])
        try:
            fh.write(f"{pid} {start_ticks(pid)} child\n")
        except OSError:
            pass

    for _ in range(args.children):
        fork_one()
    fh.write(f"{os.getpid()} {start_ticks(os.getpid())} ready\n")
    forked = args.children
    while True:
        if forked < args.max_children:
            fork_one()
            forked += 1
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(args.every_ms / 1000)


if __name__ == "__main__":
    main()
