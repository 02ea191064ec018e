"""A process tree shaped like a real LLM engine, for tests and benchmarks.

Run as a script. It sets its process title the way vLLM does (setproctitle, which rewrites argv and comm), then
spawns children described on the command line. Each child is this same script in a child role, so every process
here was started by the test that started the root.

    python fake_engine.py --title VLLM::EngineCore --worker VLLM::Worker_TP0 --worker VLLM::Worker_TP1 \
        --compiler --ignore-term --forker --hog-rate-mib 1024 --hog-limit-mib 3000 --pidfile tree.pids

Roles:
- worker: sleeps; with --ignore-term ignores SIGTERM like an engine mid-allocation.
- compiler: a ninja -> nvcc -> cicc shaped chain of sleeping processes with -gencode arch=compute_121a arguments.
- forker: keeps forking short-lived children (a ninja still spawning nvcc); each child records its pid.
- hog: allocates and touches anonymous memory at a target rate up to a limit, then holds it. With
  --hog-until-available-mib it stops early, once MemAvailable is at or under that figure. With --hog-memfd it
  writes the memory into an unmapped memfd instead: shmem pages that drain MemAvailable but show in neither RSS nor
  oom_score, as a GB10's GPU allocations (driver-held system memory) do not.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import subprocess
import sys
import time

import setproctitle

MiB = 1024 * 1024


def start_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[19])


def record(pidfile: str | None, role: str, pid: int | None = None) -> None:
    """Append 'pid start_ticks role': the test can later signal exactly this process and no reuse of its pid."""
    if pidfile:
        pid = os.getpid() if pid is None else pid
        with open(pidfile, "a", encoding="ascii") as fh:
            fh.write(f"{pid} {start_ticks(pid)} {role}\n")


def spawn(args: list[str], title: str, pidfile: str | None, extra: list[str] | None = None) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, __file__, "--role", *args, "--title", title]
    if pidfile:
        cmd += ["--pidfile", pidfile]
    return subprocess.Popen(cmd + (extra or []))


def available_mib() -> int:
    with open("/proc/meminfo", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def hog(
    rate_mib: float, limit_mib: int, until_available_mib: int = 0, chunk_mib: int = 32, memfd: bool = False
) -> None:
    """Touch `limit_mib` of anonymous memory at about `rate_mib` MiB/s, then hold it. With `until_available_mib`,
    stop as soon as MemAvailable is at or under it: a test that must end up under its floor cannot count on N MiB
    touched lowering MemAvailable by N MiB. In a VM with free page reporting, memory a killed process gave back
    comes back into MemAvailable at about 16 MiB/s yet is allocatable at once: 1,536 MiB touched lowered
    MemAvailable by 880 MiB seconds after an earlier test's 3 GiB hog was killed (CI's VMs and this one)."""
    chunks = []
    block = b"\xa5" * (chunk_mib * MiB)
    start = time.monotonic()
    done = 0
    fd = os.memfd_create("sw-gpu-like") if memfd else -1
    while done < limit_mib:
        if until_available_mib and available_mib() <= until_available_mib:
            break
        if memfd:
            os.write(fd, block)  # shmem, never mapped: MemAvailable drops, RSS and oom_score do not see it
        else:
            mm = mmap.mmap(-1, chunk_mib * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            mm.write(block)  # writing every byte faults every page in: real RSS, real MemAvailable drop
            chunks.append(mm)
        done += chunk_mib
        ahead = done / rate_mib - (time.monotonic() - start)
        if ahead > 0:
            time.sleep(ahead)
    while True:
        time.sleep(60)


def shm_file(spec: str) -> mmap.mmap:
    """/dev/shm/NAME with MIB written, mapped (its fd closed: held by the mapping alone, as sem_open leaves it)."""
    name, _, mib = spec.partition(":")
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, b"\1" * (int(mib or "1") * MiB))
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="root")
    ap.add_argument("--title", default="VLLM::EngineCore")
    ap.add_argument("--worker", action="append", default=[])
    ap.add_argument("--compiler", action="store_true")
    ap.add_argument("--forker", action="store_true")
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--hog-rate-mib", type=float, default=0)
    ap.add_argument("--hog-limit-mib", type=int, default=0)
    ap.add_argument("--hog-until-available-mib", type=int, default=0)
    ap.add_argument("--hog-memfd", action="store_true")
    ap.add_argument("--hog-title", default="sw-hog")
    ap.add_argument("--pidfile")
    ap.add_argument("--depth", type=int, default=0)
    # NAME:MIB, repeatable: a named shared memory file in /dev/shm, written and mapped by the root (vLLM's `psm_*`
    # message queues, multiprocessing's `sem.mp-*`), which a SIGKILL leaves behind.
    ap.add_argument("--shm-file", action="append", default=[])
    args, _compiler_args = ap.parse_known_args()  # compiler-shaped argv after '--' is only for show

    setproctitle.setproctitle(args.title)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record(args.pidfile, args.role)
    term = ["--ignore-term"] if args.ignore_term else []

    if args.role == "root":
        _held_shm = [shm_file(spec) for spec in args.shm_file]  # mapped while the engine lives
        for title in args.worker:
            spawn(["worker", *term], title, args.pidfile)
        if args.compiler:
            spawn(["ninja", *term], "ninja", args.pidfile)
        if args.forker:
            spawn(["forker", *term], "ninja", args.pidfile)
        if args.hog_limit_mib:
            spawn(
                [
                    "hog",
                    *term,
                    "--hog-rate-mib",
                    str(args.hog_rate_mib),
                    "--hog-limit-mib",
                    str(args.hog_limit_mib),
                    "--hog-until-available-mib",
                    str(args.hog_until_available_mib),
                    *(["--hog-memfd"] if args.hog_memfd else []),
                ],
                args.hog_title,
                args.pidfile,
            )
    elif args.role == "ninja":
        spawn(
            ["nvcc", *term],
            "nvcc",
            args.pidfile,
            ["--", "-gencode", "arch=compute_121a,code=sm_121a", "-c", "flash_attn.cu"],
        )
    elif args.role == "nvcc":
        spawn(["cicc", *term], "cicc", args.pidfile)
    elif args.role == "forker":
        # A ninja that keeps spawning children during the kill; cheap `sleep` children, bounded in number.
        for _ in range(2000):
            child = subprocess.Popen(["sleep", "600"])
            record(args.pidfile, "leaf", child.pid)
            time.sleep(0.005)
    elif args.role == "hog":
        with open(f"/proc/{os.getpid()}/oom_score_adj", "w", encoding="ascii") as fh:
            fh.write("1000")  # if anything must die for this test's memory, let it be this
        hog(args.hog_rate_mib, args.hog_limit_mib, args.hog_until_available_mib, memfd=args.hog_memfd)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
