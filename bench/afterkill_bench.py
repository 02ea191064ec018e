"""Restart to pause under the after-kill gate (issue 38, item 2): how long after dockerd restarts a container whose
engine the guard killed is it paused, and is the engine stopped before its spike.

    .venv/bin/python bench/afterkill_bench.py --runs 20 --out bench/RESULTS-afterkill.md

Root, with docker.io installed (tests/dockerd.py: a dockerd of this run's own, the test image cached or built by
mmdebstrap). A real `sparkwatch run` (tests/daemon.py, confined to this process's descendants: the dockerd is their
subreaper) with `engine_budgets = ["64MiB=VLLM::EngineCore"]` and the default `container_after_kill = "gate"`.

Each run starts a new container (a new id: no kill loop across runs) with `--restart unless-stopped` whose PID 1 is
tests/helpers/fake_engine.py, which spikes to 448 MiB at --rate-mib MiB/s (the guard kills it past 64 MiB + 256 MiB of
margin); the guard kills it once, dockerd restarts it, and telemetry pauses it. Measured:
- start -> pause: dockerd's own `start` and `pause` events of the restarted container (their timeNano, one clock:
  dockerd's), read by this process from the events stream;
- die -> start: dockerd's restart delay, for scale (moby's restartmanager: 100 ms after a run of 10 s or more, doubling
  from there for shorter runs);
- the restarted container's memory when paused (the RSS of its processes, frozen): what the engine had taken of its
  spike; and whether its hog (the spike's process) had started;
- start -> the `kill` event recorded: when the kill event alone (after the reap and kill_settle_s) would have told
  telemetry, for the path through the guard's state at the signal (guard/killpath.py wakes the supervisor).
Then the container is removed and the next run starts once the gate's release is no longer waited for.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tables import publish  # noqa: E402

from sparkwatch.common.eventlog import read_events  # noqa: E402
from sparkwatch.core.timestamps import parse_rfc3339  # noqa: E402
from sparkwatch.telemetry.sources.dockerapi import DockerEvent, DockerEvents  # noqa: E402
from tests.daemon import sparkwatch_run  # noqa: E402
from tests.dockerd import Dockerd, fake_engine_argv, run_args, start, stop  # noqa: E402

BUDGET = "64MiB"


class Events:
    """dockerd's container events, collected on a thread."""

    def __init__(self, socket: Path) -> None:
        self.stream = DockerEvents(str(socket))
        self.seen: list[DockerEvent] = []
        self.lock = threading.Lock()
        self.stream.open()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for event in self.stream:
            with self.lock:
                self.seen.append(event)

    def of(self, cid: str) -> list[DockerEvent]:
        with self.lock:
            return [e for e in self.seen if e.id == cid]

    def close(self) -> None:
        self.stream.close()
        self.thread.join(5)


def frozen_rss(dockerd: Dockerd, name: str) -> tuple[int, bool]:
    """The RSS of a paused container's processes (bytes), and whether the hog had started."""
    out = dockerd.docker("top", name, "-eo", "pid,args", check=False, timeout_s=10).stdout.splitlines()[1:]
    total, hog = 0, False
    for line in out:
        pid, _, args = line.strip().partition(" ")
        hog = hog or "sw-hog" in args
        try:
            for field in Path(f"/proc/{pid}/status").read_text().splitlines():
                if field.startswith("VmRSS:"):
                    total += int(field.split()[1]) * 1024
        except OSError:
            pass
    return total, hog


def episode(dockerd: Dockerd, events: Events, events_path: Path, i: int, rate_mib: int) -> dict[str, Any]:
    name = f"sw-akb-{os.getpid()}-{i}"
    flags = ["--restart", "unless-stopped", "--network", "none"]
    spike = ("--hog-rate-mib", str(rate_mib), "--hog-limit-mib", "448")
    cid = dockerd.docker(*run_args(dockerd, name, *flags), *fake_engine_argv(*spike)).stdout.strip()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            mine = events.of(cid)
            if any(e.action == "pause" for e in mine):
                break
            time.sleep(0.02)
        else:
            raise RuntimeError(f"{name} was not paused within 60 s: {[e.action for e in events.of(cid)]}")
        rss, hog = frozen_rss(dockerd, name)
        mine = events.of(cid)
        starts = [e.time_ns for e in mine if e.action == "start"]
        die = next(e.time_ns for e in mine if e.action == "die")
        pause = next(e.time_ns for e in mine if e.action == "pause")
        restart = next(t for t in starts if t > die)
        deadline = time.monotonic() + 30  # the kill event comes after the reap and kill_settle_s
        while True:
            recorded = [e for e in read_events(events_path) if e.get("container_id") == cid or _names(e, cid)]
            kinds = {e["kind"] for e in recorded}
            if {"kill", "container_gated"} <= kinds or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        kill = next(e for e in recorded if e["kind"] == "kill")
        gated = next(e for e in recorded if e["kind"] == "container_gated")
        kill_ts = parse_rfc3339(str(kill["ts"])) or 0.0
        return {
            "start_to_pause_ms": (pause - restart) / 1e6,
            "die_to_start_ms": (restart - die) / 1e6,
            "recorded_ms": gated["restart_to_pause_ms"],
            "kill_event_after_start_ms": kill_ts * 1000 - restart / 1e6,
            "rss": rss,
            "hog": hog,
        }
    finally:
        dockerd.remove(name)


def _names(event: dict[str, Any], cid: str) -> bool:
    containers = event.get("containers")
    return isinstance(containers, list) and any(isinstance(c, dict) and c.get("id") == cid for c in containers)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--rate-mib", type=int, default=128, help="the spike's rate (MiB/s): slower, the guard polls slower"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sw-akb-") as tmp:
        tmp_path = Path(tmp)
        dockerd = start(tmp_path / "dockerd.log")
        try:
            env = {
                "DOCKER_HOST": dockerd.host,
                "SPARKWATCH_FLOOR": "1GiB",
                "SPARKWATCH_ENGINE_BUDGETS": f'["{BUDGET}=VLLM::EngineCore"]',
                "SPARKWATCH_PROBE_INTERVAL_S": "0",
            }
            events = Events(dockerd.socket)
            try:
                with sparkwatch_run(tmp_path, env=env) as daemon:
                    runs = [episode(dockerd, events, daemon.events_path, i, args.rate_mib) for i in range(args.runs)]
            finally:
                events.close()
        finally:
            stop(dockerd)
    pause = [r["start_to_pause_ms"] for r in runs]
    recorded = [float(r["recorded_ms"]) for r in runs]
    restart = [r["die_to_start_ms"] for r in runs]
    late = [r["kill_event_after_start_ms"] for r in runs]
    rss = [r["rss"] / (1 << 20) for r in runs]
    host = f"{platform.node()} ({os.cpu_count()} cores, {platform.release()})"
    lines = [
        "# After-kill gate: restart to pause",
        "",
        f"`bench/afterkill_bench.py --runs {args.runs} --rate-mib {args.rate_mib} --out bench/RESULTS-afterkill.md` on "
        f"{host}; dockerd 20.10 of its own (tests/dockerd.py), a real `sparkwatch run`, one container per run "
        f"(`--restart unless-stopped`, the fake engine as PID 1 spiking to 448 MiB at {args.rate_mib} MiB/s, budget "
        f"{BUDGET}): the guard kills it, dockerd restarts it, telemetry pauses it. Target: 500 ms from dockerd's "
        "restart to the pause.",
        "",
        "| what | runs | median | p90 | worst |",
        "| --- | --- | --- | --- | --- |",
        _row("dockerd's `start` -> its `pause` (dockerd's clock)", pause, "ms"),
        _row("`start` -> pause returned, as `container_gated` records it", recorded, "ms"),
        _row("dockerd's `die` -> its `start` (its restart delay)", restart, "ms"),
        _row("`start` -> the `kill` event recorded (the event alone would be this late)", late, "ms"),
        _row("RSS of the paused container", rss, "MiB"),
        "",
        f"The engine's spike (its hog process) had started in {sum(r['hog'] for r in runs)} of {len(runs)} paused "
        "containers.",
        "",
        "Every run, start -> pause: " + ", ".join(f"{v:.0f}" for v in pause) + " ms.",
    ]
    publish(lines, args.out)
    return 0


def _row(what: str, values: list[float], unit: str) -> str:
    fmt = "{:.0f} " + unit if unit == "ms" else "{:.1f} " + unit
    return (
        f"| {what} | {len(values)} | {fmt.format(statistics.median(values))} | {fmt.format(pct(values, 0.9))} | "
        f"{fmt.format(max(values))} |"
    )


if __name__ == "__main__":
    sys.exit(main())
