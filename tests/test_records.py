"""The durable record: events.jsonl, redaction, the kill line, `sparkwatch events`."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, EventLogError, make_event, read_events
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill.killrecord import KillFacts, kill_fields, kill_line
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, Event, MemInfo, Proc
from sparkwatch.core.redact import REDACTED, safe_cmdline
from sparkwatch.core.units import MiB


def test_secrets_are_stripped_from_cmdlines() -> None:
    argv = [
        "vllm",
        "serve",
        "m",
        "--api-key",
        "abc123",
        "--hf-token=hf_abcdefghijklmnopqrstuvwxyz",
        "sk-abcdefghijklmnopqrstuvwx",
        "--url",
        "https://user:pw@host/x",
        "HF_TOKEN=zzz",
        "--port",
        "8000",
    ]
    text = safe_cmdline(argv)
    for secret in ("abc123", "hf_abcdefghij", "sk-abcdef", "pw@", "zzz"):
        assert secret not in text
    assert text.count(REDACTED) == 5
    assert "--port 8000" in text
    assert len(safe_cmdline(["x" * 1000])) <= 240


def facts(dry_run: bool = False) -> KillFacts:
    root = Proc(
        pid=1234,
        ppid=1,
        uid=1000,
        comm="VLLM::EngineCor",
        state="S",
        start_ticks=1,
        rss_bytes=2 << 30,
        argv=("VLLM::EngineCore",),
    )
    tree = EngineTree(kind="vllm", root=root, members=(root,) * 9)
    mem = MemInfo(
        total_bytes=127600748 * 1024,
        available_bytes=4726 * MiB,
        free_bytes=0,
        buffers_bytes=0,
        cached_bytes=0,
        swap_total_bytes=0,
        swap_free_bytes=0,
    )
    return KillFacts(
        trigger=Trigger.FLOOR,
        mem=mem,
        floor_bytes=8192 * MiB,
        fill_rate_bytes_per_s=1e9,
        dry_run=dry_run,
        trees=(tree,),
        victims=((root, "vllm"),),
        detect_to_signal_ms=1.234,
        signal_to_reaped_ms=40.0,
        reclaimed_bytes=3 << 30,
    )


def test_kill_line_matches_the_field_grep() -> None:
    assert kill_line(facts()) == (
        "sparkwatch: KILL vllm tree root=1234 (9 processes): MemAvailable 4.6 GiB <= floor 8.0 GiB"
    )
    assert kill_line(facts(dry_run=True)).startswith("sparkwatch: DRY-RUN would KILL vllm tree")


def test_a_kill_writes_every_size_in_one_format() -> None:
    """One kill showed its floor as "21761 MiB" in the line and "21.3 GiB" elsewhere: every size of the record now
    comes from core.units.format_size, so the line, the summary and the terminal note agree."""
    from dataclasses import replace

    from sparkwatch.core.kill.killrecord import kill_summary, terminal_note

    f = replace(facts(), floor_bytes=21761 * MiB, available_after_settle_bytes=30 << 30, settle_s=1.0)
    texts = [kill_line(f), kill_summary(f), terminal_note(f, f.trees[0])]
    for text in texts:
        assert "floor 21.3 GiB" in text, text
        assert re.search(r"\b\d{4,} MiB\b", text) is None, text
    lone = replace(f.trees[0], members=(f.trees[0].root,))
    assert "(1 process)" in kill_line(replace(f, trees=(lone,)))  # never "(1 processes)"
    assert "1 process)" in kill_summary(replace(f, trees=(lone,)))


@pytest.mark.parametrize(
    ("group", "shown"),
    [("10.9.0.1:29500", "10.9.0.1:29500"), ("a1b2c3d4e5f6" + "0" * 24, "a1b2c3d4e5f6")],
    ids=["rendezvous", "ray"],
)
def test_a_group_kill_names_a_rendezvous_whole(group: str, shown: str) -> None:
    """A group without Ray is its rendezvous `addr:port`: cut to 12 it read `10.9.0.1:295`, another port, in the
    line, the summary and the webhook. A Ray placement group's 36 hex digits stay cut to 12 there; the event's `group`
    field is whole for both."""
    from dataclasses import replace

    from sparkwatch.core.kill.killrecord import GroupLoss, kill_summary
    from sparkwatch.core.kill.triggers import Trigger

    loss = GroupLoss(group=group, cause="exit 1", first_node="b", first_pid=7, roles=((1234, "rank"),))
    f = replace(facts(), trigger=Trigger.GROUP_TEARDOWN, group=loss)
    for text in (kill_line(f), kill_summary(f)):
        assert f"group {shown}:" in text or f"group {shown} " in text, text
        assert group == shown or group not in text, text
    assert kill_fields(f)["group"] == group


def test_kill_event_has_the_contract_fields(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "state" / "events.jsonl")
    seen: list[Event] = []
    log.subscribe(seen.append)
    event = make_event(EventKind.KILL, "Killed vllm.", kill_fields(facts()))
    log.append(event)
    (line,) = (tmp_path / "state" / "events.jsonl").read_text().splitlines()
    data = json.loads(line)
    for key in (
        "id",
        "ts",
        "kind",
        "node",
        "summary",
        "trigger",
        "mem_available_bytes",
        "floor_bytes",
        "fill_rate_bytes_per_second",
        "dry_run",
        "victims",
        "detect_to_signal_ms",
        "signal_to_reaped_ms",
        "reclaimed_bytes",
    ):
        assert key in data, key
    assert data["victims"][0] == {
        "pid": 1234,
        "name": "VLLM::EngineCore",
        "engine": "vllm",
        "rss_bytes": 2 << 30,
        "cmdline": "VLLM::EngineCore",
    }
    assert data["ts"].endswith("Z")
    assert seen == [event]
    assert stat.S_IMODE(os.stat(tmp_path / "state" / "events.jsonl").st_mode) == 0o600


def test_unwritable_state_dir_is_an_error_not_a_crash(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    log = EventLog(blocker / "events.jsonl")
    heard: list[Event] = []
    log.subscribe(heard.append)
    event = make_event(EventKind.KILL, "x")
    with pytest.raises(EventLogError):
        log.append(event)
    assert log.write_errors_total == 1
    assert log.recent  # still kept in memory for the exporter
    assert heard == [event]  # and still handed to the alert outbox: a kill on a full disk is not a silent kill


def test_read_events_tail_skips_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    for i in range(50):
        log.append(make_event(EventKind.LOW_HEADROOM, f"event {i}"))
    with open(path, "a") as fh:
        fh.write('{"kind": "kill", "summ')  # a torn final write
    last = read_events(path, 5)
    assert [e["summary"] for e in last] == [f"event {i}" for i in range(45, 50)]
    assert len(read_events(path)) == 50
    assert read_events(tmp_path / "missing.jsonl", 5) == []


def test_events_cli(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    log.append(make_event(EventKind.KILL, "Killed vllm (root pid 1234, 9 processes)."))
    env = {**os.environ, "SPARKWATCH_STATE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "events", "-n", "5"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0
    assert "kill" in out.stdout and "root pid 1234" in out.stdout
    js = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "events", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert json.loads(js.stdout.splitlines()[0])["kind"] == "kill"
