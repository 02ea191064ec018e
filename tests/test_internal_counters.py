"""Every internal error counter is exported: walk the components of both processes, give each counter a distinct
value, and find each value in the exposition the telemetry process serves (the guard's reach it over a real
socketpair, as in the daemon)."""

from __future__ import annotations

import os
import re
from collections import deque
from pathlib import Path

import pytest

from sparkwatch.common.channel import Channel, socketpair
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings
from sparkwatch.guard.process import GuardProcess
from sparkwatch.telemetry.exporter.server import render
from sparkwatch.telemetry.remote import RemoteGuard
from sparkwatch.telemetry.telemetryprocess import TelemetryProcess

# Attribute names that count something going wrong (errors, drops, suppressions, stalls, restarts, timeouts).
COUNTER = re.compile(
    r"^[a-z_]*(error|drop|dropped|suppressed|bad|stall|stalls|restart|restarts|fail|failed|timeouts)[a-z_]*_total$"
)


def walk(root: object, depth: int = 3, skip: tuple[type, ...] = ()) -> list[tuple[object, str]]:
    """(object, attribute) for every int counter attribute on sparkwatch objects reachable from root within `depth`
    steps, breadth first: each object is reached at its least depth, whatever order the attributes were set in."""
    seen: set[int] = set()
    out: list[tuple[object, str]] = []
    queue: deque[tuple[object, int]] = deque([(root, 0)])
    while queue:
        obj, level = queue.popleft()
        if (
            id(obj) in seen
            or level > depth
            or not type(obj).__module__.startswith("sparkwatch")
            or isinstance(obj, skip)
        ):
            continue
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None)
        if attrs is None:
            continue
        for name, value in list(attrs.items()):
            if isinstance(value, int) and not isinstance(value, bool) and COUNTER.match(name):
                out.append((obj, name))
            elif isinstance(value, (list, tuple)):
                queue.extend((item, level + 1) for item in value)
            else:
                queue.append((value, level + 1))
    return out


def test_every_internal_counter_reaches_the_exposition(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("SPARKWATCH_")]:
        monkeypatch.delenv(name)
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "JOURNAL_STREAM"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings(
        None,
        {
            "state_dir": tmp_path / "state",
            "root": tmp_path / "root",  # a fixture root: no udev socket, no NVML probe of this machine
            "mlock": False,
            "listen": "127.0.0.1:9",  # never started here
            "webhook_url": "http://127.0.0.1:9/hook",
        },
    )
    guard_end, telemetry_end = (Channel(s) for s in socketpair())
    gp = GuardProcess(guard_config(settings))
    tp = TelemetryProcess(settings, telemetry_end)
    try:
        counters = walk(gp) + walk(tp, skip=(RemoteGuard,))  # RemoteGuard mirrors the guard's: not an owner
        names = {f"{type(obj).__name__}.{name}" for obj, name in counters}
        # The ones the issue names, so a rename cannot make this test vacuous.
        for expected in (
            "TelemetryLoop.errors_total",
            "DriverWatcher.errors_total",
            "Notifier.send_errors_total",
            "JournalSink.send_errors_total",
            "AlertRouter.suppressed_total",
            "GuardStats.meminfo_errors_total",
            "TelemetrySupervisor.restarts_total",
            "EventLog.write_errors_total",
        ):
            assert expected in names, sorted(names)
        values: dict[str, int] = {}
        for i, (obj, name) in enumerate(counters):
            value = 100_003 + 7_919 * i
            setattr(obj, name, value)
            values[f"{type(obj).__name__}.{name}#{i}"] = value
        gp.guard.stats.psi_trigger = True
        # The guard's state crosses a real socketpair, as the supervisor sends it.
        assert guard_end.send(gp.state())
        for msg in telemetry_end.receive(5.0):
            tp.handle(msg)
        tp.loop.run_once()  # what a cycle's snapshot carries (the NVML source's call timeouts) is exported from it
        text = render(tp.registry).decode()
        samples = [line for line in text.splitlines() if line.startswith("sparkwatch_")]
        missing = [
            key for key, value in values.items() if not any(line.endswith(f" {float(value)}") for line in samples)
        ]
        assert not missing, f"counters kept but not exported: {missing}"
        assert "sparkwatch_guard_psi_trigger 1.0" in text
        assert 'sparkwatch_process_resident_bytes{process="guard"}' in text
    finally:
        guard_end.close()
        telemetry_end.close()
        gp.guard.meminfo.close()
        gp.guard.reaper._meminfo.close()
        tp.loop.telemetry.close()
