"""One POST against a real receiver on 127.0.0.1, and what its answer means for the queue: delivered, this item
rejected (pushed back alone), or a transport failure (the whole queue pauses). And the wiring: through the outbox's
worker, one payload the receiver rejects holds up none of the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import make_event
from sparkwatch.common.spool import alert_payload
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.telemetry.outbox import DeliveryError, Outbox
from sparkwatch.telemetry.outbox.transport import Transport
from tests.receiver import GarbageServer, Receiver, wait_until

SECRET = "transport-test-secret"
PATH_SECRET = "/services/T0FAKE/B0FAKE/XyZsecretPathToken"


def body(summary: str = "one kill") -> tuple[str, bytes]:
    payload = alert_payload(make_event(EventKind.KILL, summary, node="spark-a"))
    return str(payload["id"]), json.dumps(payload).encode()


def failure(transport: Transport) -> DeliveryError:
    with pytest.raises(DeliveryError) as err:
        transport.deliver(*body())
    return err.value


def test_2xx_is_delivered_signed_with_the_event_id(receiver: Receiver) -> None:
    event_id, sent = body()
    Transport(receiver.url_base + PATH_SECRET, SECRET, 2.0).deliver(event_id, sent)
    [got] = receiver.deliveries
    assert got.event_id == event_id and got.body == sent and got.path == PATH_SECRET
    assert got.signature_ok(SECRET.encode())
    unsigned_id, unsigned = body("unsigned")
    Transport(receiver.url_base + "/hook", None, 2.0).deliver(unsigned_id, unsigned)
    assert receiver.deliveries[-1].signature is None


@pytest.mark.parametrize("status", [200, 202, 204])
def test_every_2xx_is_delivered(receiver: Receiver, status: int) -> None:
    receiver.mode, receiver.answer_status = "answer", status
    Transport(receiver.url_base + "/hook", SECRET, 2.0).deliver(*body())
    assert receiver.requests_total == 1


ANSWERS = [(400, False), (404, False), (410, False), (408, True), (429, True), (500, True), (503, True)]


@pytest.mark.parametrize(("status", "transport"), ANSWERS)
def test_an_error_answer_rejects_the_item_unless_the_receiver_is_unwell(
    receiver: Receiver, status: int, transport: bool
) -> None:
    receiver.mode, receiver.answer_status = "answer", status
    err = failure(Transport(receiver.url_base + "/hook", SECRET, 2.0))
    assert err.transport is transport and str(err) == f"answered HTTP {status}"


def test_a_redirect_is_an_item_failure_and_not_followed(receiver: Receiver) -> None:
    other = Receiver(host="127.0.0.2").start()
    try:
        receiver.mode, receiver.redirect_to = "redirect", other.url_base + "/stolen?token=abc"
        err = failure(Transport(receiver.url_base + PATH_SECRET, SECRET, 2.0))
    finally:
        other.stop()
    assert err.transport is False and other.requests_total == 0
    assert str(err) == f"answered 302 (a redirect to {other.url_base}; not followed: fix webhook_url)"


def test_no_receiver_garbage_and_silence_are_transport_failures(receiver: Receiver) -> None:
    url = receiver.url_base + "/hook"
    receiver.stop()  # the port now refuses
    refused = failure(Transport(url, SECRET, 2.0))
    assert refused.transport is True and "ConnectionRefusedError" in str(refused)
    garbage = GarbageServer()
    try:
        not_http = failure(Transport(f"http://127.0.0.1:{garbage.port}/hook", SECRET, 2.0))
    finally:
        garbage.close()
    assert not_http.transport is True and "BadStatusLine" in str(not_http)
    receiver.start()
    receiver.mode = "hang"
    silent = failure(Transport(url, SECRET, 0.3))
    assert silent.transport is True and str(silent) == "timed out: no complete answer within 0.3 s"


def test_scrub_removes_the_url_its_parts_and_the_secret() -> None:
    url = "https://user:hunter2@hooks.example" + PATH_SECRET + "?token=qs-secret"
    transport = Transport(url, SECRET, 2.0)
    assert transport.target == "https://hooks.example"
    text = transport.scrub(f"POST {url} failed; path {PATH_SECRET}, token=qs-secret, key {SECRET}, pw hunter2\r\nX")
    for secret in ("XyZsecretPathToken", "qs-secret", SECRET, "hunter2", "\r", "\n"):
        assert secret not in text, text
    assert len(transport.scrub("x" * 1000)) == 300


@pytest.mark.parametrize("url", ["ftp://hooks.example/x", "http:///no-host", "hooks.example/hook"])
def test_a_url_that_is_not_http_with_a_host_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="webhook_url must be an http:// or https:// URL with a host"):
        Transport(url, None, 1.0)


def test_one_rejected_alert_holds_up_none_of_the_others(tmp_path: Path, receiver: Receiver) -> None:
    """Through the worker: the receiver answers 400 to one alert, forever; the others all go out meanwhile and the
    rejected one stays spooled, retried on its own backoff."""
    logs: list[str] = []
    box = Outbox(
        tmp_path / "outbox",
        receiver.url_base + "/hook",
        SECRET,
        timeout_s=2.0,
        backoff_min_s=0.05,
        backoff_max_s=0.2,
        log=lambda _level, line: logs.append(line),
    )
    payloads = [alert_payload(make_event(EventKind.KILL, f"kill {i}", node="spark-a")) for i in range(5)]
    rejected = str(payloads[0]["id"])  # the oldest: first in line
    receiver.reject_ids.add(rejected)
    box.start()
    try:
        for payload in payloads:
            box.submit(payload)
        assert wait_until(lambda: box.delivered_total == 4 and box.failed_attempts_total >= 3)
        assert sorted(receiver.ids()) == sorted(str(p["id"]) for p in payloads[1:])
        assert box.pending == 1 and [p.name for p in (tmp_path / "outbox").glob("*.json")] == [f"{rejected}.json"]
    finally:
        box.stop()
    assert any("answered HTTP 400" in line for line in logs), logs
