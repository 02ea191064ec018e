"""launch's own first-token probe: ready comes with the engine's first good one-token completion, not its log line.

It dials the engine where its own processes listen (telemetry.sources.listeners: in a container, at the container's
own address, with the landing check), and sends the probe telemetry sends (telemetry.sources.completion).
"""

from __future__ import annotations

import threading
import time

from sparkwatch.common.sources.procs import read_descendants
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.engines.serving import Endpoint, Outcome
from sparkwatch.telemetry.sources.completion import send_probe
from sparkwatch.telemetry.sources.listeners import Unreachable, dial_of, landing_check


class FirstToken:
    """launch's own probe, on a thread of its own: once a second, while the engine's processes own a listening socket
    on its port, a one-token completion (telemetry/sources/completion.py) until one answers. The key goes in its
    header only; nothing here prints or records it."""

    EVERY_S = 1.0  # a probe a second once the engine listens
    LOOK_EVERY_S = 0.25  # a look for its listening socket until then (a few small /proc reads)
    TIMEOUT_S = 10.0

    def __init__(self, proc_root: str, pid: int, endpoint: Endpoint, key: str | None) -> None:
        self.proc_root, self.pid, self.endpoint, self._key = proc_root, pid, endpoint, key
        self.answered_at: float | None = None  # wall clock
        self.latency_s: float | None = None
        self.probes = 0
        self.listening_seen = False
        self.unreachable = ""  # why its socket cannot be reached from here (a container's, telemetry.sources.listeners)
        self._stop = threading.Event()

    def start(self) -> None:
        daemon_thread(self._run, "sparkwatch-first-token").start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.EVERY_S if self.listening_seen else self.LOOK_EVERY_S):
            pids = read_descendants(self.proc_root, [self.pid])
            dial = dial_of(self.proc_root, self.pid, pids, self.endpoint.port)  # in a container: its own address
            if dial is None:
                continue
            self.listening_seen = True
            if isinstance(dial, Unreachable):
                self.unreachable = dial.reason
                return
            self.probes += 1
            check = landing_check(self.proc_root, dial) if dial.netns_pid else None
            answer = send_probe(
                dial.host, dial.port, prefix=self.endpoint.prefix, key=self._key, timeout_s=self.TIMEOUT_S, check=check
            )
            if answer.outcome == Outcome.OK:
                self.latency_s = answer.latency_s
                self.answered_at = time.time()
                return
