"""Both processes start without `site` (guard/start.py): an environment's .pth files (numba-cuda's import redirector
on the H200 image) import what other packages hook in, and in the guard all of it would stay mlocked. Telemetry, which
needs site-packages, gets them as the path `sparkwatch run` ran on, and serves its metrics (prometheus_client) so."""

from __future__ import annotations

import functools
import urllib.request
from pathlib import Path

import pytest

from sparkwatch.common.daemonargv import parse_daemon_argv
from tests.conftest import wait_until
from tests.daemon import sparkwatch_run


def test_the_guard_and_telemetry_run_without_site(tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path, env={"LANG": "C.UTF-8"}) as d:  # as an owner's session has it
        assert wait_until(lambda: any("telemetry running" in line for line in d.stderr_lines), 30), d.stderr_lines
        guard = Path(f"/proc/{d.proc.pid}/cmdline").read_bytes().split(b"\0")
        children = [pid for f in Path(f"/proc/{d.proc.pid}/task").glob("*/children") for pid in f.read_text().split()]
        assert children, "no telemetry process"
        telemetry = Path(f"/proc/{children[0]}/cmdline").read_bytes().split(b"\0")
        with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=10) as r:
            assert b"sparkwatch_build_info" in r.read()  # prometheus_client found on the path it was given
        # No locale files mapped (they were 0.42 MiB of the guard's RSS on the H200 host), yet text stays UTF-8.
        maps = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in (d.proc.pid, int(children[0]))}
    for argv in (guard, telemetry):  # the flags the interpreter took, before the code
        assert argv[1:5] == [b"-S", b"-X", b"utf8", b"-c"], argv
    assert b"sparkwatch.telemetry" in telemetry[5], telemetry
    assert any(b"site-packages" in part for part in telemetry[5].split(b",")), telemetry  # the path it was given
    for pid, text in maps.items():
        assert "/usr/lib/locale" not in text, (pid, [line for line in text.splitlines() if "locale" in line])


def test_the_daemons_read_the_lines_sparkwatch_writes_them(capsys: pytest.CaptureFixture[str]) -> None:
    guard = functools.partial(
        parse_daemon_argv, usage="sparkwatch-guard", numbers=("--settings-fd",), required=("--settings-fd",)
    )
    assert guard(["--settings-fd", "7", "--", "--config", "x.toml", "--"]) == (
        {"--settings-fd": 7},
        ["--config", "x.toml", "--"],
    )
    telemetry = functools.partial(
        parse_daemon_argv, usage="t", numbers=("--channel-fd", "--guard-pid"), switches=("--no-nvml",)
    )
    assert telemetry(["--channel-fd", "3", "--no-nvml", "--guard-pid", "9"]) == (
        {"--channel-fd": 3, "--no-nvml": 1, "--guard-pid": 9},
        [],
    )
    for bad in ([], ["--settings-fd"], ["--settings-fd", "x", "--"], ["--other", "7"], ["--settings-fd", "-1"]):
        with pytest.raises(SystemExit) as exited:
            guard(bad)
        assert exited.value.code == 2
        assert capsys.readouterr().err.startswith("usage: sparkwatch-guard\n"), bad
