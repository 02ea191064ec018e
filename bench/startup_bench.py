"""Command start-up: each command as a whole process (interpreter start, imports, the work, exit), baseline against
this tree, alternated on the same machine.

    .venv/bin/python bench/startup_bench.py --baseline 51ae5be --rounds 30 --out bench/RESULTS-startup.md

A is the baseline commit, written out with `git archive` into a temporary directory; B is this checkout. Each runs
as the installed `sparkwatch` script does (`python -P -c "…from sparkwatch.entry import main…" ARGS`) from an
empty working directory with PYTHONPATH naming its tree only, so that neither the checkout nor the venv's editable
install can stand in for the other; before timing, each tree is asked where its `sparkwatch` package lives, and the
bench stops if the answer is not that tree. Rounds alternate A B, then B A, so a slow minute on a shared box falls on
both.

The commands: the interpreter alone (`python -P -c pass`, the floor under all of them), `--version`, `events`
(a state dir with 200 events), `engines --window 0`, `status --once`, `launch --plan -- vllm serve <a 4-shard sparse
checkpoint>`, each with no config file, no SPARKWATCH_* variable and no flag (the defaults: nothing to validate), and
`events --config FILE`, which validates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tables import archive_tree, git_short, publish

ROOT = Path(__file__).resolve().parent.parent


def make_fixture(tmp: Path) -> dict[str, str]:
    """An empty config home, a state dir with events, a sparse checkpoint, a config file; the environment."""
    state = tmp / "state" / "sparkwatch"
    state.mkdir(parents=True)
    lines = []
    for i in range(200):
        lines.append(
            json.dumps({
                "id": f"{i:016x}", "ts": f"2026-12-03T10:{i // 60:02d}:{i % 60:02d}Z", "kind": "kill", "node": "bench",
                "summary": f"killed vllm tree root={1000 + i} (9 processes): MemAvailable 4.6 GiB <= floor 8.0 GiB",
                "fields": {"root_pid": 1000 + i, "engine": "vllm", "trigger": "floor"},
            })
        )  # fmt: skip
    (state / "events.jsonl").write_text("\n".join(lines) + "\n")
    model = tmp / "model"
    model.mkdir()
    for i in range(4):
        with open(model / f"model-{i + 1:05d}-of-00004.safetensors", "wb") as fh:
            fh.truncate(4 << 30)  # sparse: 16 GiB that use no disk
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {f"w{i}": f"model-{i + 1:05d}-of-00004.safetensors" for i in range(4)}})
    )
    (model / "config.json").write_text(
        json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "hidden_size": 4096, "torch_dtype": "bfloat16", "max_position_embeddings": 32768})
    )  # fmt: skip
    (tmp / "config").mkdir()
    (tmp / "config.toml").write_text('floor = "8GiB"\n')
    (tmp / "run").mkdir()
    # Bytecode caches on for both trees (the untimed first run writes them): with PYTHONDONTWRITEBYTECODE set, as on
    # this VM, the archived baseline compiled every module on every run and the checkout every module edited since.
    drop = {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE"}
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("SPARKWATCH_") and k not in drop}
    env.update(
        XDG_CONFIG_HOME=str(tmp / "config"),
        XDG_STATE_HOME=str(tmp / "state"),
        XDG_RUNTIME_DIR=str(tmp / "run"),
        TERM="dumb",
    )
    return env


def commands(tmp: Path) -> list[tuple[str, list[str], str]]:
    """(label, argv, target): the start-up targets on a 2-core machine (issue 28's; issue 39 lowered the three
    read-only commands' to 150 ms)."""
    model = str(tmp / "model")
    return [
        ("python -P -c pass (the interpreter alone)", BARE, "-"),
        ("sparkwatch --version", ["--version"], "≤ 60 ms"),
        ("sparkwatch events", ["events"], "≤ 250 ms"),
        ("sparkwatch engines --window 0", ["engines", "--window", "0"], "≤ 150 ms"),
        ("sparkwatch status --once", ["status", "--once"], "≤ 150 ms"),
        (
            "sparkwatch launch --plan -- vllm serve MODEL",
            ["launch", "--plan", "--", "vllm", "serve", model],
            "≤ 150 ms",
        ),
        ("sparkwatch events --config FILE (validates)", ["events", "--config", str(tmp / "config.toml")], "-"),
    ]


# What the installed `sparkwatch` script runs (pip's console-script wrapper), with the tree's own entry point.
ENTRY = "import re, sys; from sparkwatch.entry import main; sys.exit(main())"
# The interpreter alone, for reference: the floor under every command (the same in A and B).
BARE = ["-c", "pass"]


def run_once(tree: Path, argv: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float, int]:
    """(wall ms, CPU ms: user + system of the process and the children it waited for, exit code)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    rc = subprocess.run(
        [sys.executable, "-P", *(argv if argv == BARE else ["-c", ENTRY, *argv])],
        env={**env, "PYTHONPATH": str(tree)},
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    ).returncode
    wall_ms = (time.perf_counter() - t0) * 1000
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_ms = (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) * 1000
    return wall_ms, cpu_ms, rc


def where(tree: Path, env: dict[str, str], cwd: Path) -> str:
    """The package the tree's interpreter really imports."""
    probe = "import sparkwatch; print(sparkwatch.__file__)"
    return subprocess.run(
        [sys.executable, "-P", "-c", probe],
        env={**env, "PYTHONPATH": str(tree)},
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="main", help="commit A (default: main)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", metavar="TEXT", help="only the commands whose label contains TEXT (a quick look)")
    args = ap.parse_args()
    base, head, dirty = git_short(ROOT, args.baseline)
    with tempfile.TemporaryDirectory(prefix="sw-startup-") as td:
        tmp = Path(td)
        tree_a = archive_tree(ROOT, base, tmp / "a")
        env = make_fixture(tmp)
        cwd = tmp / "cwd"
        cwd.mkdir()
        trees = {"A": tree_a, "B": ROOT}
        for name, tree in trees.items():
            path = where(tree, env, cwd)
            if not path.startswith(str(tree) + "/"):
                sys.exit(f"{name}: imports sparkwatch from {path}, not from {tree}")
            print(f"{name}: {path}", file=sys.stderr)
        rows = []
        for label, argv, target in commands(tmp):
            if args.only and args.only not in label:
                continue
            times: dict[str, list[float]] = {"A": [], "B": []}
            cpus: dict[str, list[float]] = {"A": [], "B": []}
            rcs: dict[str, set[int]] = {"A": set(), "B": set()}
            for tree in trees.values():  # warm the bytecode caches; not timed
                run_once(tree, argv, env, cwd)
            for r in range(args.rounds):
                for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                    ms, cpu_ms, rc = run_once(trees[name], argv, env, cwd)
                    times[name].append(ms)
                    cpus[name].append(cpu_ms)
                    rcs[name].add(rc)
            if rcs["A"] != rcs["B"]:
                sys.exit(f"{label}: exit codes differ, A {sorted(rcs['A'])} B {sorted(rcs['B'])}")
            a, b = statistics.median(times["A"]), statistics.median(times["B"])
            cpu_a, cpu_b = statistics.median(cpus["A"]), statistics.median(cpus["B"])
            rows.append((label, a, b, cpu_a, cpu_b, target, sorted(rcs["B"])))
            print(f"{label}: A {a:.0f} ms, B {b:.0f} ms", file=sys.stderr)
    load = os.getloadavg()
    out = [
        "# Command start-up, whole process",
        "",
        f"`{' '.join(['.venv/bin/python', 'bench/startup_bench.py', *sys.argv[1:]])}`",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}: {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (a box shared with "
        "other work: medians, rounds alternated A B / B A).",
        f"A: {base} (`git archive`), B: {head}{' with uncommitted changes' if dirty else ''}. Each run is "
        "the `sparkwatch` script's lines (`python -P -c '…from sparkwatch.entry import main…' ARGS`) from an "
        "empty directory with PYTHONPATH naming its tree; no config file, no "
        f"SPARKWATCH_* variable. {args.rounds} rounds each; exit codes equal in A and B. Wall time is what the "
        "target is about; CPU time (user + system, the process and the children it waited for) moves less with "
        "the box's load.",
        "",
        "| command | A median (ms) | B median (ms) | B / A | A CPU (ms) | B CPU (ms) | B / A CPU | target | exit |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for label, a, b, cpu_a, cpu_b, target, exits in rows:
        out.append(
            f"| `{label}` | {a:.0f} | {b:.0f} | {b / a:.2f} | {cpu_a:.0f} | {cpu_b:.0f} | {cpu_b / cpu_a:.2f} | "
            f"{target} | {','.join(map(str, exits))} |"
        )
    publish(out, args.out)


if __name__ == "__main__":
    main()
