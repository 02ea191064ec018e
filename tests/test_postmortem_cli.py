"""`sparkwatch postmortem [--json] [--journal-dir DIR] [--state-dir DIR]`: the verdict, evidence, last minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import require, require_tool
from tests.helpers import journal_fixture as jf


@pytest.fixture
def tools() -> None:
    require(jf.journal_remote() is not None, "systemd-journal-remote is not installed (apt packages: .ci/run)")
    require_tool("journalctl")


def postmortem_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", "postmortem", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_the_command_prints_the_verdict_and_its_json(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.NVRM_NO_MEMORY)
    state = tmp_path / "state"
    samples = jf.write_ring(state, boots.previous_boot, boots.previous_end - 3)
    done = postmortem_cli("--json", "--journal-dir", str(boots.directory), "--state-dir", str(state))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["class"] == "driver_no_memory"
    assert isinstance(data["evidence"], list) and any("NV_ERR_NO_MEMORY" in line for line in data["evidence"])
    recorder = data["recorder"]
    assert recorder["last_sample_at"] == pytest.approx(samples[-1].t)
    assert len(recorder["samples"]) == 61 and recorder["samples"][-1]["available_bytes"] == samples[-1].available_bytes
    text = postmortem_cli("--journal-dir", str(boots.directory), "--state-dir", str(state))
    assert text.returncode == 0, text.stderr
    assert "driver_no_memory" in text.stdout and "NV_ERR_NO_MEMORY" in text.stdout
    assert "MemAvailable" in text.stdout and "vllm" in text.stdout  # the timeline of the last minute
    empty = postmortem_cli("--json", "--journal-dir", str(tmp_path / "none"), "--state-dir", str(tmp_path / "s2"))
    assert empty.returncode == 0, empty.stderr
    nothing = json.loads(empty.stdout)
    assert nothing["class"] == "unknown" and nothing["evidence"] == [] and nothing["recorder"] is None
    said = postmortem_cli("--journal-dir", str(tmp_path / "none"), "--state-dir", str(tmp_path / "s2")).stdout
    assert said.startswith("previous boot (its id and its end unknown: no journal"), said  # never `? ended ?`
    assert "?" not in said.splitlines()[0], said
