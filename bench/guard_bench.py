"""Guard benchmark: sparkwatch against earlyoom on the same real workload, episodes alternated A B A B.

Each episode starts one contender, then a fake vLLM tree whose hog child touches anonymous memory at a target rate
toward a floor set 2 GiB under the current MemAvailable (so it is safe on any box), and would go 1.5 GiB under it
if nobody acted. A 2 ms sampler records MemAvailable; pidfds record when the victims exit.

Reported per episode: the fill rate at the floor crossing (the VMs' real fill rate comes in host-side bursts, so the
target is not what the hog gets), the overshoot under the floor, reaction = overshoot / rate, and floor -> reaped.
earlyoom kills the hog only (highest oom_score: the hog sets oom_score_adj 1000 and is --prefer'd); sparkwatch kills
the whole tree. Then each contender's idle CPU and RSS over a minute.

    .venv/bin/python bench/guard_bench.py --episodes 5 --rates 1,2,4 --idle-s 60 --out bench/RESULTS-guard.md

`--scenario two-engine`: a serving engine that loaded long ago (VLLM::EngineCore with a worker holding steady RSS)
and a second engine starting beside it, whose worker's spike goes where a GB10's GPU allocations go: into memory that
drains MemAvailable but shows in neither RSS nor oom_score (an unmapped memfd). Reported per episode: did the serving
engine survive (spare rate), crossing -> box safe (the spike's memory freed), processes killed. earlyoom runs as an
owner would point it at engines (`--prefer '^VLLM::'`) and picks by oom_score, as it does.

    .venv/bin/python bench/guard_bench.py --scenario two-engine --episodes 6 --rates 1 --idle-s 0 \
        --out bench/RESULTS-guard-two-engine.md
"""

from __future__ import annotations

import argparse
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.sources.meminfo import MeminfoReader  # noqa: E402
from sparkwatch.common.sources.procs import read_start_ticks  # noqa: E402
from tests.conftest import FAKE_ENGINE, pids_in  # noqa: E402
from tests.daemon import free_port  # noqa: E402
from tests.memsampler import Sampler  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
HEADROOM = 2 * GiB
HOG_EXTRA = int(1.5 * GiB)


@dataclass
class Episode:
    contender: str
    target_rate: int
    rate_at_crossing: float | None  # bytes/s over the 100 ms before the crossing
    overshoot: int  # bytes under the floor at the minimum (0 if it never crossed)
    crossed: bool
    floor_to_reaped_s: float | None  # crossing -> last victim gone
    margin_at_kill: int  # MemAvailable - floor at its lowest (positive: never reached the floor)
    own_detect_to_reaped_ms: float | None = None  # sparkwatch's own record: detect -> signal -> last reaped


def start_contender(
    name: str, floor: int, tmp: Path, prefer: str = "^sw-hog$"
) -> subprocess.Popen[str] | subprocess.Popen[bytes]:
    if name == "sparkwatch":
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        env.update(
            {
                "SPARKWATCH_FLOOR": f"{floor}B",
                "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),
                "SPARKWATCH_STATE_DIR": str(tmp / "state"),
                "SPARKWATCH_LISTEN": f"127.0.0.1:{free_port()}",
                "XDG_CONFIG_HOME": str(tmp / "xdg"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        daemon = subprocess.Popen(
            [str(ROOT / ".venv/bin/python"), "-m", "sparkwatch", "run"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert daemon.stderr is not None
        for line in daemon.stderr:  # wait until it polls
            if "sparkwatch: running:" in line:
                break
        threading.Thread(target=lambda: daemon.stderr.read() if daemon.stderr else None, daemon=True).start()
        return daemon
    kib = floor // 1024
    # -M term,kill in KiB, both at the floor, so earlyoom goes straight to SIGKILL like sparkwatch.
    proc = subprocess.Popen(
        ["earlyoom", "-M", f"{kib},{kib}", "-r", "0", "--prefer", prefer],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    return proc


def run_episode(contender: str, target_rate: int, tmp: Path) -> Episode:
    avail = MeminfoReader().read().available_bytes
    floor = avail - HEADROOM
    daemon = start_contender(contender, floor, tmp)
    sampler = Sampler()
    sampler.start()
    pidfile = tmp / f"tree-{time.monotonic_ns()}.pids"
    engine = _engine(
        [
            "--worker",
            "VLLM::Worker_TP0",
            "--compiler",
            "--ignore-term",
            "--hog-rate-mib",
            str(target_rate * 1024),
            "--hog-limit-mib",
            str((HEADROOM + HOG_EXTRA) // MiB),
        ],
        pidfile,
        lambda recorded: "hog" in (role for _ticks, role in recorded.values()),
    )
    hog_pid = next(pid for pid, (_, role) in pids_in(pidfile).items() if role == "hog")
    fds = _pidfds(pidfile)
    # earlyoom kills only the hog; sparkwatch the whole tree: wait for what each is supposed to kill.
    watch = fds if contender == "sparkwatch" else {fd: pid for fd, pid in fds.items() if pid == hog_pid}
    poller = select.poll()
    for fd in watch:
        poller.register(fd, select.POLLIN)
    exits: dict[int, float] = {}
    stop_at = time.monotonic() + 30
    while len(exits) < len(watch) and time.monotonic() < stop_at:
        for fd, _ in poller.poll(100):
            exits.setdefault(fd, time.monotonic())
            poller.unregister(fd)
    time.sleep(0.3)
    sampler.stop.set()
    sampler.join()
    # Clean up: whatever is left of this episode's tree (started by us, checked by start time), then the contender.
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    for pid, (ticks, _) in pids_in(pidfile).items():
        if read_start_ticks("/proc", pid) == ticks:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
    engine.wait(10)
    daemon.terminate()
    daemon.wait(10)

    samples = sampler.samples
    crossing = next((t for t, a in samples if a <= floor), None)
    min_avail = min(a for _, a in samples)
    last_exit = max(exits.values()) if len(exits) == len(watch) and exits else None
    first_exit = min(exits.values()) if exits else None
    # The fill rate where it matters: the 100 ms before the crossing, or before the kill if it came first.
    moments = [t for t in (crossing, first_exit) if t is not None]
    rate = None
    if moments:
        at = min(moments)
        window = [(t, a) for t, a in samples if at - 0.1 <= t <= at]
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            rate = (window[0][1] - window[-1][1]) / (window[-1][0] - window[0][0])
    own = None
    if contender == "sparkwatch":
        from sparkwatch.common.eventlog import read_events

        kills = [e for e in read_events(tmp / "state" / "events.jsonl") if e["kind"] == "kill"]
        if kills and kills[-1].get("signal_to_reaped_ms") is not None:
            own = float(kills[-1]["detect_to_signal_ms"]) + float(kills[-1]["signal_to_reaped_ms"])
    # How close it came: an exiting process frees its memory before its pidfd reports the exit, so the sample
    # "just before the exit" is already too late to show it; the minimum is honest.
    margin = min_avail - floor
    return Episode(
        contender=contender,
        target_rate=target_rate,
        rate_at_crossing=rate,
        overshoot=max(0, floor - min_avail),
        crossed=crossing is not None,
        floor_to_reaped_s=(last_exit - crossing) if (last_exit and crossing) else None,
        margin_at_kill=margin,
        own_detect_to_reaped_ms=own,
    )


SERVE_MIB = 512  # the serving engine's worker RSS (on a GB10 its weights sit in GPU memory that RSS does not show)


@dataclass
class TwoEngineEpisode:
    contender: str
    target_rate: int
    spared: bool  # every process of the serving engine still alive at the end
    safe_after_s: float | None  # crossing (or first kill, if earlier) -> the spike's memory holder reaped
    killed: int  # processes of ours that died
    crossed: bool
    overshoot: int


def _engine(
    args: list[str], pidfile: Path, ready: Callable[[dict[int, tuple[int, str]]], bool]
) -> subprocess.Popen[bytes]:
    """A fake engine tree (tests/helpers/fake_engine.py), once its pidfile shows it `ready` (20 s at most)."""
    proc = subprocess.Popen([sys.executable, str(FAKE_ENGINE), *args, "--pidfile", str(pidfile)])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (pidfile.exists() and ready(pids_in(pidfile))):
        time.sleep(0.01)
    return proc


def _pidfds(pidfile: Path) -> dict[int, int]:
    out = {}
    for pid, (ticks, _) in pids_in(pidfile).items():
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        if read_start_ticks("/proc", pid) == ticks:
            out[fd] = pid
        else:
            os.close(fd)
    return out


def run_two_engine_episode(contender: str, target_rate: int, tmp: Path) -> TwoEngineEpisode:
    stamp = time.monotonic_ns()
    serve_file, spike_file = tmp / f"serve-{stamp}.pids", tmp / f"spike-{stamp}.pids"
    serve = _engine(
        ["--hog-title", "VLLM::Worker_TP0", "--hog-rate-mib", "2048", "--hog-limit-mib", str(SERVE_MIB)],
        serve_file,
        lambda recorded: len(recorded) >= 2,
    )
    time.sleep(1.0)  # weights loaded
    floor = MeminfoReader().read().available_bytes - HEADROOM
    daemon = start_contender(contender, floor, tmp, prefer="^VLLM::")
    time.sleep(2.0)  # the serving engine has been steady for a while when the second one starts
    sampler = Sampler()
    sampler.start()
    spike = _engine(
        [
            "--ignore-term",
            "--hog-title",
            "VLLM::Worker_TP0",
            "--hog-memfd",
            "--hog-rate-mib",
            str(target_rate * 1024),
            "--hog-limit-mib",
            str((HEADROOM + HOG_EXTRA) // MiB),
        ],
        spike_file,
        lambda recorded: len(recorded) >= 2,
    )
    serve_fds, spike_fds = _pidfds(serve_file), _pidfds(spike_file)
    holder = next((fd for fd, pid in spike_fds.items() if pids_in(spike_file)[pid][1] == "hog"), None)
    poller = select.poll()
    for fd in (*serve_fds, *spike_fds):
        poller.register(fd, select.POLLIN)
    exits: dict[int, float] = {}
    stop_at = time.monotonic() + 30
    while holder is not None and holder not in exits and time.monotonic() < stop_at:
        for fd, _ in poller.poll(50):
            exits.setdefault(fd, time.monotonic())
            poller.unregister(fd)
    time.sleep(2.5)  # anything the contender kills after the spike is gone counts too (a settle, a late escalation)
    for fd, _ in poller.poll(0):
        exits.setdefault(fd, time.monotonic())
    sampler.stop.set()
    sampler.join()
    daemon.terminate()
    daemon.wait(10)
    for pidfile in (serve_file, spike_file):
        for pid, (ticks, _) in pids_in(pidfile).items():
            if read_start_ticks("/proc", pid) == ticks:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
    for fd in (*serve_fds, *spike_fds):
        os.close(fd)
    serve.wait(10)
    spike.wait(10)
    samples = sampler.samples
    crossing = next((t for t, a in samples if a <= floor), None)
    first_exit = min(exits.values()) if exits else None
    ref = min((t for t in (crossing, first_exit) if t is not None), default=None)
    safe = exits.get(holder) if holder is not None else None
    return TwoEngineEpisode(
        contender=contender,
        target_rate=target_rate,
        spared=not any(fd in exits for fd in serve_fds),
        safe_after_s=(safe - ref) if (safe is not None and ref is not None) else None,
        killed=len(exits),
        crossed=crossing is not None,
        overshoot=max(0, floor - min(a for _, a in samples)),
    )


def two_engine_report(episodes: list[TwoEngineEpisode], argv: list[str]) -> str:
    lines = [
        "# Guard benchmark, two engines: sparkwatch vs earlyoom",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/guard_bench.py', *argv])}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {psutil.virtual_memory().total / GiB:.1f} GiB, "
        f"kernel {platform.release()}, {earlyoom_version()}. Episodes alternate A B A B.",
        "",
        f"A serving engine (VLLM::EngineCore + VLLM::Worker_TP0 holding {SERVE_MIB} MiB RSS, steady) runs; the floor "
        f"is set {HEADROOM // MiB} MiB under MemAvailable; a second engine starts and its worker's spike goes into "
        "memory that drains MemAvailable but shows in neither RSS nor oom_score (an unmapped memfd: what a GB10's GPU "
        f"allocations look like), {HOG_EXTRA // MiB} MiB past the floor if nobody acts. earlyoom: "
        "`-M floor,floor -r 0 --prefer '^VLLM::'`. sparkwatch: defaults, no GPU figures (no NVML here).",
        "",
        "spared = the serving engine survived; safe after = from the floor crossing (or the first kill, if earlier) "
        "to the spike's memory holder reaped (ms; '-' = never within 30 s); killed = processes of the two engines "
        "that died; overshoot = how far MemAvailable went under the floor (MiB).",
        "",
        "| target GiB/s | contender | spared | safe after ms | killed | overshoot MiB |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for ep in episodes:
        safe = "-" if ep.safe_after_s is None else f"{ep.safe_after_s * 1000:,.0f}"
        if not ep.crossed and not ep.killed:
            safe = "not in danger (MemAvailable never reached the floor: others on the box freed memory)"
        lines.append(
            f"| {ep.target_rate} | {ep.contender} | {'yes' if ep.spared else 'no'} | {safe} | {ep.killed} | "
            f"{ep.overshoot / MiB:,.0f} |"
        )
    lines += [
        "",
        "Summary (medians over the episodes where the box was in danger):",
        "",
        "| contender | spare rate | safe after ms | processes killed | overshoot MiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c in ("sparkwatch", "earlyoom"):
        eps = [e for e in episodes if e.contender == c and (e.crossed or e.killed)]  # the box was in danger
        safe_ms = [e.safe_after_s * 1000 for e in eps if e.safe_after_s is not None]
        lines.append(
            f"| {c} | {sum(e.spared for e in eps)}/{len(eps)} | "
            f"{statistics.median(safe_ms):,.0f} ({len(safe_ms)}/{len(eps)} safe) | "
            if safe_ms
            else f"| {c} | {sum(e.spared for e in eps)}/{len(eps)} | - (0/{len(eps)} safe) | "
        )
        lines[-1] += (
            f"{statistics.median(e.killed for e in eps):,.0f} | "
            f"{statistics.median(e.overshoot for e in eps) / MiB:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def idle_cost(contender: str, seconds: float, tmp: Path) -> tuple[float, float]:
    """(% of one core, RSS MiB) of a one-process contender (earlyoom) left alone with lots of headroom; sparkwatch's
    two processes are measured by split_rss."""
    floor = 1 << 30  # the smallest floor sparkwatch's config accepts
    proc = start_contender(contender, floor, tmp)
    ps = psutil.Process(proc.pid)
    time.sleep(5)  # start-up settles
    t0, c0 = time.monotonic(), sum(ps.cpu_times()[:2])
    rss = []
    end = t0 + seconds
    while time.monotonic() < end:
        rss.append(ps.memory_info().rss)
        time.sleep(1)
    cpu = (sum(ps.cpu_times()[:2]) - c0) / (time.monotonic() - t0) * 100
    proc.terminate()
    proc.wait(10)
    return cpu, max(rss) / MiB


def split_rss(seconds: float, tmp: Path) -> dict[str, tuple[float, float, float]]:
    """The daemon's two processes left alone: process → (% of one core, max RSS MiB, VmLck MiB). The guard (the
    unit's main PID, mlocked) against its ≤ 25 MiB target; the telemetry child; and the whole agent (both)."""
    proc = start_contender("sparkwatch", 512 * MiB, tmp)
    guard = psutil.Process(proc.pid)
    time.sleep(5)  # start-up settles: telemetry imports pydantic, prometheus_client, pynvml
    (telemetry,) = guard.children()
    procs = {"guard": guard, "telemetry": telemetry}
    t0 = time.monotonic()
    cpu0 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    peak = dict.fromkeys(procs, 0)
    total_peak = 0
    while time.monotonic() < t0 + seconds:
        now = {name: p.memory_info().rss for name, p in procs.items()}
        peak = {name: max(peak[name], now[name]) for name in procs}
        total_peak = max(total_peak, sum(now.values()))
        time.sleep(1)
    wall = time.monotonic() - t0
    out: dict[str, tuple[float, float, float]] = {}
    cpu_total = 0.0
    for name, p in procs.items():
        cpu = (sum(p.cpu_times()[:2]) - cpu0[name]) / wall * 100
        cpu_total += cpu
        locked = next(
            int(x.split()[1]) for x in Path(f"/proc/{p.pid}/status").read_text().splitlines() if x.startswith("VmLck:")
        )
        out[name] = (cpu, peak[name] / MiB, locked / 1024)
    out["whole agent"] = (cpu_total, total_peak / MiB, out["guard"][2] + out["telemetry"][2])
    proc.terminate()
    proc.wait(10)
    return out


def split_rss_lines(seconds: float, split: dict[str, tuple[float, float, float]]) -> list[str]:
    lines = [
        "",
        f"The daemon's two processes over {seconds:.0f} s with lots of headroom (mlock on, as the unit runs it):",
        "",
        "| process | CPU % of one core | max RSS MiB | VmLck MiB |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {name} | {cpu:.2f} | {rss:.1f} | {lck:.1f} |" for name, (cpu, rss, lck) in split.items()]
    return lines


def earlyoom_version() -> str:
    out = subprocess.run(["earlyoom", "-v"], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip().splitlines()[0]


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r / MiB:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=5)
    ap.add_argument("--rates", default="1,2,4", help="target fill rates in GiB/s")
    ap.add_argument("--idle-s", type=float, default=60)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--split-rss-s", type=float, default=0, help="only measure the guard/telemetry RSS this long")
    ap.add_argument("--scenario", choices=("spike", "two-engine"), default="spike")
    args = ap.parse_args()
    if args.split_rss_s:
        with tempfile.TemporaryDirectory() as tmpdir:
            print("\n".join(split_rss_lines(args.split_rss_s, split_rss(args.split_rss_s, Path(tmpdir)))))
        return
    if os.geteuid() != 0 or shutil.which("earlyoom") is None:
        sys.exit("needs root (earlyoom signals system-wide) and earlyoom (apt install earlyoom)")
    if MeminfoReader().read().available_bytes < 8 * GiB:
        sys.exit("needs 8 GiB MemAvailable")
    rates = [int(r) for r in args.rates.split(",")]
    if args.scenario == "two-engine":
        two: list[TwoEngineEpisode] = []
        with tempfile.TemporaryDirectory() as tmpdir:
            for rate in rates:
                for i in range(args.episodes):
                    for contender in ("sparkwatch", "earlyoom") if i % 2 == 0 else ("earlyoom", "sparkwatch"):
                        two.append(run_two_engine_episode(contender, rate, Path(tmpdir)))
                        print(two[-1], flush=True)
                        time.sleep(1)
        text = two_engine_report(two, sys.argv[1:])
        publish(text, args.out)
        return
    episodes: list[Episode] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for rate in rates:
            for i in range(args.episodes):
                for contender in ("sparkwatch", "earlyoom") if i % 2 == 0 else ("earlyoom", "sparkwatch"):
                    ep = run_episode(contender, rate, tmp)
                    episodes.append(ep)
                    print(ep, flush=True)
                    time.sleep(1)
        split = split_rss(args.idle_s, tmp) if args.idle_s else {}
        idle: dict[str, tuple[float, float]] = {}
        if split:  # sparkwatch: the whole agent (guard and telemetry); earlyoom is one process
            cpu, rss, _locked = split["whole agent"]
            idle = {"sparkwatch": (cpu, rss), "earlyoom": idle_cost("earlyoom", args.idle_s, tmp)}

    lines = [
        "# Guard benchmark: sparkwatch vs earlyoom",
        "",
        f"Command: `{' '.join(['.venv/bin/python', 'bench/guard_bench.py', *sys.argv[1:]])}`",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / GiB:.1f} GiB, kernel {platform.release()}, "
        f"{earlyoom_version()}. "
        f"Floor = MemAvailable − {HEADROOM // MiB} MiB; the hog would go {HOG_EXTRA // MiB} MiB under it. "
        "Episodes alternate A B A B.",
        "",
        "rate = fill rate over the 100 ms before the floor crossing, or before the kill when that came first "
        "(MiB/s); overshoot = how far MemAvailable went under "
        "the floor (MiB); reaction = overshoot ÷ rate (ms); floor→reaped = crossing to the last victim gone (ms; "
        "sparkwatch: the whole tree, earlyoom: the hog). 'before floor' = killed before MemAvailable reached it "
        "(margin left, MiB). detect→reaped = sparkwatch's own record of the kill (detect → SIGKILL → last member "
        "gone).",
        "",
        "| target GiB/s | contender | rate MiB/s | overshoot MiB | reaction ms | floor→reaped ms | detect→reaped ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ep in episodes:
        if not ep.crossed:
            reaped = f"before floor ({ep.margin_at_kill / MiB:,.0f} MiB left)"
        else:
            reaped = "-" if ep.floor_to_reaped_s is None else f"{ep.floor_to_reaped_s * 1000:,.0f}"
        reaction = "-" if not ep.rate_at_crossing else f"{ep.overshoot / ep.rate_at_crossing * 1000:,.0f}"
        own = "-" if ep.own_detect_to_reaped_ms is None else f"{ep.own_detect_to_reaped_ms:,.0f}"
        lines.append(
            f"| {ep.target_rate} | {ep.contender} | {fmt_rate(ep.rate_at_crossing)} | "
            f"{ep.overshoot / MiB:,.0f} | {reaction} | {reaped} | {own} |"
        )
    lines += [
        "",
        "Medians:",
        "",
        "| target GiB/s | contender | rate MiB/s | overshoot MiB | reaction ms | floor→reaped ms (crossed) | "
        "detect→reaped ms | fired before floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary: dict[tuple[int, str], tuple[float, float]] = {}

    def med(values: list[float], fmt: str = "{:,.0f}") -> str:
        return fmt.format(statistics.median(values)) if values else "-"

    for rate in rates:
        for c in ("sparkwatch", "earlyoom"):
            eps = [e for e in episodes if e.target_rate == rate and e.contender == c]
            over = statistics.median(e.overshoot for e in eps) / MiB
            react = statistics.median(
                e.overshoot / e.rate_at_crossing * 1000 if e.rate_at_crossing else 0.0 for e in eps
            )
            summary[(rate, c)] = (over, react)
            lines.append(
                f"| {rate} | {c} | {med([e.rate_at_crossing / MiB for e in eps if e.rate_at_crossing])} | "
                f"{over:,.0f} | {react:,.0f} | "
                f"{med([e.floor_to_reaped_s * 1000 for e in eps if e.floor_to_reaped_s is not None])} | "
                f"{med([e.own_detect_to_reaped_ms for e in eps if e.own_detect_to_reaped_ms is not None])} | "
                f"{sum(not e.crossed for e in eps)}/{len(eps)} |"
            )
    lines += ["", "Ratios (earlyoom ÷ sparkwatch, median; higher is better for sparkwatch):", ""]
    for rate in rates:
        so, sr = summary[(rate, "sparkwatch")]
        eo, er = summary[(rate, "earlyoom")]
        lines.append(f"- {rate} GiB/s: overshoot {eo:,.0f} vs {so:,.0f} MiB; reaction {er:,.0f} vs {sr:,.0f} ms")
    if idle:
        lines += [
            "",
            f"Idle cost over {args.idle_s:.0f} s with lots of headroom (sparkwatch: the whole agent, both processes):",
            "",
            "| contender | CPU % of one core | max RSS MiB |",
            "| --- | --- | --- |",
        ]
        for c, (cpu, rss) in idle.items():
            lines.append(f"| {c} | {cpu:.2f} | {rss:.1f} |")
        lines += split_rss_lines(args.idle_s, split)
    text = "\n".join(lines) + "\n"
    publish(text, args.out)


if __name__ == "__main__":
    main()
