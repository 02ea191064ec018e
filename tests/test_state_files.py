"""State files and printed text: symlinks refused, FIFOs and directories in one line, events read from the end,
rotation, control characters cut from `engines` output on a pipe."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkwatch.common.durable import StateFileError
from sparkwatch.common.eventlog import EventLog, make_event, read_events
from sparkwatch.core.eventkinds import EventKind
from tests.conftest import Spawner, alive, floor_that_fires_at_once, wait_until
from tests.daemon import sparkwatch_run


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", *args], capture_output=True, text=True, env=full, timeout=timeout
    )


def one_line_exit_2(res: subprocess.CompletedProcess[str], needle: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr, res.stderr
    assert needle in res.stderr, res.stderr


@pytest.mark.slow
def test_planted_symlink_events_file_is_refused_and_the_guard_keeps_killing(spawner: Spawner, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    target = tmp_path / "victim-file"
    target.write_text("")
    (state / "events.jsonl").symlink_to(target)
    floor = floor_that_fires_at_once()
    engine = spawner.popen(
        [sys.executable, "-c", "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); "
         "time.sleep(120)"]
    )  # fmt: skip
    assert wait_until(lambda: Path(f"/proc/{engine.pid}/cmdline").read_bytes().startswith(b"VLLM::"), 10)
    env = {"SPARKWATCH_FLOOR": f"{floor}B", "SPARKWATCH_REARM_HEADROOM": "1MiB", "SPARKWATCH_MLOCK": "false"}
    with sparkwatch_run(tmp_path, env=env) as d:
        assert wait_until(lambda: engine.poll() is not None, 30)  # the guard killed it all the same
        assert wait_until(lambda: any("could not record kill event" in line for line in d.stderr_lines), 10)
        line = next(line for line in d.stderr_lines if "could not record kill event" in line)
        assert "events.jsonl" in line and "symlink" in line
        assert d.proc.poll() is None
    assert target.read_text() == ""  # nothing was written through the link
    assert (state / "events.jsonl").is_symlink()
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700  # the state dir was tightened


def test_fifo_directory_and_nested_events_files(tmp_path: Path) -> None:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "events.jsonl")
    one_line_exit_2(cli("events", "--state-dir", str(fifo_dir), env=env, timeout=30), "not a regular file")
    dir_dir = tmp_path / "dir"
    (dir_dir / "events.jsonl").mkdir(parents=True)
    one_line_exit_2(cli("events", "--state-dir", str(dir_dir), env=env), "events.jsonl")
    nested = tmp_path / "nested"
    nested.mkdir()
    good = json.dumps(make_event(EventKind.KILL, "the real one", node="n").to_json_dict())
    (nested / "events.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n" + good + "\n")
    res = cli("events", "--state-dir", str(nested), env=env)
    assert res.returncode == 0, res.stderr
    assert "the real one" in res.stdout
    assert len(read_events(nested / "events.jsonl")) == 1


def test_events_n_reads_from_the_end_and_n_0_prints_nothing(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    line = json.dumps(make_event(EventKind.LOW_HEADROOM, "x" * 150, node="n").to_json_dict())
    with path.open("w") as fh:
        for i in range(200_000):
            fh.write(line.replace('"x', f'"{i} x', 1) + "\n")
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert cli("events", "-n", "0", "--state-dir", str(tmp_path), env=env).stdout == ""
    started = time.monotonic()
    res = cli("events", "-n", "200000", "--json", "--state-dir", str(tmp_path), env=env, timeout=120)
    took = time.monotonic() - started
    assert res.returncode == 0
    lines = res.stdout.splitlines()
    assert len(lines) == 200_000 and json.loads(lines[-1])["summary"].startswith("199999 x")
    # Linear, not quadratic: the old tail took ~19 s for 80,000 lines (and grows with the square); this reads
    # 40 MiB once. A generous bound for a loaded shared box.
    assert took < 60, took
    last = read_events(path, 3)
    assert [e["summary"].split()[0] for e in last] == ["199997", "199998", "199999"]


def test_events_file_rotates_and_reads_span_both_generations(tmp_path: Path) -> None:
    path = tmp_path / "state" / "events.jsonl"
    log = EventLog(path, max_bytes=4096)
    for i in range(100):
        log.append(make_event(EventKind.LOW_HEADROOM, f"event {i}", node="n"))
    assert log.rotations_total >= 1
    assert path.stat().st_size <= 4096 + 512
    assert (path.parent / "events.jsonl.1").stat().st_size <= 4096 + 512
    last = read_events(path, 30)
    assert [e["summary"] for e in last] == [f"event {i}" for i in range(70, 100)]
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700


def test_read_events_refuses_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "elsewhere.jsonl").write_text("")
    (tmp_path / "events.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(StateFileError, match="symlink"):
        read_events(tmp_path / "events.jsonl", 5)


def test_engines_output_on_a_pipe_has_no_control_characters(spawner: Spawner, tmp_path: Path) -> None:
    title = "VLLM::EngineCore \x1b[2J\x1b]0;pwned\x07\nsparkwatch: KILL vllm tree root=1 (9 processes): forged"
    engine = spawner.popen(
        [sys.executable, "-c", f"import setproctitle, time; setproctitle.setproctitle({title!r}); time.sleep(120)"]
    )
    assert wait_until(lambda: Path(f"/proc/{engine.pid}/cmdline").read_bytes().startswith(b"VLLM::"), 10)
    env = {"SPARKWATCH_ANCESTOR_PID": str(os.getpid()), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    for args in (["engines"], ["engines", "--json"]):
        res = cli(*args, env=env)
        assert res.returncode == 0, res.stderr
        assert "VLLM::EngineCore" in res.stdout
        assert "\x1b" not in res.stdout and "\x07" not in res.stdout
        assert not any(line.lstrip().startswith("sparkwatch: KILL") for line in res.stdout.splitlines())
    assert alive(engine.pid)
