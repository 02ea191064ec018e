"""`sparkwatch engines` and `sparkwatch events` human output, run as real commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sparkwatch.common.eventlog import EventLog, make_event
from sparkwatch.core.engines.identity import EngineRules
from sparkwatch.core.engines.proctree import tree_rows
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.tui.events_view import event_lines, local_time
from tests.conftest import require_tool
from tests.helpers.engine_tree import staged_engine


def scoped_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env["SPARKWATCH_ANCESTOR_PID"] = str(os.getpid())
    env.update(extra)
    return env


def sparkwatch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env or scoped_env(),
        timeout=60,
    )


def _wait_for_comm(root: int, comm: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for task in Path(f"/proc/{root}/task").iterdir():
            for child in (task / "children").read_text().split():
                if Path(f"/proc/{child}/comm").read_text().strip() == comm:
                    return
        time.sleep(0.05)
    raise AssertionError(f"no {comm} child under {root}")


def test_engines_draws_root_workers_and_compilers(tmp_path: Path) -> None:
    require_tool("ninja")
    # A real ninja whose one job sleeps: the engine -> ninja -> job shape of a JIT build, without the GiBs.
    (tmp_path / "build.ninja").write_text("rule slow\n  command = sleep 60\nbuild out.o: slow\n")
    with staged_engine(
        children=("VLLM::Worker_TP0", "VLLM::Worker_TP1"),
        extra=["--hold-mib", "8", "--spawn-cwd", str(tmp_path)],
        command=["ninja", "-j1"],
    ) as engine:
        _wait_for_comm(engine.root_pid, "ninja")
        out = sparkwatch("engines")
        js = sparkwatch("engines", "--json")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    root, tp0, tp1 = engine.pids
    # root, 2 workers, ninja, the shell ninja runs its job in, and the job.
    assert lines[0].startswith(f"vllm  root {root}  6 processes  ")
    assert lines[0].endswith(" RSS")
    assert lines[1].split() == ["PID", "RSS", "ROLE", "NAME"]
    lines = lines[: lines.index("")]  # the tree; the kill order follows after a blank line
    body = [line.split() for line in lines[2:]]
    assert body[0][0] == str(root) and body[0][3:] == ["root", "VLLM::EngineCore"]
    assert body[1][:2] == ["├─", str(tp0)] and body[1][4:] == ["worker", "VLLM::Worker_TP0"]
    assert body[2][:2] == ["├─", str(tp1)] and body[2][4:] == ["worker", "VLLM::Worker_TP1"]
    assert body[3][0] == "└─" and body[3][4:] == ["compiler", "ninja"]
    assert body[4][0] == "└─" and body[4][4:] == ["process", "sh"]
    assert body[5][0] == "└─" and body[5][4:] == ["process", "sleep"]
    assert lines[6].startswith("   └─ ") and lines[7].startswith("      └─ ")  # nested under ninja
    # Sizes for people (MiB/GiB, never raw bytes), right-aligned: every RSS ends in the same column.
    assert all(row[-3] in ("B", "KiB", "MiB", "GiB") for row in body)
    assert len({line.index("iB ") for line in lines[2:]}) == 1
    assert "\x1b[" not in out.stdout  # plain text on a pipe
    # --json keeps its keys and lists the same members.
    data = json.loads(js.stdout)
    (tree,) = data["engines"]
    assert set(tree) == {"root_pid", "engine", "rss_bytes", "container", "members", "budget", "serving"}
    assert tree["budget"] is None  # no declaration and no engine_budgets entry names it
    assert tree["root_pid"] == root and tree["engine"] == "vllm"
    assert set(tree["members"][0]) == {"pid", "ppid", "name", "rss_bytes", "cmdline"}
    assert len(tree["members"]) == 6


def test_engines_with_none(tmp_path: Path) -> None:
    """A proc root of the test's own, holding no process: on a working Spark the live /proc has engines and raylets
    of other users (one owner's run found another user's raylet, and a note that Ray did not answer)."""
    proc_root = tmp_path / "proc"
    proc_root.mkdir()
    out = sparkwatch("engines", "--proc-root", str(proc_root))
    assert out.returncode == 0 and out.stdout == "no engine processes\n"


def _proc(pid: int, ppid: int, comm: str, argv: tuple[str, ...] = ()) -> Proc:
    return Proc(pid, ppid, 0, comm, "S", pid, 1 << 20, argv or (comm,))


def test_tree_rows_layout_and_roles() -> None:
    root = _proc(10, 1, "VLLM::EngineCor", ("VLLM::EngineCore",))
    members = (
        root,
        _proc(11, 10, "VLLM::Worker_TP", ("VLLM::Worker_TP0",)),
        _proc(12, 10, "python3", ("python3", "-c", "resource tracker")),
        _proc(20, 11, "ninja", ("ninja", "-j4")),
        _proc(21, 20, "nvcc"),
        _proc(22, 21, "cicc"),
        _proc(23, 20, "aarch64-linux-g", ("aarch64-linux-gnu-g++-13",)),
    )
    rows = tree_rows(EngineTree("vllm", root, members), EngineRules.build())
    drawn = [(r.prefix + str(r.proc.pid), r.role) for r in rows]
    assert drawn == [
        ("10", "root"),
        ("├─ 11", "worker"),
        ("│  └─ 20", "compiler"),
        ("│     ├─ 21", "compiler"),
        ("│     │  └─ 22", "compiler"),
        ("│     └─ 23", "process"),  # comm cut to 15 chars is not a compiler name we can trust
        ("└─ 12", "process"),
    ]


def test_events_one_line_each_in_local_time(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    ts = 1_795_000_000.0  # 2026-11-18T11:06:40Z
    log.append(
        make_event(
            EventKind.KILL,
            "Killed vllm (root pid 4242, 9 processes): MemAvailable 4726 MiB <= floor 8192 MiB.",
            {"trigger": "floor"},
            ts=ts,
            node="spark-a",
        )
    )
    log.append(make_event(EventKind.COMPILE_BURST, "compiler burst:\n 20 parallel jobs", ts=ts + 61, node="spark-a"))
    # A zone without tzdata: POSIX TZ "IST-5:30" is UTC+05:30.
    out = sparkwatch("events", "--state-dir", str(tmp_path), env=scoped_env(TZ="IST-5:30"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "TIME                 KIND           SUMMARY",
        "2026-11-18 16:36:40  kill           Killed vllm (root pid 4242, 9 processes): "
        "MemAvailable 4726 MiB <= floor 8192 MiB.",
        "2026-11-18 16:37:41  compile_burst  compiler burst: 20 parallel jobs",
    ]
    js = sparkwatch("events", "--state-dir", str(tmp_path), "--json", "-n", "1")
    (line,) = js.stdout.splitlines()
    assert json.loads(line)["kind"] == "compile_burst"


def test_event_lines_survive_odd_records() -> None:
    lines = event_lines([{"kind": "x"}, {"ts": "not a time", "kind": "y", "summary": "s"}])
    assert lines[1].startswith("?")
    assert lines[2].startswith("not a time  y")
    assert local_time("2026-11-18T09:46:40") == "2026-11-18 09:46:40"


def test_every_subcommand_help_page_has_a_description() -> None:
    """`sparkwatch COMMAND --help` says what the command does, not only its flags."""
    import argparse

    from sparkwatch.cli import build_parser

    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) >= {"run", "engines", "events", "status", "assets"}
    for name, page in sub.choices.items():
        assert page.description and len(page.description) > 60, f"sparkwatch {name} --help has no description"


def _shape(value: object) -> object:
    """The keys of a JSON value at every level (lists by their first element): what a reader of it relies on."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return None


def test_the_engines_json_example_in_terminal_md_is_what_a_real_run_prints() -> None:
    import re

    doc = (Path(__file__).resolve().parent.parent / "docs" / "terminal.md").read_text(encoding="utf-8")
    section = doc.split("## `sparkwatch engines", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```json\n(.*?)```", section, re.DOTALL)
    example = json.loads(block)
    with staged_engine(children=("VLLM::Worker_TP0",)) as engine:
        res = sparkwatch("engines", "--json", "--all", env=scoped_env(SPARKWATCH_ANCESTOR_PID=str(engine.root_pid)))
    assert res.returncode == 0, res.stderr
    real = json.loads(res.stdout)
    assert _shape(real["engines"]) == _shape(example["engines"])
    assert _shape(real["kill_order"]) == _shape(example["kill_order"])
    assert set(real) == set(example)
