"""Both processes start without `site` (guard/start.py): an environment's .pth files (numba-cuda's import redirector
on the H200 image) import what other packages hook in, and in the guard all of it would stay mlocked. Telemetry, which
needs site-packages, gets them as the path `sparkwatch run` ran on, and serves its metrics (prometheus_client) so."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tests.conftest import wait_until
from tests.daemon import sparkwatch_run


def test_the_guard_and_telemetry_run_without_site(tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path) as d:
        assert wait_until(lambda: any("telemetry running" in line for line in d.stderr_lines), 30), d.stderr_lines
        guard = Path(f"/proc/{d.proc.pid}/cmdline").read_bytes().split(b"\0")
        children = [pid for f in Path(f"/proc/{d.proc.pid}/task").glob("*/children") for pid in f.read_text().split()]
        assert children, "no telemetry process"
        telemetry = Path(f"/proc/{children[0]}/cmdline").read_bytes().split(b"\0")
        with urllib.request.urlopen(f"http://127.0.0.1:{d.port}/metrics", timeout=10) as r:
            assert b"sparkwatch_build_info" in r.read()  # prometheus_client found on the path it was given
    assert guard[1] == b"-S", guard  # the flag the interpreter took, before the code
    assert telemetry[1] == b"-S" and b"sparkwatch.telemetry" in telemetry[3], telemetry
    assert any(b"site-packages" in part for part in telemetry[3].split(b",")), telemetry  # the path it was given
