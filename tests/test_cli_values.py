"""Command-line values are checked by their one owner (sparkwatch.cli.argtypes): a bad one is one line naming the
flag and exit 2. `engines --window -1` (or nan) and `events -n -5` used to be taken silently."""

from __future__ import annotations

import json
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
        (["wait-settled", "--tolerance", "9" * 400 + "GiB"], "argument --tolerance: 99999999999999999999…"),
        (["wait-settled", "--interval", "1e300"], "argument --interval: '1e300': expected 0 to 604800 seconds"),
        (["events", "-n", "9" * 5000], "argument -n: '99999999999999999999'… (5000 characters) is not a whole number"),
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


# --- launch: every number has a range, out of range is one line naming the field and exit 2 (never a traceback)

HUGE = "9" * 400  # float() makes it inf, int(inf) raised OverflowError; as an int, format_size's float() did


def _one_line_exit_2(res: subprocess.CompletedProcess[str], needle: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and res.stdout == "", res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    assert needle in res.stderr, res.stderr
    assert len(res.stderr) < 300, res.stderr  # the 400 digits are shown cut


@pytest.mark.parametrize(
    ("flags", "engine", "needle"),
    [
        (["--budget", HUGE + "GiB"], ["python3", "x.py"], "argument --budget:"),
        (["--margin", HUGE + "GiB"], ["vllm", "serve", "MODEL"], "argument --margin:"),
        (["--settle-timeout", "1e300"], ["vllm", "serve", "MODEL"], "argument --settle-timeout:"),
        ([], ["vllm", "serve", "MODEL", "--max-model-len", HUGE], "--max-model-len:"),
        ([], ["vllm", "serve", "MODEL", "--gpu-memory-utilization", HUGE], "--gpu-memory-utilization:"),
        ([], ["llama-server", "-m", "GGUF", "-c", HUGE], "-c:"),
    ],
)
def test_launch_values_out_of_range_are_one_line_and_exit_2(
    tmp_path: Path, flags: list[str], engine: list[str], needle: str
) -> None:
    from tests.planbox import LLAMA_HEADER, gguf, model_dir, plan

    model = model_dir(tmp_path / "m")
    weights = gguf(tmp_path / "x.gguf", LLAMA_HEADER)
    engine = [str(model) if w == "MODEL" else str(weights) if w == "GGUF" else w for w in engine]
    _one_line_exit_2(plan(tmp_path, *flags, "--", *engine, available_gib=100), needle)


def test_launch_max_jobs_out_of_range_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """MAX_JOBS from the environment: 400 digits, 0 (ninja -j0 runs unlimited jobs) and words (the compilers ignore
    it and run one job a core, the burst launch sets it against)."""
    from tests.planbox import model_dir, plan

    model = str(model_dir(tmp_path / "m"))
    for value in (HUGE, "0", "four"):
        res = plan(tmp_path, "--", "vllm", "serve", model, env={"MAX_JOBS": value}, available_gib=100)
        _one_line_exit_2(res, "MAX_JOBS:")
    assert plan(tmp_path, "--", "vllm", "serve", model, env={"MAX_JOBS": "2"}, available_gib=100).returncode in (0, 1)


def test_a_config_json_number_out_of_range_is_one_line_and_exit_2(tmp_path: Path) -> None:
    from tests.planbox import SMALL_SHAPE, model_dir, plan

    model = model_dir(tmp_path / "m", config=json.dumps(SMALL_SHAPE)[:-1] + f', "num_hidden_layers": {HUGE}}}')
    res = plan(tmp_path, "--", "vllm", "serve", str(model), available_gib=100)
    _one_line_exit_2(res, "config.json: num_hidden_layers:")
