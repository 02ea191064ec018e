"""Regex benchmark: the worst an accepted owner pattern costs the guard on a long command line.

For each pattern, a real process with a 128 KiB command line shaped against that pattern (`python3 -c <sleep>` and
four long arguments: the text that makes a backtracking engine try the most), read by the guard's own scanner
(ProcScanner: /proc/PID/cmdline, at most 8 KiB), ranked by the guard's own policy (core.kill.policy.rank, the pattern as
`never_kill`, or as `engine_patterns` for the anchored ones through core.engines.identity.classify). Episodes alternate
A B:
- A: as shipped (core.userregex.bounded cuts every string to MATCH_TEXT_MAX = 4096 characters);
- B: without the cut (the scanner's whole 8 KiB).
The refused patterns are timed too, on short texts only (they grow exponentially or as n^2-n^3), to show what
refusing them avoids. CPU time (process_time) of one rank or classify call; medians per variant.

    flock /tmp/sparkwatch-pressure.lock .venv/bin/python bench/regex_bench.py --episodes 5 --out bench/RESULTS-regex.md
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.sources.procs import ProcScanner  # noqa: E402
from sparkwatch.core import userregex  # noqa: E402
from sparkwatch.core.engines import identity  # noqa: E402
from sparkwatch.core.kill import policy  # noqa: E402
from sparkwatch.core.model import EngineTree, Proc  # noqa: E402

ARGV_BYTES = 128 << 10
SLEEPER = "import time; time.sleep(600)"

# (pattern, key, filler): the heaviest accepted shape of each rule, and the text that is worst for it.
ACCEPTED: tuple[tuple[str, str, str], ...] = (
    (r".*x", "never_kill", "a"),  # one unbounded repeat, sre's fast path
    (r"\S*x", "never_kill", "a"),  # one unbounded repeat of a class
    (r"(?:a\S)*x", "never_kill", "ab"),  # one unbounded repeat of a group: sre's general path, the slowest
    (r"(?=\S*x)", "never_kill", "a"),  # a lookahead holding the repeat
    ("(?:aa|a)" * 6 + "x", "never_kill", "a"),  # 64 combinations of alternatives, no repeat
    ("a?" * 6 + "x", "never_kill", "a"),  # 64 combinations of optional parts
    (r"--served-model-name prod", "never_kill", "--served-model-name prox "),  # what owners write
    (r"(?:ab|a)(?:ab|a)\S*(?:x|y)", "engine_patterns", "ab"),  # anchored: a repeat with choices
)
REFUSED: tuple[tuple[str, str, int], ...] = (
    ("(a+)+$", "a", 20),
    ("(a+)+$", "a", 22),
    ("(a+)+$", "a", 24),
    (r"a.*b.*c", "ab", 1024),
    (r"a.*b.*c", "ab", 2048),
    (r".*a?x", "a", 4096),
)


def cpu_of(fn: Callable[[], object]) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


ARG_BYTES = 32 << 10  # one argument may hold at most 128 KiB (MAX_ARG_STRLEN): four of 32 KiB


def spawn(filler: str) -> subprocess.Popen[bytes]:
    arg = (filler * (ARG_BYTES // len(filler) + 1))[:ARG_BYTES]
    return subprocess.Popen(
        [sys.executable, "-c", SLEEPER, *[arg] * (ARGV_BYTES // ARG_BYTES)], stdin=subprocess.DEVNULL
    )


def scanned(pid: int) -> Proc:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc = ProcScanner().read_proc(pid)
        if proc is not None and len(proc.argv) >= 4:
            return proc
        time.sleep(0.05)
    raise RuntimeError(f"pid {pid} not readable")


def time_one(pattern: str, key: str, proc: Proc) -> float:
    """CPU seconds of the guard's own call that runs this pattern over this process."""
    if key == "never_kill":
        params = policy.PolicyParams.build(never_kill=[pattern])
        tree = EngineTree(kind="vllm", root=proc, members=(proc,))
        history = policy.GrowthHistory()
        return cpu_of(lambda: policy.rank([tree], history, 0.0, None, params))
    rules = identity.EngineRules.build([f"bench={pattern}"])
    # argv[0] is the long argument here: the identity strings an engine pattern is matched against start with it.
    probe = Proc(
        pid=proc.pid, ppid=proc.ppid, uid=proc.uid, comm=proc.comm, state="S", start_ticks=0, rss_bytes=0,
        argv=proc.argv[3:],
    )  # fmt: skip
    return cpu_of(lambda: identity.classify(probe, rules))


def _no_cut(text: str) -> str:
    return text


def episode(uncut: bool, procs: dict[str, Proc]) -> dict[str, float]:
    # B: the modules that cut (policy_strings, identity_strings) see the text whole.
    cut = _no_cut if uncut else userregex.bounded
    setattr(policy, "bounded", cut)  # noqa: B010 - a module attribute mypy does not see as exported
    setattr(identity, "bounded", cut)  # noqa: B010
    try:
        return {pattern: time_one(pattern, key, procs[filler]) for pattern, key, filler in ACCEPTED}
    finally:
        setattr(policy, "bounded", userregex.bounded)  # noqa: B010
        setattr(identity, "bounded", userregex.bounded)  # noqa: B010


def refused_ms(pattern: str, filler: str, n: int) -> float:
    text = (filler * n)[:n] + ("!" if pattern.endswith("$") else "")
    compiled = re.compile(pattern)
    return cpu_of(lambda: compiled.search(text)) * 1000


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=5, help="per variant; alternated A B A B")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    for pattern, key, _filler in ACCEPTED:  # every pattern here is one the config accepts
        userregex.compile_user_regex(pattern, searched=key == "never_kill")
    fillers = sorted({f for _p, _k, f in ACCEPTED})
    children = {f: spawn(f) for f in fillers}
    try:
        procs = {f: scanned(p.pid) for f, p in children.items()}
        seen_bytes = max(len(" ".join(p.argv)) for p in procs.values())
        results: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
        for _ in range(args.episodes):
            results["A"].append(episode(False, procs))
            results["B"].append(episode(True, procs))
    finally:
        for p in children.values():
            p.kill()
        for p in children.values():
            p.wait()

    def med(variant: str, pattern: str) -> float:
        return statistics.median(r[pattern] for r in results[variant]) * 1000

    lines = [
        "# Regex benchmark: owner patterns on a long command line",
        "",
        f"Command: `flock /tmp/sparkwatch-pressure.lock .venv/bin/python bench/regex_bench.py --episodes "
        f"{args.episodes}`",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, shared with other "
        f"jobs. Each process has a {ARGV_BYTES >> 10} KiB command line; the scanner reads {seen_bytes} characters of "
        f"it. Medians over {args.episodes} episodes per variant, A B A B; CPU time of one call.",
        "",
        f"A: as shipped (every string cut to {userregex.MATCH_TEXT_MAX} characters); B: the scanner's whole text.",
        "",
        "| accepted pattern | as | text | A (ms) | B (ms) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for pattern, key, filler in ACCEPTED:
        shown = pattern.replace("|", "\\|")
        lines.append(f"| `{shown}` | {key} | `{filler.strip()}`… | {med('A', pattern):.2f} | {med('B', pattern):.2f} |")
    lines += [
        "",
        "Refused now (check-config names the key and the entry); what one search cost, on short texts:",
        "",
        "| refused pattern | text | ms |",
        "| --- | --- | --- |",
    ]
    for pattern, filler, n in REFUSED:
        lines.append(f"| `{pattern}` | {n} characters of `{filler}…` | {refused_ms(pattern, filler, n):.1f} |")
    worst = max(ACCEPTED, key=lambda a: med("A", a[0]))[0]
    lines += [
        "",
        f"Reading: the worst accepted pattern here, `{worst}`, costs {med('A', worst):.0f} ms a call on its worst "
        f"text (the guard ranks on its kill path, holding the GIL, once per tree and pattern); without the cut it "
        f"would be {med('B', worst):.0f} ms. `(a+)+$` doubles with every character: on a {userregex.MATCH_TEXT_MAX}-"
        "character command line it would not end.",
    ]
    text = "\n".join(lines) + "\n"
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
