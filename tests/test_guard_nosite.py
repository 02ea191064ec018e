"""The guard process starts without `site` (guard/start.py): an environment's .pth files (numba-cuda's import
redirector on the H200 image) import what other packages hook in, and in the guard all of it would stay mlocked. The
telemetry process, which needs site-packages, starts with it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import wait_until
from tests.daemon import sparkwatch_run


def test_the_guard_runs_without_site_and_telemetry_with_it(tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path) as d:
        assert wait_until(lambda: any("telemetry running" in line for line in d.stderr_lines), 30), d.stderr_lines
        guard = Path(f"/proc/{d.proc.pid}/cmdline").read_bytes().split(b"\0")
        children = [pid for f in Path(f"/proc/{d.proc.pid}/task").glob("*/children") for pid in f.read_text().split()]
        assert children, "no telemetry process"
        telemetry = Path(f"/proc/{children[0]}/cmdline").read_bytes().split(b"\0")
    assert guard[1] == b"-S", guard  # the flag the interpreter took, before the code
    assert b"-S" not in telemetry and b"sparkwatch.telemetry" in telemetry, telemetry
