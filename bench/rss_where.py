"""Where each process of `sparkwatch run` holds its memory: RSS by mapping (smaps), after `--settle-s` idle.

    python3 bench/rss_where.py --settle-s 30 [--tree DIR]

Starts the daemon from `--tree` (default: this checkout), confined to this script's processes, waits, then sums each
process's smaps Rss and Pss by mapping name ([heap], [anon], each shared library, pydantic_core's .so, NVML's
libnvidia-ml) and prints the largest, with the Python modules the telemetry process holds (sparkwatch's own
`/proc/PID/...` cannot tell modules; `python -X importtime` of the same entry point does, see --importtime).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def by_mapping(pid: int) -> dict[str, tuple[float, float]]:
    """mapping name -> (Rss MiB, Pss MiB)."""
    out: dict[str, list[float]] = {}
    name = "?"
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):
                name = head[5] if len(head) > 5 else "[anon]"
                name = name.rsplit("/", 1)[-1] if "/" in name else name
            elif head and head[0] in ("Rss:", "Pss:"):
                cell = out.setdefault(name, [0.0, 0.0])
                cell[0 if head[0] == "Rss:" else 1] += int(head[1]) / 1024
    return {k: (v[0], v[1]) for k, v in out.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settle-s", type=float, default=30.0)
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        env.update(
            SPARKWATCH_STATE_DIR=str(tmp / "state"),
            SPARKWATCH_LISTEN=f"127.0.0.1:{free_port()}",
            SPARKWATCH_ANCESTOR_PID=str(os.getpid()),
            XDG_CONFIG_HOME=str(tmp / "xdg"),
        )
        daemon = subprocess.Popen([sys.executable, "-m", "sparkwatch", "run"], env=env, cwd=args.tree,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            guard = psutil.Process(daemon.pid)
            deadline = time.monotonic() + 60
            while not guard.children() and time.monotonic() < deadline:
                time.sleep(0.2)
            (telemetry,) = guard.children()
            time.sleep(args.settle_s)
            for label, proc in (("guard", guard), ("telemetry", telemetry)):
                maps = by_mapping(proc.pid)
                rss = sum(v[0] for v in maps.values())
                pss = sum(v[1] for v in maps.values())
                print(f"{label} (pid {proc.pid}): Rss {rss:.1f} MiB, Pss {pss:.1f} MiB; largest mappings (Rss / Pss):")
                for name, (r, p) in sorted(maps.items(), key=lambda kv: -kv[1][0])[: args.top]:
                    print(f"  {r:7.2f} {p:7.2f}  {name}")
        finally:
            daemon.terminate()
            daemon.wait(15)


if __name__ == "__main__":
    main()
