"""Floor-crossing latency with a hostile user present (issue 27, declarations the kernel vouches for).

A root guard reads every user's `/run/user/UID/sparkwatch/launched/`. In the hostile arm, `nobody` (uid 65534) has
filled its `launched/` with ENTRIES directory entries and touches it every 20 ms (a reader that lists it on every
change pays for the whole listing each time); in the quiet arm nobody's runtime dir is empty. Each episode runs a real
`sparkwatch run` (as root, in a mount namespace where a scratch directory is /run/user), a fake vLLM tree whose hog
touches anonymous memory at RATE toward a floor set 1.5 GiB under the current MemAvailable, and a 2 ms sampler of
MemAvailable. A third arm runs earlyoom (`-M floor,floor -r 0 --prefer '^sw-hog$'`: straight to SIGKILL of the hog at
the floor) in the same run with the hostile directory present, the tool an owner would otherwise run. Arms rotate
A B C, B C A, C A B … Reported per episode: the fill rate in the 100 ms before the kill, where
MemAvailable was at its lowest relative to the floor (positive: the kill landed above it), the trigger, and the
guard's own detect → last member reaped.

    flock /tmp/sw-pressure.lock .venv/bin/python bench/decl_bench.py --episodes 5 --out bench/RESULTS-decl.md
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.eventlog import read_events  # noqa: E402
from sparkwatch.common.sources.meminfo import MeminfoReader  # noqa: E402
from sparkwatch.common.sources.procs import parse_stat, read_start_ticks  # noqa: E402
from tests.conftest import FAKE_ENGINE, pids_in  # noqa: E402
from tests.daemon import sparkwatch_run  # noqa: E402
from tests.memsampler import Sampler  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
NOBODY = 65534
HEADROOM = int(1.5 * GiB)
HOG_EXTRA = 1 * GiB
ARMS = ("quiet", "hostile", "earlyoom")
AS_NOBODY = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


@dataclass
class Episode:
    arm: str
    rate_mib_s: float | None
    margin_mib: float  # lowest MemAvailable - floor (positive: never reached the floor)
    trigger: str
    detect_to_reaped_ms: float | None


def make_entries(directory: Path, count: int) -> None:
    """`count` entries, cheaply: hard links (ext4 allows 65,000 per inode) to a few empty files."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for j in range(0, count, 60_000):
            src = directory.parent / f"src{j}"
            src.touch()
            for i in range(j, min(j + 60_000, count)):
                os.link(src, f"{i:07d}.json", dst_dir_fd=fd)
    finally:
        os.close(fd)


def prefix(users: Path, system: Path) -> list[str]:
    script = 'mount --bind "$1" /run/user && mount --bind "$2" /run/sparkwatch && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(users), str(system)]


@contextlib.contextmanager
def earlyoom_running(floor: int) -> Iterator[None]:
    """earlyoom 1.7 at the same floor, straight to SIGKILL (-M term,kill both at it), preferring the hog."""
    kib = floor // 1024
    proc = subprocess.Popen(["earlyoom", "-M", f"{kib},{kib}", "-r", "0", "--prefer", "^sw-hog$"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(0.5)  # it reads meminfo first: let it poll before the hog starts
    try:
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def _hog_gone(pidfile: Path) -> bool:
    hogs = [
        (pid, ticks) for pid, (ticks, role) in (pids_in(pidfile) if pidfile.exists() else {}).items() if role == "hog"
    ]
    return bool(hogs) and not any(_alive(pid, ticks) for pid, ticks in hogs)


def _alive(pid: int, ticks: int) -> bool:
    """Running with that start time: a killed hog stays a zombie until its parent reaps it, and that is gone."""
    try:
        _comm, state, _ppid, _flags, start, _rss = parse_stat(pid, Path(f"/proc/{pid}/stat").read_bytes())
    except (OSError, ValueError):
        return False
    return start == ticks and state not in ("Z", "X")


def _end_tree(engine: subprocess.Popen[bytes], pidfile: Path) -> None:
    """What is left of this episode's tree (started here, checked by start time), then its root reaped."""
    for pid, (ticks, _role) in (pids_in(pidfile) if pidfile.exists() else {}).items():
        if read_start_ticks("/proc", pid) == ticks:
            os.kill(pid, signal.SIGKILL)
    engine.kill()
    engine.wait(10)


def episode(arm: str, rate_mib: int, tmp: Path, users: Path, system: Path) -> Episode:
    with MeminfoReader() as r:
        floor = r.read().available_bytes - HEADROOM
    pidfile = tmp / "tree.pids"
    daemon = None
    with contextlib.ExitStack() as stack:
        if arm == "earlyoom":
            stack.enter_context(earlyoom_running(floor))
        else:
            env = {"SPARKWATCH_FLOOR": f"{floor}B"}
            daemon = stack.enter_context(sparkwatch_run(tmp, env=env, prefix=prefix(users, system)))
        sampler = Sampler()
        sampler.start()
        engine = subprocess.Popen([sys.executable, str(FAKE_ENGINE), "--hog-rate-mib", str(rate_mib), "--hog-limit-mib",
                                   str((HEADROOM + HOG_EXTRA) // MiB), "--pidfile", str(pidfile)])  # fmt: skip
        stack.callback(_end_tree, engine, pidfile)  # also when the bench is interrupted mid-episode
        deadline = time.monotonic() + 60
        kill: dict[str, object] | None = None
        while kill is None and time.monotonic() < deadline:
            if daemon is not None:
                kill = next((e for e in read_events(daemon.events_path) if e["kind"] == "kill"), None)
            elif _hog_gone(pidfile):
                kill = {"trigger": "earlyoom"}
            time.sleep(0.05 if daemon is not None else 0.005)
        time.sleep(0.3)
        sampler.stop.set()
        sampler.join()
    samples = sampler.samples
    low_t, low = min(samples, key=lambda s: s[1])
    if kill is None:  # the pool moved under the episode (another process freed memory): said, not dropped
        return Episode(arm, None, (low - floor) / MiB, "no kill in 60 s", None)
    window = [(t, a) for t, a in samples if low_t - 0.1 <= t <= low_t]
    rate = (window[0][1] - window[-1][1]) / (window[-1][0] - window[0][0]) / MiB if len(window) >= 2 else None
    own = None
    if kill.get("signal_to_reaped_ms") is not None:
        own = float(str(kill["detect_to_signal_ms"])) + float(str(kill["signal_to_reaped_ms"]))
    return Episode(arm, rate, (low - floor) / MiB, str(kill["trigger"]), own)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=5, help="per arm")
    ap.add_argument("--rate-mib", type=int, default=400)
    ap.add_argument("--entries", type=int, default=500_000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("setpriv", "unshare", "earlyoom")):
        sys.exit("needs root, setpriv, unshare and earlyoom")
    made = not Path("/run/sparkwatch").exists()
    if made:
        Path("/run/sparkwatch").mkdir(mode=0o755)
    scratch = Path(tempfile.mkdtemp(prefix="sw-decl-bench-", dir="/tmp"))
    toucher: subprocess.Popen[bytes] | None = None
    episodes: list[Episode] = []
    try:
        scratch.chmod(0o755)
        system = scratch / "system"
        system.mkdir()
        quiet, hostile = scratch / "quiet", scratch / "hostile"
        for users in (quiet, hostile):
            (users / str(NOBODY)).mkdir(parents=True)
            os.chown(users / str(NOBODY), NOBODY, NOBODY)
        big = hostile / str(NOBODY) / "sparkwatch" / "launched"
        big.mkdir(parents=True)
        started = time.monotonic()
        make_entries(big, args.entries)
        made_s = time.monotonic() - started
        for path in (big.parent, big):
            os.chown(path, NOBODY, NOBODY)
        touch = 'while :; do touch "$1"; sleep 0.02; done'
        toucher = subprocess.Popen([*AS_NOBODY, "sh", "-c", touch, "sh", str(big)])
        n = 0
        for i in range(args.episodes):
            for arm in ARMS[i % 3 :] + ARMS[: i % 3]:
                n += 1
                ep_dir = scratch / f"ep{n}"
                ep_dir.mkdir()
                ep = episode(arm, args.rate_mib, ep_dir, quiet if arm == "quiet" else hostile, system)
                episodes.append(ep)
                print(ep, flush=True)
                time.sleep(1)
    finally:
        if toucher is not None:
            toucher.send_signal(signal.SIGKILL)
            toucher.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)
        if made:
            try:
                Path("/run/sparkwatch").rmdir()
            except OSError:
                pass

    lines = [
        "# Floor crossing with a hostile user's declarations directory",
        "",
        f"Command: `flock /tmp/sw-pressure.lock .venv/bin/python bench/decl_bench.py {' '.join(sys.argv[1:])}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, kernel {platform.release()}. Floor = MemAvailable − "
        f"{HEADROOM // MiB} MiB; the hog fills at {args.rate_mib} MiB/s and would go {HOG_EXTRA // MiB} MiB under it. "
        f"Hostile arm: nobody's `launched/` holds {args.entries:,} entries (made in {made_s:.0f} s) and is touched "
        "every 20 ms; quiet arm: nobody's runtime dir is empty; earlyoom arm: earlyoom 1.7 at the same floor "
        "(`-M floor,floor -r 0 --prefer '^sw-hog$'`), the hostile directory present. Arms rotate A B C, B C A, C A B.",
        "",
        "rate = fill rate in the 100 ms before MemAvailable's lowest point (MiB/s); lowest − floor = how far above "
        "(positive) or under the floor MemAvailable went (MiB); detect→reaped = the guard's own record "
        "of the kill (sparkwatch only).",
        "",
        "| arm | rate MiB/s | lowest − floor MiB | trigger | detect→reaped ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for ep in episodes:
        rate = "-" if ep.rate_mib_s is None else f"{ep.rate_mib_s:,.0f}"
        own = "-" if ep.detect_to_reaped_ms is None else f"{ep.detect_to_reaped_ms:,.0f}"
        lines.append(f"| {ep.arm} | {rate} | {ep.margin_mib:,.0f} | {ep.trigger} | {own} |")
    lines += ["", "Medians:", "", "| arm | lowest − floor MiB | detect→reaped ms |", "| --- | --- | --- |"]
    for arm in ARMS:
        mine = [e for e in episodes if e.arm == arm]
        if not mine:
            continue
        margin = statistics.median(e.margin_mib for e in mine if e.trigger != "no kill in 60 s")
        owns = [e.detect_to_reaped_ms for e in mine if e.detect_to_reaped_ms is not None]
        own = f"{statistics.median(owns):,.0f}" if owns else "-"
        lines.append(f"| {arm} | {margin:,.0f} | {own} |")
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
