"""MemAvailable sampled every 2 ms on a thread of its own: what the guard benches hold a kill against (how far under or
above the floor the pool went, and the fill rate just before). One sampler for every bench; it reads meminfo through
the same kept-open reader as the guard."""

from __future__ import annotations

import threading
import time

from sparkwatch.common.sources.meminfo import MeminfoReader

SAMPLE_EVERY_S = 0.002


class Sampler(threading.Thread):
    """`samples`: (monotonic seconds, MemAvailable bytes), oldest first; `low`: the lowest MemAvailable seen."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.reader = MeminfoReader()
        self.samples: list[tuple[float, int]] = []
        self.low: int | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                available = self.reader.read().available_bytes
                self.samples.append((time.monotonic(), available))
                self.low = available if self.low is None else min(self.low, available)
                time.sleep(SAMPLE_EVERY_S)
        finally:
            self.reader.close()
