"""launch's view of an engine's ranks over Ray while it boots (core.launch.rankboot), on a thread of its own: Ray's
state API (`ray_dashboard_url`) every EVERY_S until every rank is ALIVE, the engine answered, or it exited. The
main thread prints what changed (Launch.tick), so that no line of launch's own lands inside one of the engine's."""

from __future__ import annotations

import threading

from sparkwatch.common.sources.procs import read_descendants
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.launch.rankboot import RankView, rank_view


class RankWatch:
    EVERY_S = 2.0

    def __init__(self, dashboard_url: str, proc_root: str, pid: int) -> None:
        self.dashboard_url, self.proc_root, self.pid = dashboard_url, proc_root, pid
        self.latest: RankView | None = None  # swapped whole by the thread, read by the main thread
        self.error: str | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        daemon_thread(self._run, "sparkwatch-ranks").start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from sparkwatch.telemetry.sources.raystate import RayStateError, RayStateSource

        source = RayStateSource(self.dashboard_url)
        try:
            while not self._stop.wait(self.EVERY_S):
                try:
                    state = source.poll()
                except RayStateError as exc:
                    self.error = f"{exc.kind}: {exc}"
                    continue
                self.error = None
                view = rank_view(state, {self.pid, *read_descendants(self.proc_root, [self.pid])})
                self.latest = view
                if view is not None and view.ranks and view.alive == len(view.ranks):
                    return  # all up: the group watch (telemetry) follows it from here
        finally:
            source.close()
