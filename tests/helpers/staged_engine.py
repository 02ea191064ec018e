"""A real process tree shaped like an LLM engine, for tests: titles set with setproctitle as vLLM does.

    python staged_engine.py --title VLLM::EngineCore --child VLLM::Worker_TP0 --child VLLM::Worker_TP1 \
        [--hold-mib 64] [--spawn-cwd DIR -- ninja -j2]

Prints the pids of the tree (root first) on one line once every child is up, then sleeps until killed.
A command after `--` runs as a child of the root (a JIT build: ninja -> nvcc -> cicc ...), started after the line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import setproctitle


def _hold(mib: int) -> bytearray:
    # Touch every page so the memory is resident and shows in RSS.
    buf = bytearray(mib * 1024 * 1024)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    return buf


def main() -> None:
    argv = sys.argv[1:]
    cmd: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser()
    parser.add_argument("--title", required=True)
    parser.add_argument("--child", action="append", default=[])
    parser.add_argument("--hold-mib", type=int, default=0)
    parser.add_argument("--spawn-cwd", default=None)
    parser.add_argument("--ignore-term", action="store_true", help="shrug off SIGTERM, as a busy vLLM does")
    parser.add_argument(
        "--teardown-step-s",
        type=float,
        default=None,
        help="on SIGTERM, stop the children one at a time this far apart, then exit: a staged teardown",
    )
    args = parser.parse_args(argv)
    stopping: list[bool] = []
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif args.teardown_step_s is not None:
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    pids = []
    for title in args.child:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            setproctitle.setproctitle(title)
            _kept = _hold(args.hold_mib)
            os.write(w, b"x")
            os.close(w)
            while True:
                time.sleep(3600)
        os.close(w)
        os.read(r, 1)  # the child has its title and memory
        os.close(r)
        pids.append(pid)
    setproctitle.setproctitle(args.title)
    kept = _hold(args.hold_mib)
    print(" ".join(str(p) for p in [os.getpid(), *pids]), flush=True)
    build = None
    if cmd:
        # The build runs while the root waits, as vLLM's main thread waits on the JIT build; reaped when it ends so a
        # finished ninja does not linger as a zombie in the tree.
        build = subprocess.Popen(cmd, cwd=args.spawn_cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while kept is not None and not stopping:
        if build is not None:
            build.poll()
        time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # only our own children
        os.waitpid(pid, 0)
        time.sleep(args.teardown_step_s or 0)


if __name__ == "__main__":
    main()
