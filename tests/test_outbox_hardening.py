"""Alerting never stalls: slow receivers, hostile spool files, a crashing worker, a full outbox, a crash between the
event and its spool entry. Real receivers on 127.0.0.1, real files, a real daemon for the crash recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, make_event, read_events
from sparkwatch.common.spool import AlertRouter, alert_payload
from sparkwatch.config.settings import load_settings
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.telemetry.exporter.server import build_registry, render
from sparkwatch.telemetry.outbox import DeliveryError, Outbox
from tests.daemon import sparkwatch_run
from tests.receiver import Receiver, wait_until


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def outbox(spool: Path, url: str, logs: list[str], **kw: object) -> Outbox:
    params: dict[str, object] = {"timeout_s": 1.0, "backoff_min_s": 0.02, "backoff_max_s": 0.2, **kw}
    return Outbox(spool, url, "hardening-test-secret", log=lambda _level, line: logs.append(line), **params)  # type: ignore[arg-type]


def test_slow_body_cannot_hold_a_delivery(tmp_path: Path, receiver: Receiver) -> None:
    receiver.mode = "slow_body"
    logs: list[str] = []
    box = outbox(tmp_path / "outbox", receiver.url_base + "/hook", logs, timeout_s=1.0)
    started = time.monotonic()
    with pytest.raises(DeliveryError) as err:
        box.deliver("0001", b"{}")
    took = time.monotonic() - started
    assert "timed out" in str(err.value)
    # The body would take 60 s; the delivery's total deadline is 1 s (generous bound for a loaded box).
    assert took < 10, took


def test_hostile_spool_files_are_quarantined_and_alerted_once(tmp_path: Path, receiver: Receiver) -> None:
    state = tmp_path / "state"
    spool = state / "outbox"
    spool.mkdir(parents=True)
    good = alert_payload(make_event(EventKind.KILL, "good one", node="spark-a"))
    (spool / f"{good['id']}.json").write_text(json.dumps(good))
    (spool / "evil\r\nsparkwatch: KILL forged.json").write_text(json.dumps(good))
    (spool / "0000000000000aaaaaaaaaaaa.json").write_text("[" * 200_000 + "]" * 200_000)
    (spool / "0000000000000bbbbbbbbbbbb.json").write_bytes(b"\xff\xfe not json")
    (spool / "0000000000000cccccccccccc\n.json").write_text(json.dumps(good))  # `$` matched before the newline
    logs: list[str] = []
    box = outbox(spool, receiver.url_base + "/hook", logs)
    events = EventLog(state / "events.jsonl")
    events.subscribe(AlertRouter(box))
    box.start()
    try:
        assert wait_until(lambda: str(good["id"]) in receiver.ids(), timeout_s=15)
        assert box.quarantined_total == 4
        assert len(list((spool / "bad").iterdir())) == 4
        quarantined = [e for e in read_events(state / "events.jsonl") if e["kind"] == "outbox_quarantined"]
        assert len(quarantined) == 1  # one alert for the lot
        assert wait_until(lambda: any(d.payload["kind"] == "outbox_quarantined" for d in receiver.deliveries))
        assert wait_until(lambda: sorted(p.name for p in spool.iterdir() if p.name != "bad") == [])
        assert box._thread is not None and box._thread.is_alive()
        assert not any("\r" in line or "\n" in line for line in logs), logs
    finally:
        box.stop()


def test_worker_is_restarted_after_a_crash(tmp_path: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    logs: list[str] = []
    box = outbox(tmp_path / "outbox", receiver.url_base + "/hook", logs)
    real = box.deliver
    calls = {"n": 0}

    def crash_once(event_id: str, body: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a bug in the worker")
        real(event_id, body)

    monkeypatch.setattr(box, "deliver", crash_once)
    box.start()
    try:
        payload = alert_payload(make_event(EventKind.KILL, "after the crash", node="spark-a"))
        box.submit(payload)
        assert wait_until(lambda: receiver.ids() == [payload["id"]], timeout_s=15)
        assert box.worker_restarts_total == 1
        assert any("RuntimeError: a bug in the worker" in line and "restarting" in line for line in logs), logs
    finally:
        box.stop()


def test_redirect_reason_is_logged(tmp_path: Path, receiver: Receiver) -> None:
    receiver.mode = "redirect"
    receiver.redirect_to = "https://elsewhere.example/new/path?token=abc"
    logs: list[str] = []
    box = outbox(tmp_path / "outbox", receiver.url_base + "/hook", logs)
    box.start()
    try:
        box.submit(alert_payload(make_event(EventKind.KILL, "x", node="spark-a")))
        assert wait_until(lambda: any("302" in line for line in logs), timeout_s=10)
        line = next(line for line in logs if "302" in line)
        assert "redirect to https://elsewhere.example" in line and "not followed" in line
        assert "token=abc" not in line and "/new/path" not in line
    finally:
        box.stop()


def test_full_outbox_drops_oldest_first_counted_and_alerted_once(tmp_path: Path) -> None:
    state = tmp_path / "state"
    logs: list[str] = []
    box = outbox(state / "outbox", "http://127.0.0.1:9/hook", logs, max_alerts=5, backoff_min_s=30, backoff_max_s=60)
    events = EventLog(state / "events.jsonl")
    events.subscribe(AlertRouter(box))
    box.start()
    try:
        kills = []
        for i in range(12):
            event = make_event(EventKind.KILL, f"kill {i}", node="spark-a", ts=1_700_000_000 + i)
            kills.append(event.id)
            events.append(event)
        assert wait_until(
            lambda: any(e["kind"] == "outbox_dropped" for e in read_events(state / "events.jsonl")), timeout_s=10
        )
        assert box.pending <= 5
        assert box.dropped_total >= 7
        spooled = sorted(p.name[: -len(".json")] for p in (state / "outbox").glob("*.json"))
        assert set(spooled) <= set(kills[7:]) | {
            e["id"] for e in read_events(state / "events.jsonl") if e["kind"] == "outbox_dropped"
        }
        assert [e["kind"] for e in read_events(state / "events.jsonl")].count("outbox_dropped") == 1
        assert any("outbox full" in line for line in logs)
        exposition = render(build_registry(load_settings(), lambda: None, outbox=box)).decode()
        assert f"sparkwatch_alerts_dropped_total {float(box.dropped_total)}" in exposition
    finally:
        box.stop()


CRASHER = """
import os, signal, sys
from pathlib import Path
from sparkwatch.common.durable import append_durable
from sparkwatch.common.eventlog import make_event
from sparkwatch.telemetry.outbox import Outbox
from sparkwatch.common.spool import AlertRouter
from sparkwatch.config.settings import load_settings
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.telemetry.exporter.server import build_registry, render
import json

state = Path(sys.argv[1])
where = sys.argv[2]
box = Outbox(state / "outbox", "http://127.0.0.1:9/hook")
router = AlertRouter(box)
event = make_event(EventKind.KILL, f"killed just before the crash ({where})", {"engine": "vllm"})
print(event.id, flush=True)
commit = router.prepare(event)  # the spool write, as EventLog.append does first
if where == "after-event":
    line = (json.dumps(event.to_json_dict(), separators=(",", ":")) + "\\n").encode()
    append_durable(state / "events.jsonl", line)  # the event write, as EventLog.append does second
os.kill(os.getpid(), signal.SIGKILL)  # before the commit
"""


@pytest.mark.parametrize("where", ["before-event", "after-event"])
def test_crash_between_event_and_spool_loses_nothing(tmp_path: Path, receiver: Receiver, where: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHER, str(state), where], capture_output=True, text=True, timeout=60
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    event_id = crashed.stdout.strip()
    assert [p.name for p in (state / "outbox").iterdir()] == [f".pending-{event_id}.json"]
    env = {"SPARKWATCH_WEBHOOK_URL": receiver.url_base + "/hook", "SPARKWATCH_MLOCK": "false"}
    with sparkwatch_run(tmp_path, env=env):
        assert wait_until(lambda: event_id in receiver.ids(), timeout_s=30)
        # The receiver saw the request before its answer reached the outbox, which drops the spooled file only then:
        # stopped in between, the file stays to be sent again at the next start (at least once, by design).
        assert wait_until(lambda: not list((state / "outbox").glob("*.json")), timeout_s=10)
    ids = [e["id"] for e in read_events(state / "events.jsonl")]
    assert ids.count(event_id) == 1  # the record exists exactly once: restored, or found and not duplicated
    assert list((state / "outbox").glob("*.json")) == []
    assert os.stat(state).st_mode & 0o077 == 0


GUARD_CRASHER = """
import os, signal, sys
from pathlib import Path
from sparkwatch.common.eventlog import EventLog, make_event
from sparkwatch.common.spool import AlertRouter, FileSpool
from sparkwatch.core.eventkinds import EventKind

state = Path(sys.argv[1])
log = EventLog(state / "events.jsonl")
log.subscribe(AlertRouter(FileSpool(state / "outbox")))  # as the guard process wires it when a webhook is set
log.subscribe(lambda event: os.kill(os.getpid(), signal.SIGKILL))  # dies where it hands the event to telemetry
event = make_event(EventKind.KILL, "killed just before the guard died", {"engine": "vllm"})
print(event.id, flush=True)
log.append(event)
"""


def test_guard_dying_before_the_hand_over_loses_no_alert(tmp_path: Path, receiver: Receiver) -> None:
    """The guard process writes a kill, then dies before telemetry has it: its own spool file carries the alert."""
    state = tmp_path / "state"
    state.mkdir()
    crashed = subprocess.run(
        [sys.executable, "-c", GUARD_CRASHER, str(state)], capture_output=True, text=True, timeout=60
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    event_id = crashed.stdout.strip()
    assert [p.name for p in (state / "outbox").iterdir()] == [f"{event_id}.json"]
    env = {"SPARKWATCH_WEBHOOK_URL": receiver.url_base + "/hook", "SPARKWATCH_MLOCK": "false"}
    with sparkwatch_run(tmp_path, env=env):
        assert wait_until(lambda: event_id in receiver.ids(), timeout_s=30)
        # The receiver saw the request before its answer reached the outbox, which drops the spooled file only then:
        # stopped in between, the file stays to be sent again at the next start (at least once, by design).
        assert wait_until(lambda: not list((state / "outbox").glob("*.json")), timeout_s=10)
    assert [e["id"] for e in read_events(state / "events.jsonl")].count(event_id) == 1
    assert list((state / "outbox").glob("*.json")) == []
