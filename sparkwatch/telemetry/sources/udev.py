"""Kernel uevents for the NVIDIA driver: a module loaded or removed, an nvidia device bound or gone.

The driver check runs every minute; a uevent makes it run at once, so a driver that an apt run removes is reported
seconds later. We listen to the kernel's netlink group rather than udevd's: it needs no udevd (so it works in
containers and on boxes where udevd is restarting during an upgrade) and arrives first; the driver check only needs
"something changed", not udev's processed properties. Unprivileged processes may join that group; only the kernel
(and CAP_NET_ADMIN) may send to it, and a message from any sender but the kernel (netlink port 0) is dropped.

The socket is the standard library's (AF_NETLINK, NETLINK_KOBJECT_UEVENT) and the message is the kernel's own
format (lib/kobject_uevent.c: `ACTION@DEVPATH`, then `KEY=VALUE` strings, each NUL-terminated). This was pyudev over
libudev, which for the same socket cost telemetry 0.8 MiB resident (its modules, datetime, which they load, and
libudev) on the H200 host (bench/RESULTS-rss-gpu.md).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
from collections.abc import Callable, Mapping

from sparkwatch.common import logs
from sparkwatch.common.threads import daemon_thread

DRIVER_ACTIONS = frozenset({"add", "remove", "bind", "unbind", "change"})
NETLINK_KOBJECT_UEVENT = 15  # include/uapi/linux/netlink.h
KERNEL_GROUP = 1  # the kernel's uevents; udevd re-sends its processed ones on group 2
RECV_BUFFER_BYTES = 1 << 20  # a burst of uevents (a module load binds many devices) waits here
MESSAGE_MAX_BYTES = 16384  # a uevent is at most a few KiB (UEVENT_BUFFER_SIZE, 2048 for its variables)

log = logs.get("udev")


def is_driver_uevent(action: str | None, subsystem: str | None, sys_name: str | None, driver: str | None) -> bool:
    """Whether a uevent concerns the NVIDIA driver: modules nvidia*, nvidia* subsystems, devices bound to nvidia."""
    if action not in DRIVER_ACTIONS:
        return False
    if subsystem == "module":
        return (sys_name or "").startswith("nvidia")
    return "nvidia" in (subsystem or "") or (driver or "").startswith("nvidia")


Matcher = Callable[[str | None, str | None, str | None, str | None], bool]


def parse_uevent(message: bytes) -> Mapping[str, str] | None:
    """A kernel uevent's variables (ACTION, DEVPATH, SUBSYSTEM, DRIVER, …); None for anything not shaped as one (a
    udevd message starts `libudev`; a torn one has no `@` header)."""
    head, _, rest = message.partition(b"\0")
    if b"@" not in head or head.startswith(b"libudev"):
        return None
    fields: dict[str, str] = {}
    for item in rest.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            fields[key.decode("ascii", "replace")] = value.decode("utf-8", "replace")
    return fields if "ACTION" in fields and "DEVPATH" in fields else None


def open_uevent_socket() -> socket.socket:
    """The kernel uevent group, non-blocking; raises OSError where netlink is not allowed (the daemon then runs on
    its 1-minute timer alone)."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_KOBJECT_UEVENT)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER_BYTES)
        sock.bind((0, KERNEL_GROUP))  # port 0: the kernel picks ours
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


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
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.events_total = 0
        self.matched_total = 0
        self.errors_total = 0

    def start(self) -> None:
        """Raises if no netlink socket can be opened (the daemon logs it and runs on the 1-minute timer alone)."""
        self._sock = open_uevent_socket()
        self._thread = daemon_thread(self._run, "sparkwatch-udev", self._sock)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()

    def handle(self, action: str | None, subsystem: str | None, sys_name: str | None, driver: str | None) -> bool:
        """The handler for one uevent (the thread calls it; tests may too). True when it triggered a check."""
        self.events_total += 1
        if not self.matcher(action, subsystem, sys_name, driver):
            return False
        self.matched_total += 1
        self._poke(f"uevent {action} {subsystem}/{sys_name}")
        return True

    def _poke(self, description: str) -> None:
        try:
            self.on_event(description)
        except Exception as exc:
            self.errors_total += 1
            log.error("ERROR uevent handler: %s", exc)

    def _run(self, sock: socket.socket) -> None:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            ready = {fd for fd, _ in poller.poll()}  # stop() wakes it through the pipe: no periodic wake-up
            if sock.fileno() in ready:
                self._drain(sock)

    def _drain(self, sock: socket.socket) -> None:
        while True:
            try:
                message, (sender, _groups) = sock.recvfrom(MESSAGE_MAX_BYTES)
            except BlockingIOError:
                return
            except OSError as exc:
                self.errors_total += 1
                log.warning("WARNING reading uevents: %s", exc)
                if exc.errno == errno.ENOBUFS:  # some were lost: one of them may have been the driver's
                    self._poke("uevents lost (receive buffer full)")
                return
            fields = parse_uevent(message) if sender == 0 else None  # only the kernel speaks on this group
            if fields is None:
                continue
            self.handle(
                fields["ACTION"],
                fields.get("SUBSYSTEM"),
                fields["DEVPATH"].rsplit("/", 1)[-1],
                fields.get("DRIVER"),
            )
