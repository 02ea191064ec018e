"""Both processes start without `site` (guard/start.py): an environment's .pth files (numba-cuda's import redirector
on the H200 image) import what other packages hook in, and in the guard all of it would stay mlocked. Telemetry, which
needs site-packages, gets them as the path `sparkwatch run` ran on, and serves its metrics (prometheus_client) so."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import rfc3339
from sparkwatch.guard.process import parse_argv
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


GUARD_IMPORTS = """
import json, sys
sys.path[:0] = [sys.argv[1]]
from sparkwatch.guard.process import main
print(json.dumps(sorted(sys.modules)))
"""


def test_the_guard_imports_no_module_it_has_no_use_for() -> None:
    """Every module the guard imports stays resident and mlocked. argparse (with gettext) read one fixed line, datetime
    wrote one timestamp: 1.3 MiB between them, now read and written by hand (bench/RESULTS-rss-gpu.md)."""
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-S", "-c", GUARD_IMPORTS, root], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert "sparkwatch.guard.process" in loaded  # the probe imported what the guard runs
    assert not loaded & {"argparse", "gettext", "datetime", "pydantic", "rich", "prometheus_client"}, loaded


def test_the_guard_reads_the_line_exec_guard_writes() -> None:
    assert parse_argv(["--settings-fd", "7", "--", "--config", "x.toml", "--dry-run"]) == (
        7,
        ["--config", "x.toml", "--dry-run"],
    )
    assert parse_argv(["--settings-fd", "7", "--"]) == (7, [])
    for bad in ([], ["--settings-fd"], ["--settings-fd", "x", "--"], ["--other", "7"]):
        with pytest.raises(SystemExit, match="usage: sparkwatch-guard"):
            parse_argv(bad)


@pytest.mark.parametrize("seed", range(3))
def test_event_timestamps_are_written_as_datetime_writes_them(seed: int) -> None:
    rng = random.Random(seed)
    edges = [0.0, 0.0005, 0.9995, 0.9999995, 1_764_806_400.0, 1_764_806_400.9999996, 1_764_806_400.0004999, -0.5]
    for ts in (
        edges
        + [rng.uniform(0, 4e9) for _ in range(20_000)]
        + [rng.randrange(0, 4 * 10**9) / 1000 for _ in range(5_000)]
    ):
        want = datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        assert rfc3339(ts) == want, ts
