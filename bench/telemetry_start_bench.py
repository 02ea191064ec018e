"""Telemetry start-up after the guard: a whole `sparkwatch run`, baseline against this tree, alternated.

    .venv/bin/python bench/telemetry_start_bench.py --baseline main --rounds 15 --out bench/RESULTS-telemetry-start.md

A is the baseline commit, written out with `git archive` into a temporary directory; B is this checkout. Each round
starts `python -P -m sparkwatch run --dry-run` with PYTHONPATH naming one tree only, in a private state dir, runtime
dir and port (tests.daemon.daemon_env, the host's journal and pstore read as in production: the postmortem on), and
reads its stderr: the clock starts at the guard's `running:` line (the guard polls), and telemetry is up at the first
`GET /metrics` that answers 200 (tried every 5 ms from that line on); beside it, telemetry's own `telemetry running`
line and the first scrape with a telemetry cycle in it (`sparkwatch_collector_success`). The
daemon is stopped with SIGTERM and waited for before the next round. Rounds alternate A B, then B A, so a slow minute
on a shared box falls on both. Issue 28's target: telemetry up <= 1 s after the guard.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tables import archive_tree, git_short, publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.daemon import daemon_env, free_port  # noqa: E402

START_TIMEOUT_S = 30.0
POLL_S = 0.005


def scrape(port: int) -> str | None:
    """The /metrics body, or None when it does not answer 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read().decode(errors="replace")
        return body if response.status == 200 else None
    except OSError:
        return None
    finally:
        conn.close()


CYCLE_METRIC = "sparkwatch_collector_success{"  # in a scrape once telemetry's first cycle is done


def one_start(tree: Path, tmp: Path) -> tuple[float, float, float, float]:
    """Seconds: the guard's `running:` after the spawn; after that line, the first /metrics 200, telemetry's
    `telemetry running` line, the first scrape with a telemetry cycle in it."""
    port = free_port()
    env = daemon_env(tmp, port)
    env.pop("SPARKWATCH_POSTMORTEM")  # as in production
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode caches on for both trees (the untimed first start writes them)
    env["PYTHONPATH"] = str(tree)
    marks: dict[str, float] = {}
    seen = threading.Event()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "sparkwatch", "run", "--dry-run"],
        env=env,
        cwd=tmp,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            now = time.monotonic()
            if "sparkwatch: running:" in line:
                marks.setdefault("running", now)
                seen.set()
            elif "telemetry running" in line:
                marks.setdefault("line", now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not seen.wait(START_TIMEOUT_S):
            raise SystemExit(f"{tree}: no `running:` line within {START_TIMEOUT_S:.0f} s")
        deadline = time.monotonic() + START_TIMEOUT_S
        while (body := scrape(port)) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{tree}: /metrics did not answer within {START_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        up = time.monotonic()
        while CYCLE_METRIC not in body:
            if time.monotonic() > deadline:
                raise SystemExit(f"{tree}: no telemetry cycle in /metrics within {START_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
            body = scrape(port) or ""
        cycle = time.monotonic()
        while "line" not in marks and time.monotonic() < deadline:
            time.sleep(POLL_S)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        reader.join(5)
    running = marks["running"]
    return running - t0, up - running, marks.get("line", float("nan")) - running, cycle - running


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="main", help="commit A (default: main)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    base, head, dirty = git_short(ROOT, args.baseline)
    runs: dict[str, list[tuple[float, float, float, float]]] = {"A": [], "B": []}
    with tempfile.TemporaryDirectory(prefix="sw-telstart-") as td:
        tmp = Path(td)
        trees = {"A": archive_tree(ROOT, base, tmp / "a"), "B": ROOT}
        for r in range(-1, args.rounds):  # round -1 writes the bytecode caches; not counted
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                work = tmp / f"{name}{r + 1}"
                work.mkdir()
                got = one_start(trees[name], work)
                if r >= 0:
                    runs[name].append(got)
                print(f"round {r}: {name} running {got[0]:.3f} s, metrics +{got[1]:.3f} s", file=sys.stderr)
    load = os.getloadavg()

    def med(name: str, i: int) -> float:
        return statistics.median(run[i] for run in runs[name]) * 1000

    def span(name: str, i: int) -> str:
        values = [run[i] * 1000 for run in runs[name]]
        return f"{min(values):.0f}-{max(values):.0f}"

    lines = [
        "# Telemetry up after the guard, whole `sparkwatch run`",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/telemetry_start_bench.py', *sys.argv[1:]])}`",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}: {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (a box shared with "
        "other work: medians, rounds alternated A B / B A).",
        f"A: {base} (`git archive`), B: {head}{' with uncommitted changes' if dirty else ''}. Each start is "
        "`python -P -m sparkwatch run --dry-run` with PYTHONPATH naming its tree, a private state dir and port, the "
        f"postmortem on; times from the guard's `running:` line. {args.rounds} starts each.",
        "",
        "| figure | A median (ms) | A range | B median (ms) | B range | B / A | target |",
        "| --- | ---: | --- | ---: | --- | ---: | --- |",
    ]
    for i, label, target in (
        (1, "first `GET /metrics` 200 after the guard's `running:`", "≤ 1000 ms"),
        (2, "telemetry's `telemetry running` line after `running:`", "-"),
        (3, "first `/metrics` with a telemetry cycle in it after `running:`", "-"),
        (0, "the guard's `running:` after the spawn of `sparkwatch run`", "-"),
    ):
        a, b = med("A", i), med("B", i)
        lines.append(f"| {label} | {a:.0f} | {span('A', i)} | {b:.0f} | {span('B', i)} | {b / a:.2f} | {target} |")
    publish(lines, args.out)


if __name__ == "__main__":
    main()
