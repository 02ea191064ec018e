"""The alert outbox against a real HTTP receiver on 127.0.0.1: retries, restarts, redirects, garbage, full disk."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkwatch.common.eventlog import EventLog, make_event
from sparkwatch.common.spool import AlertRouter, alert_payload
from sparkwatch.config.settings import load_settings
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.telemetry.exporter.server import build_registry, render
from sparkwatch.telemetry.outbox import Outbox
from tests.conftest import require_tool
from tests.receiver import GarbageServer, Receiver, wait_until

SECRET = "s3cr3t-hmac-key"
PATH_SECRET = "/services/T0FAKE/B0FAKE/XyZsecretPathToken"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def make_outbox(spool: Path, url: str, logs: list[str], timeout_s: float = 1.0) -> Outbox:
    return Outbox(
        spool,
        url,
        SECRET,
        log=lambda _level, line: logs.append(line),
        timeout_s=timeout_s,
        backoff_min_s=0.02,
        backoff_max_s=0.2,
    )


def payload(i: int, kind: EventKind = EventKind.KILL) -> dict[str, object]:
    return alert_payload(make_event(kind, f"test event {i}", {"n": i}, node="spark-a"))


def test_delivers_signed_payload_with_text(tmp_path: Path, receiver: Receiver) -> None:
    logs: list[str] = []
    box = make_outbox(tmp_path / "outbox", receiver.url_base + PATH_SECRET, logs)
    box.start()
    try:
        sent = [payload(i) for i in range(3)]
        for p in sent:
            box.submit(p)
        assert wait_until(lambda: box.delivered_total == 3)
    finally:
        box.stop()
    assert sorted(receiver.ids()) == sorted(str(p["id"]) for p in sent)
    for d in receiver.deliveries:
        assert d.signature_ok(SECRET.encode())
        assert d.path == PATH_SECRET
        body = d.payload
        assert body["id"] == d.event_id and body["kind"] == "kill"
        assert str(body["text"]).startswith(":skull: sparkwatch on spark-a: test event")
    assert box.pending == 0 and list((tmp_path / "outbox").iterdir()) == []


def test_500_then_recovers_with_backoff(tmp_path: Path, receiver: Receiver) -> None:
    logs: list[str] = []
    receiver.mode = "500"
    box = make_outbox(tmp_path / "outbox", receiver.url_base + "/hook", logs)
    box.start()
    try:
        box.submit(payload(1))
        assert wait_until(lambda: box.failed_attempts_total >= 3)
        assert box.pending == 1 and len(list((tmp_path / "outbox").glob("*.json"))) == 1
        receiver.mode = "ok"
        assert wait_until(lambda: box.delivered_total == 1)
    finally:
        box.stop()
    assert box.last_error is not None and "500" in box.last_error
    assert len(receiver.ids()) == 1


def test_backoff_is_exponential_and_capped(tmp_path: Path) -> None:
    box = Outbox(tmp_path, "http://127.0.0.1:9/x", backoff_min_s=1.0, backoff_max_s=60.0)
    delays = [box._backoff_s(n) for n in range(1, 12)]
    assert 0.8 <= delays[0] <= 1.2 and 1.6 <= delays[1] <= 2.4 and 6.4 <= delays[3] <= 9.6
    assert max(delays) <= 72.0 and delays[-1] >= 48.0  # the cap, with its jitter


def test_restart_resends_everything_pending(tmp_path: Path, receiver: Receiver) -> None:
    logs: list[str] = []
    url = receiver.url_base + "/hook"
    receiver.stop()  # down before the first event
    first = make_outbox(tmp_path / "outbox", url, logs)
    first.start()
    sent = [payload(i) for i in range(5)]
    for p in sent:
        first.submit(p)
    assert wait_until(lambda: first.failed_attempts_total >= 2)
    first.stop()  # sparkwatch restarts while the receiver is down
    assert len(list((tmp_path / "outbox").glob("*.json"))) == 5
    receiver.start()
    second = make_outbox(tmp_path / "outbox", url, logs)
    second.start()
    try:
        assert second.pending == 5
        assert wait_until(lambda: second.delivered_total == 5)
    finally:
        second.stop()
    assert sorted(receiver.ids()) == sorted(str(p["id"]) for p in sent)
    assert any("undelivered alerts from before" in line for line in logs)


def test_redirect_is_not_followed(tmp_path: Path, receiver: Receiver) -> None:
    other = Receiver(host="127.0.0.2").start()  # another host
    try:
        receiver.mode = "redirect"
        receiver.redirect_to = other.url_base + "/stolen"
        logs: list[str] = []
        box = make_outbox(tmp_path / "outbox", receiver.url_base + PATH_SECRET, logs)
        box.start()
        try:
            box.submit(payload(1))
            assert wait_until(lambda: box.failed_attempts_total >= 2)
            assert other.requests_total == 0 and box.pending == 1
            assert box.last_error is not None and "redirect" in box.last_error
            receiver.mode = "ok"
            assert wait_until(lambda: box.delivered_total == 1)
        finally:
            box.stop()
    finally:
        other.stop()


def test_garbage_answer_is_a_failed_attempt(tmp_path: Path, receiver: Receiver) -> None:
    garbage = GarbageServer()
    logs: list[str] = []
    box = make_outbox(tmp_path / "outbox", f"http://127.0.0.1:{garbage.port}{PATH_SECRET}", logs)
    box.start()
    try:
        box.submit(payload(1))
        assert wait_until(lambda: box.failed_attempts_total >= 2)
        assert box.pending == 1 and garbage.connections >= 2
    finally:
        box.stop()
        garbage.close()
    # the spooled alert survives and goes out once the URL points at a real receiver
    box2 = make_outbox(tmp_path / "outbox", receiver.url_base + "/hook", logs)
    box2.start()
    try:
        assert wait_until(lambda: box2.delivered_total == 1)
    finally:
        box2.stop()


def test_timeout_does_not_block_stop(tmp_path: Path, receiver: Receiver) -> None:
    receiver.mode = "hang"
    logs: list[str] = []
    box = make_outbox(tmp_path / "outbox", receiver.url_base + "/hook", logs, timeout_s=0.3)
    box.start()
    box.submit(payload(1))
    assert wait_until(lambda: box.failed_attempts_total >= 1, timeout_s=5)
    assert box.last_error is not None and "timed out" in box.last_error
    box.stop()
    assert box.pending == 1


def test_url_and_secret_never_logged(tmp_path: Path, receiver: Receiver) -> None:
    logs: list[str] = []
    receiver.mode = "500"
    box = make_outbox(tmp_path / "a", receiver.url_base + PATH_SECRET + "?token=qs-secret", logs)
    box.start()
    box.submit(payload(1))
    assert wait_until(lambda: box.failed_attempts_total >= 2)
    box.stop()
    refused = make_outbox(tmp_path / "b", "http://127.0.0.1:9" + PATH_SECRET, logs)  # discard port: refused
    refused.start()
    refused.submit(payload(2))
    assert wait_until(lambda: refused.failed_attempts_total >= 1)
    refused.stop()
    text = "\n".join([*logs, str(box.last_error), str(refused.last_error), box.target, refused.target])
    assert logs and "failed" in text
    for secret in ("XyZsecretPathToken", "qs-secret", SECRET, "/services/"):
        assert secret not in text
    assert f"127.0.0.1:{receiver.port}" in box.target


def test_full_disk_under_state_dir(tmp_path: Path, receiver: Receiver) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny tmpfs needs root")
    mnt = tmp_path / "full"
    mnt.mkdir()
    # mode=0700: a tmpfs root is 1777 by default, which the outbox now refuses as a state dir (others may write).
    tiny = ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mnt)]
    if subprocess.run(tiny, check=False).returncode != 0:
        pytest.skip("mount -t tmpfs not permitted here")
    try:
        spool = mnt / "outbox"
        spool.mkdir()
        fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        logs: list[str] = []
        box = make_outbox(spool, receiver.url_base + "/hook", logs)
        box.start()
        try:
            big = payload(1)
            big["victims"] = [{"cmdline": "x" * 8000}]
            box.submit(big)  # cannot be spooled: kept in memory, still delivered
            assert box.spool_errors_total == 1
            assert any("disk full" in line for line in logs)
            assert wait_until(lambda: box.delivered_total == 1)
            (mnt / "filler").unlink()
            receiver.mode = "500"
            box.submit(payload(2))  # the disk has room again: spooled durably
            assert wait_until(lambda: len(list(spool.glob("*.json"))) == 1)
        finally:
            box.stop()
        assert receiver.ids() == [big["id"]]
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_router_alerts_and_rate_limits(tmp_path: Path, receiver: Receiver) -> None:
    logs: list[str] = []
    box = make_outbox(tmp_path / "outbox", receiver.url_base + "/hook", logs)
    now = [1000.0]
    router = AlertRouter(box, clock=lambda: now[0])
    events = EventLog(tmp_path / "events.jsonl")
    events.subscribe(router)
    box.start()
    try:
        events.append(make_event(EventKind.KILL, "kill 1"))
        events.append(make_event(EventKind.KILL, "kill 2"))  # every kill alerts
        events.append(make_event(EventKind.LOW_HEADROOM, "low 1"))
        events.append(make_event(EventKind.LOW_HEADROOM, "low 2"))  # within 15 min: suppressed
        events.append(make_event(EventKind.JIT_STATE, "not an alert kind"))
        events.append(make_event(EventKind.NO_VICTIM, "nothing to kill"))  # the guard fired and found no engine
        now[0] += 901
        events.append(make_event(EventKind.LOW_HEADROOM, "low 3"))
        assert wait_until(lambda: box.delivered_total == 5)
    finally:
        box.stop()
    got = sorted(d.payload["summary"] for d in receiver.deliveries)  # type: ignore[type-var]
    assert got == ["kill 1", "kill 2", "low 1", "low 3", "nothing to kill"]
    assert router.suppressed_total == 1
    logged = [json.loads(line)["summary"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert len(logged) == 7  # every event is recorded, alert or not


def test_outbox_state_is_exported(tmp_path: Path, receiver: Receiver) -> None:
    """A receiver that answers 500 shows as a pending alert and climbing failures on /metrics, then as delivered."""
    receiver.mode = "500"
    box = make_outbox(tmp_path / "outbox", receiver.url_base + PATH_SECRET, [])
    registry = build_registry(load_settings(overrides={"state_dir": tmp_path}), lambda: None, outbox=box)

    def scrape() -> dict[str, float]:
        text = render(registry).decode()
        assert PATH_SECRET not in text and SECRET not in text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    box.start()
    try:
        box.submit(payload(1))
        assert wait_until(lambda: box.failed_attempts_total >= 2)
        failing = scrape()
        assert failing["sparkwatch_alerts_pending"] == 1
        assert failing["sparkwatch_alert_delivery_failures_total"] >= 2
        assert "sparkwatch_alert_last_delivery_timestamp_seconds" not in failing
        receiver.mode = "ok"
        assert wait_until(lambda: box.delivered_total == 1)
        delivered = scrape()
    finally:
        box.stop()
    assert delivered["sparkwatch_alerts_pending"] == 0
    assert delivered["sparkwatch_alerts_delivered_total"] == 1
    assert delivered["sparkwatch_alert_last_delivery_timestamp_seconds"] > 0
    promtool = require_tool("promtool")
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=render(registry).decode(), capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
