"""Soak benchmark: a real `sparkwatch run` under process churn and 1 Hz scrapes; does its RSS stay flat?

What runs:
- the daemon, confined to this bench's own processes (`ancestor_pid`), with a floor far below MemAvailable and
  `dry_run` (nothing is ever signalled), `mlock = false` (so RSS is what the heap really holds, not every mapped page),
  a loopback webhook receiver;
- churn: `--churn-per-min` short-lived processes a minute (default 1,000), real `sleep` binaries run under the names
  the scanner classifies (llama-server engines, plain workers), each living 2-8 s,
  so every pid-keyed cache sees thousands of pids come and go;
- a scrape of /metrics every second.

RSS (VmRSS of the daemon) is sampled every 10 s. After `--warmup-s` the growth is the least-squares slope of RSS over
time, in MiB per hour, beside the first and last sample. Target: <= 1 MiB/hour after warm-up.

    nohup .venv/bin/python bench/soak_bench.py --duration-s 3600 --out bench/RESULTS-soak.md > /tmp/soak.log 2>&1 &
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tables import publish

ROOT = Path(__file__).resolve().parent.parent

# No compiler names (nvcc, cicc): the compile census is machine-wide, so they would page every other sparkwatch on
# the box with a compile burst.
NAMES = ("llama-server", "worker", "python3", "sleep")


def vm_rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Quiet(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(204)
        self.end_headers()
        _Quiet.received += 1

    def log_message(self, *args: object) -> None:
        pass

    received = 0


def child_pids(pid: int) -> list[int]:
    """The direct children of `pid` (the guard process's telemetry process)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as fh:
                out += [int(x) for x in fh.read().split()]
    except (OSError, ValueError):
        pass
    return out


def slope_mib_per_hour(samples: list[tuple[float, int]]) -> float:
    if len(samples) < 2:
        return float("nan")
    xs = [t / 3600 for t, _ in samples]
    ys = [kib / 1024 for _, kib in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=3600)
    ap.add_argument("--warmup-s", type=float, default=600)
    ap.add_argument("--churn-per-min", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    # A bench started with nohup in the background ignores SIGINT: SIGTERM stops it cleanly too (the daemon and the
    # churn are stopped in the `finally` below).
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))

    tmp = Path(tempfile.mkdtemp(prefix="sparkwatch-soak-"))
    bindir = tmp / "bin"
    bindir.mkdir()
    sleep = shutil.which("sleep") or "/bin/sleep"
    for name in NAMES:
        shutil.copy(sleep, bindir / name)  # a copy, not a symlink: comm is the executable's own name
    receiver = ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        {
            "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),
            "SPARKWATCH_STATE_DIR": str(tmp / "state"),
            "SPARKWATCH_LISTEN": f"127.0.0.1:{port}",
            "SPARKWATCH_JIT_CACHE_DIRS": f'["{tmp / "jit"}"]',
            "SPARKWATCH_VLLM_CACHE_DIRS": f'["{tmp / "vllm"}"]',
            "SPARKWATCH_FLOOR": "1GiB",
            "SPARKWATCH_DRY_RUN": "true",
            "SPARKWATCH_MLOCK": "false",
            "SPARKWATCH_WEBHOOK_URL": f"http://127.0.0.1:{receiver.server_address[1]}/hook",
            "XDG_CONFIG_HOME": str(tmp / "xdg"),
            "PYTHONPATH": str(ROOT),
        }
    )
    log = (tmp / "daemon.log").open("w")
    daemon = subprocess.Popen([sys.executable, "-m", "sparkwatch", "run"], env=env, stderr=log, stdout=log)
    children: list[subprocess.Popen[bytes]] = []
    samples: list[tuple[float, int]] = []  # the whole agent: the guard process and its telemetry process
    by_process: dict[str, list[tuple[float, int]]] = {"guard": [], "telemetry": []}
    scrapes_ok = scrapes_failed = spawned = 0
    t0 = time.monotonic()
    next_sample = next_scrape = t0
    interval = 60.0 / args.churn_per_min
    next_spawn = t0
    rng = random.Random(1)
    try:
        time.sleep(3)
        while (now := time.monotonic()) - t0 < args.duration_s:
            if daemon.poll() is not None:
                print(f"daemon exited with {daemon.returncode}", file=sys.stderr)
                break
            while next_spawn <= now:
                name = rng.choice(NAMES)
                children.append(
                    subprocess.Popen([str(bindir / name), f"{rng.uniform(2, 8):.2f}"], stdout=subprocess.DEVNULL)
                )
                spawned += 1
                next_spawn += interval
            children = [c for c in children if c.poll() is None]
            if now >= next_scrape:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                        r.read()
                    scrapes_ok += 1
                except OSError:
                    scrapes_failed += 1
                next_scrape += 1.0
            if now >= next_sample:
                guard_kib = vm_rss_kib(daemon.pid)
                telemetry_kib = sum(vm_rss_kib(c) or 0 for c in child_pids(daemon.pid))
                if guard_kib is not None:
                    kib = guard_kib + telemetry_kib
                    samples.append((now - t0, kib))
                    by_process["guard"].append((now - t0, guard_kib))
                    if telemetry_kib:
                        by_process["telemetry"].append((now - t0, telemetry_kib))
                    print(
                        f"{now - t0:7.0f} s  RSS {kib / 1024:7.2f} MiB (guard {guard_kib / 1024:.2f}, telemetry "
                        f"{telemetry_kib / 1024:.2f})  spawned {spawned}",
                        flush=True,
                    )
                next_sample += 10.0
            time.sleep(max(0.0, min(next_spawn, next_scrape, next_sample) - time.monotonic()))
    finally:
        daemon.terminate()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        for c in children:
            c.kill()
            c.wait()
        receiver.shutdown()
        log.close()

    elapsed = time.monotonic() - t0
    after = [(t, k) for t, k in samples if t >= args.warmup_s]
    growth = slope_mib_per_hour(after)
    first = after[0][1] / 1024 if after else float("nan")
    last = after[-1][1] / 1024 if after else float("nan")
    peak = max((k for _, k in samples), default=0) / 1024
    cmd = "    .venv/bin/python bench/soak_bench.py " + " ".join(sys.argv[1:])
    rows = [
        "# Soak: RSS of a real `sparkwatch run` (guard and telemetry processes) under process churn and 1 Hz scrapes",
        "",
        "Command (from the repository root):",
        "",
        cmd,
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} vCPUs, Python {platform.python_version()}, shared with "
        "other test runs. Daemon: dry run, floor 1GiB, mlock off, webhook to a loopback receiver.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| duration | {elapsed / 60:.1f} min (warm-up {args.warmup_s / 60:.0f} min) |",
        f"| processes spawned | {spawned} ({spawned / max(elapsed / 60, 1e-9):.0f} a minute) |",
        f"| scrapes ok / failed | {scrapes_ok} / {scrapes_failed} |",
        f"| alerts received | {_Quiet.received} |",
        f"| RSS after warm-up, first / last | {first:.2f} / {last:.2f} MiB |",
        f"| RSS peak | {peak:.2f} MiB |",
        f"| RSS growth after warm-up (least-squares slope) | {growth:+.2f} MiB/hour (target <= 1) |",
        *(
            f"| {name} process: RSS first / last, slope after warm-up | {after_p[0][1] / 1024:.2f} / "
            f"{after_p[-1][1] / 1024:.2f} MiB, {slope_mib_per_hour(after_p):+.2f} MiB/hour |"
            for name, series in by_process.items()
            if (after_p := [(t, k) for t, k in series if t >= args.warmup_s])
        ),
        f"| daemon exit | {daemon.returncode} |",
        "",
    ]
    text = "\n".join(rows)
    publish(text, args.out)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if growth <= 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
