"""End to end: a real `sparkwatch run` on a stranded fixture root, a real receiver that answers 500, goes down,
comes back, while sparkwatch restarts in between. Every alert arrives (at least once), signed, ids unique."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.report.alerts import is_alerting
from tests import driverroot as fx
from tests.receiver import Receiver, wait_until

SECRET = "e2e-hmac-secret"
PATH_SECRET = "/services/T0E2E/B0E2E/e2eSecretPathToken"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Sparkwatch:
    """`sparkwatch run` as a subprocess; always SIGTERMed and reaped by the fixture."""

    def __init__(self, config: Path, log: Path) -> None:
        self.config = config
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        env["XDG_CONFIG_HOME"] = str(self.config.parent / "xdg")
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sparkwatch", "run", "--config", str(self.config)],
                stdout=fh,
                stderr=fh,
                env=env,
            )

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(20)
        self.proc = None
        return code

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[fx.DriverRoot, Sparkwatch, Receiver, Path]]:
    receiver = Receiver().start()
    receiver.mode = "500"
    root = fx.stranded_after_update(tmp_path / "root")
    root.write()
    state = tmp_path / "state"
    config = tmp_path / "sparkwatch.toml"
    config.write_text(
        f'root = "{root.path}"\n'
        f'state_dir = "{state}"\n'
        f'webhook_url = "{receiver.url_base}{PATH_SECRET}"\n'
        f'webhook_secret = "{SECRET}"\n'
        "webhook_timeout_s = 1.0\n"
        "webhook_backoff_min_s = 0.05\n"
        "webhook_backoff_max_s = 0.3\n"
        "driver_check_interval_s = 0.2\n"
        "dry_run = true\n"  # the guard runs too: it must never signal anything in a test
        "mlock = false\n"
        "postmortem = false\n"  # the previous boot's verdict would be a fifth alert (tests/test_postmortem.py has it)
        'floor = "1GiB"\n'
        'warn_headroom = "1MiB"\n'
        f"ancestor_pid = {os.getpid()}\n"
        f'listen = "127.0.0.1:{free_port()}"\n'
    )
    daemon = Sparkwatch(config, tmp_path / "sparkwatch.log")
    try:
        yield root, daemon, receiver, state
    finally:
        daemon.kill()
        receiver.stop()


def alert_events(state: Path, kind: str | None = None) -> list[dict[str, object]]:
    return [
        e
        for e in read_events(state / "events.jsonl")
        if is_alerting(cast(EventKind, str(e["kind"]))) and kind in (None, e["kind"])
    ]


def set_stranded(root: fx.DriverRoot, stranded: bool) -> None:
    """Stranded: the running kernel's module file is gone and so is the driver. Recovered: both are back."""
    module = root.path / "lib/modules" / fx.OLD_KERNEL / "kernel/nvidia-580-open/nvidia.ko.zst"
    version = root.path / "proc/driver/nvidia/version"
    if stranded:
        module.unlink()
        version.unlink()
    else:
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 60)
        version.parent.mkdir(parents=True, exist_ok=True)
        version.write_text(fx.NVRM_OPEN.format(v=fx.DRIVER))


def test_every_alert_arrives_across_500s_outage_and_restart(
    setup: tuple[fx.DriverRoot, Sparkwatch, Receiver, Path],
) -> None:
    root, daemon, receiver, state = setup
    daemon.start()
    # 1. stranded: one alert for the episode, however many checks run (5 per second here)
    assert wait_until(lambda: len(alert_events(state, "driver_stranded")) == 1, timeout_s=15)
    time.sleep(1.0)
    assert len(alert_events(state, "driver_stranded")) == 1
    # 2. the module comes back: one recovery; it goes again: a new episode, a new alert
    set_stranded(root, False)
    assert wait_until(lambda: len(alert_events(state, "driver_recovered")) == 1)
    set_stranded(root, True)
    assert wait_until(lambda: len(alert_events(state, "driver_stranded")) == 2)
    # the receiver answered 500 to all of it: three alerts spooled on disk, none delivered
    assert wait_until(lambda: len(list((state / "outbox").glob("*.json"))) == 3)
    assert receiver.ids() == [] and receiver.requests_total >= 3
    # 3. the receiver goes down entirely, and sparkwatch restarts meanwhile
    receiver.stop()
    time.sleep(0.5)
    assert daemon.stop() == 0
    assert len(list((state / "outbox").glob("*.json"))) == 3
    daemon.start()
    time.sleep(1.5)  # still stranded after the restart: the episode was persisted, no second page
    assert len(alert_events(state, "driver_stranded")) == 2
    # 4. the receiver comes back (same port): the backlog goes out; a recovery after that too
    receiver.mode = "ok"
    receiver.start()
    set_stranded(root, False)
    assert wait_until(lambda: len(alert_events(state, "driver_recovered")) == 2)
    expected = {str(e["id"]) for e in alert_events(state)}
    assert len(expected) == len(alert_events(state)) == 4  # ids unique: stranded, recovered, stranded, recovered
    assert wait_until(lambda: expected <= set(receiver.ids()), timeout_s=15), (expected, receiver.ids())
    # Delivered is not yet acknowledged: a receiver that took an alert but answered after the 1 s timeout (CI's two
    # loaded cores) gets it again (at least once, the same id), and its file stays until then. The outbox drains.
    outbox = state / "outbox"
    assert wait_until(lambda: list(outbox.glob("*.json")) == [], timeout_s=15), list(outbox.glob("*.json"))
    assert daemon.stop() == 0
    # every delivery signed with the secret, payload = the event plus a Slack `text`
    for d in receiver.deliveries:
        assert d.signature_ok(SECRET.encode())
        assert d.payload["id"] == d.event_id and isinstance(d.payload["text"], str)
        assert d.path == PATH_SECRET
    assert list(outbox.glob("*.json")) == []
    events_by_id = {str(e["id"]): e for e in alert_events(state)}
    for d in receiver.deliveries:
        body = dict(d.payload)
        body.pop("text")
        assert body == json.loads(json.dumps(events_by_id[d.event_id]))
    log = daemon.log.read_text()
    assert "driver stranded" in log
    for secret in ("e2eSecretPathToken", SECRET, "/services/"):
        assert secret not in log
