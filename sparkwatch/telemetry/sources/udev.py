"""Kernel uevents for the NVIDIA driver, through pyudev: a module loaded or removed, an nvidia device bound or gone.

The driver check runs every minute; a uevent makes it run at once, so a driver that an apt run removes is reported
seconds later. We listen to the kernel's netlink group ("kernel" source) rather than udevd's: it needs no udevd (so
it works in containers and on boxes where udevd is restarting during an upgrade) and arrives first; the driver check
only needs "something changed", not udev's processed properties. Unprivileged processes may join that group.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Any

from sparkwatch.common import logs
from sparkwatch.common.threads import daemon_thread

DRIVER_ACTIONS = frozenset({"add", "remove", "bind", "unbind", "change"})

log = logs.get("udev")


def is_driver_uevent(action: str | None, subsystem: str | None, sys_name: str | None, driver: str | None) -> bool:
    """Whether a uevent concerns the NVIDIA driver: modules nvidia*, nvidia* subsystems, devices bound to nvidia."""
    if action not in DRIVER_ACTIONS:
        return False
    if subsystem == "module":
        return (sys_name or "").startswith("nvidia")
    return "nvidia" in (subsystem or "") or (driver or "").startswith("nvidia")


Matcher = Callable[[str | None, str | None, str | None, str | None], bool]


class UdevWatcher:
    """A daemon component: calls `on_event(description)` for every matching uevent, from its own thread.

    `matcher` is replaceable so tests can drive a real netlink monitor with an event this machine can produce.
    """

    def __init__(
        self,
        on_event: Callable[[str], None],
        matcher: Matcher = is_driver_uevent,
    ) -> None:
        self.on_event = on_event
        self.matcher = matcher
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitor: object | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events_total = 0
        self.matched_total = 0
        self.errors_total = 0

    def start(self) -> None:
        """Raises if no netlink monitor can be opened (the daemon logs it and runs on the 1-minute timer alone)."""
        import pyudev  # noqa: PLC0415 - loaded only when the daemon starts the watcher

        monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        monitor.start()
        self._monitor = monitor
        self._thread = daemon_thread(self._run, "sparkwatch-udev", monitor)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5)

    def handle(self, action: str | None, subsystem: str | None, sys_name: str | None, driver: str | None) -> bool:
        """The handler for one uevent (the thread calls it; tests may too). True when it triggered a check."""
        self.events_total += 1
        if not self.matcher(action, subsystem, sys_name, driver):
            return False
        self.matched_total += 1
        try:
            self.on_event(f"uevent {action} {subsystem}/{sys_name}")
        except Exception as exc:
            self.errors_total += 1
            log.error("ERROR uevent handler: %s", exc)
        return True

    def _run(self, monitor: Any) -> None:  # a pyudev.Monitor (pyudev has no type hints)
        fileno = monitor.fileno()
        poller = select.poll()
        poller.register(fileno, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            ready = {fd for fd, _ in poller.poll()}  # stop() wakes it through the pipe: no periodic wake-up
            if fileno not in ready:
                continue
            while True:
                try:
                    device = monitor.poll(timeout=0)
                except Exception as exc:  # a torn netlink message must not end the thread
                    self.errors_total += 1
                    log.warning("WARNING reading uevent: %s", exc)
                    break
                if device is None:
                    break
                self.handle(device.action, device.subsystem, device.sys_name, device.driver)
