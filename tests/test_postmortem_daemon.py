"""The verdict in the daemon: once per boot (not once per restart), a previous_boot event, one signed alert unless
the previous boot ended cleanly, the class as a metric. The command: tests/test_postmortem_cli.py."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.core.postmortem.verdict import BootEnd
from sparkwatch.telemetry.postmortemtask import PostmortemWatch
from tests.conftest import require, require_tool
from tests.daemon import scrape, sparkwatch_run
from tests.helpers import journal_fixture as jf
from tests.receiver import Receiver, wait_until

SECRET = "postmortem-hmac-secret"


@pytest.fixture
def tools() -> None:
    require(jf.journal_remote() is not None, "systemd-journal-remote is not installed (apt packages: .ci/run)")
    require_tool("journalctl")


# --- once per boot, in the telemetry process


@dataclass(frozen=True)
class Cfg:
    state_dir: Path
    proc_root: Path
    root: Path
    postmortem_journal_dir: Path | None
    postmortem: bool = True


def fixture_proc(tmp_path: Path, boot_id: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "sys/kernel/random").mkdir(parents=True)
    (proc / "sys/kernel/random/boot_id").write_text(
        f"{boot_id[:8]}-{boot_id[8:12]}-{boot_id[12:16]}-{boot_id[16:20]}-{boot_id[20:]}\n"
    )
    (proc / "stat").write_text("cpu 1 2 3\nbtime 1763700000\n")
    return proc


def test_judged_once_per_boot_even_when_telemetry_dies_before_its_mark(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.XID_79)
    cfg = Cfg(tmp_path / "state", fixture_proc(tmp_path, "e" * 32), tmp_path / "root", boots.directory)
    first = PostmortemWatch(cfg, EventLog(cfg.state_dir / "events.jsonl"))
    judged = first.judge_once()
    assert judged is not None and judged.boot_class == BootEnd.XID and judged.judged_boot_id == boots.previous_boot
    (event,) = read_events(cfg.state_dir / "events.jsonl")
    assert event["kind"] == "previous_boot" and event["class"] == "xid" and event["current_boot_id"] == "e" * 32
    assert "fallen off the bus" in " ".join(event["evidence"])
    # a restart in the same boot: nothing new, the same class for the metric
    again = PostmortemWatch(cfg, EventLog(cfg.state_dir / "events.jsonl"))
    assert again.judge_once() == judged
    # a telemetry process that died after the event and before its mark: the event is found, not repeated
    (cfg.state_dir / "postmortem.json").unlink()
    third = PostmortemWatch(cfg, EventLog(cfg.state_dir / "events.jsonl"))
    found = third.judge_once()
    assert found is not None and found.boot_class == BootEnd.XID and third.verdict is None
    assert len(read_events(cfg.state_dir / "events.jsonl")) == 1
    # the next boot judges again
    cfg2 = Cfg(cfg.state_dir, fixture_proc(tmp_path / "next", "f" * 32), cfg.root, boots.directory)
    fourth = PostmortemWatch(cfg2, EventLog(cfg.state_dir / "events.jsonl"))
    assert fourth.judge_once() is not None and fourth.verdict is not None
    assert len(read_events(cfg.state_dir / "events.jsonl")) == 2


# --- the daemon: one signed alert after a driver_no_memory boot, and not a second one after a restart


def test_a_daemon_after_a_driver_no_memory_boot_sends_one_signed_alert(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.NVRM_NO_MEMORY)
    receiver = Receiver().start()
    env = {
        "SPARKWATCH_POSTMORTEM": "true",
        "SPARKWATCH_POSTMORTEM_JOURNAL_DIR": str(boots.directory),
        "SPARKWATCH_WEBHOOK_URL": receiver.url_base + "/hook",
        "SPARKWATCH_WEBHOOK_SECRET": SECRET,
        "SPARKWATCH_MLOCK": "false",
    }

    def previous_boot_deliveries() -> list[dict[str, object]]:
        return [d.payload for d in receiver.deliveries if d.payload["kind"] == "previous_boot"]

    try:
        with sparkwatch_run(tmp_path, env=env) as daemon:
            assert wait_until(lambda: len(previous_boot_deliveries()) == 1, 30), daemon.stderr_lines
            (delivery,) = [d for d in receiver.deliveries if d.payload["kind"] == "previous_boot"]
            assert delivery.signature_ok(SECRET.encode())
            body = delivery.payload
            assert body["class"] == "driver_no_memory" and body["boot_id"] == boots.previous_boot
            assert any("NV_ERR_NO_MEMORY" in str(line) for line in body["evidence"])  # type: ignore[attr-defined]
            assert "driver_no_memory" in str(body["text"])
            assert wait_until(
                lambda: (
                    'sparkwatch_previous_boot_end_timestamp_seconds{class="driver_no_memory"}' in scrape(daemon.port)
                )
            )
            assert any("previous boot ended: driver_no_memory" in line for line in daemon.stderr_lines)
        with sparkwatch_run(tmp_path, env=env) as daemon:
            # the second start in this boot: the metric again, from postmortem.json; no second judgement or alert
            assert wait_until(
                lambda: (
                    'sparkwatch_previous_boot_end_timestamp_seconds{class="driver_no_memory"}' in scrape(daemon.port)
                )
            )
            time.sleep(2.0)
            assert not any("previous boot ended" in line for line in daemon.stderr_lines)
        assert len(previous_boot_deliveries()) == 1
        kinds = [e["kind"] for e in read_events(tmp_path / "state" / "events.jsonl")]
        assert kinds.count("previous_boot") == 1
    finally:
        receiver.stop()


def test_a_clean_previous_boot_is_recorded_but_does_not_alert(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.CLEAN)
    receiver = Receiver().start()
    env = {
        "SPARKWATCH_POSTMORTEM": "true",
        "SPARKWATCH_POSTMORTEM_JOURNAL_DIR": str(boots.directory),
        "SPARKWATCH_WEBHOOK_URL": receiver.url_base + "/hook",
        "SPARKWATCH_MLOCK": "false",
    }
    try:
        with sparkwatch_run(tmp_path, env=env):
            assert wait_until(
                lambda: any(e["kind"] == "previous_boot" for e in read_events(tmp_path / "state" / "events.jsonl")), 30
            )
            time.sleep(1.5)  # an alert would have been spooled with the event and sent at once
        (event,) = [e for e in read_events(tmp_path / "state" / "events.jsonl") if e["kind"] == "previous_boot"]
        assert event["class"] == "clean"
        assert receiver.requests_total == 0
    finally:
        receiver.stop()
