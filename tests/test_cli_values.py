"""Command-line values are checked by their one owner (sparkwatch.cli.argtypes): a bad one is one line naming the
flag and exit 2. `engines --window -1` (or nan) and `events -n -5` used to be taken silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.cli import main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["engines", "--window", "-1"], "argument --window: '-1': expected 0 to 60 seconds"),
        (["engines", "--window", "nan"], "argument --window: 'nan': expected 0 to 60 seconds"),
        (["engines", "--window", "soon"], "argument --window: 'soon' is not a number of seconds"),
        (["events", "-n", "-5"], "argument -n: '-5': expected a whole number, at least 0"),
        (["events", "-n", "2.5"], "argument -n: '2.5' is not a whole number"),
        (["wait-settled", "--timeout", "-3"], "argument --timeout: '-3'"),
        (["wait-settled", "--tolerance", "64"], "argument --tolerance: 64 has no unit"),
        (["engines", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_a_bad_value_is_one_line_and_exit_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("sparkwatch") and needle in err, err


@pytest.mark.parametrize("window", ["inf", "1e9"])
def test_a_window_that_would_never_end_is_refused(window: str) -> None:
    """In a child with a timeout: accepted, it would sleep for ever (it did)."""
    res = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "engines", "--window", window], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"argument --window: {window!r}: expected 0 to 60 seconds" in res.stderr


def test_the_edges_of_the_ranges_are_taken(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(SPARKWATCH_ANCESTOR_PID=str(os.getpid()), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    for argv in (["engines", "--json", "--window", "0"], ["events", "-n", "0", "--state-dir", str(tmp_path)]):
        res = subprocess.run(
            [sys.executable, "-m", "sparkwatch", *argv], capture_output=True, text=True, env=env, timeout=60
        )
        assert res.returncode == 0, (argv, res.stderr)
