"""The serving probe: is each engine serving, not just up? A one-token completion on a schedule, on a thread of its own.

The telemetry loop hands over the engine trees it found each cycle (`observe`, a reference swap: no I/O on the loop's
thread) and takes back the last states for the Snapshot (metrics `sparkwatch_engine_serving`, the probe's latency,
`status`). This thread sends the probes, one at a time, each within `probe_timeout_s`, so a wedged engine costs this
thread its timeout and never the loop a cycle (core.engines.serving has the schedule and what a result means).

Before each probe the engine must own the port: a listening socket on it that one of the tree's processes holds open
(telemetry/sources/listeners.py); otherwise nothing is sent (another process's server on that port is never asked).
The probe connects to that socket's own address (a wildcard on loopback). An engine in another network namespace
than ours (a container on a bridge network) is dialled at its own address there, at its own port, and the request is
sent only once its namespace shows our connection (listeners.dial_of, listeners.landed): our loopback is not its,
and `-p 8001:8000` puts another engine, or nothing, at our port 8000. One it cannot reach for certain (loopback
inside its namespace, no link of ours to its address, a first connection that failed or landed elsewhere) is
`not_probed` with the reason, never failing nor wedged. After a connection once landed there, a later connection
that fails counts as a failed probe, as on loopback. The key, where the engine's command line or its environment
names one, is read right before the probe and put in one header: never in a record, an event, a metric or a log
line.

Busy is not wedged (core.engines.progress): after a failed probe, and only then, this thread reads the engine's own
progress counters (`GET /metrics` on the same socket, telemetry/sources/enginecounters.py). Counters that moved since
the last look make it busy: the failure does not count. A failure counts toward a wedge when they did not move, or
could not be read, or the engine serves none.

Events: `engine_wedged` once an engine failed `probe_failures_wedged` probes in a row while its process lives, and
`engine_serving_again` with the next good one (or once its counters move again: busy). With `kill_wedged_after_s`
set, each probe of an engine wedged at least that long whose counters the same probe's look found unmoved hands the
guard its pid and start time and the stalled counter (common.messages.WedgedMsg): the guard checks it again and kills
through its one kill path, trigger `wedged`. An engine that serves no progress counters is never handed over: a wedge
cannot be told from busy there; one log line says so, once per engine, and its `engine_wedged` event, its status row
and `sparkwatch_engine_progress_counters` 0 say it too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparkwatch.common import logs
from sparkwatch.common.eventlog import make_event
from sparkwatch.common.sources.environ import read_environ
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.engines import serving as core
from sparkwatch.core.engines.progress import stall_words
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.launch.bootphase import BOOTING
from sparkwatch.core.model import BootState, EngineServing, EngineTree, Event

if TYPE_CHECKING:
    from sparkwatch.telemetry.sources.listeners import Dial

log = logs.get("telemetry")
TARGETS_MAX = 64  # engines probed: a box runs a handful
_BOOTING = frozenset(str(p) for p in BOOTING)


@dataclass(frozen=True, slots=True)
class Target:
    kind: str
    root_pid: int
    start_ticks: int
    argv: tuple[str, ...]
    pids: tuple[int, ...]
    endpoint: core.Endpoint
    booting: bool


@dataclass(frozen=True, slots=True)
class Wedged:
    """What the guard is handed for `kill_wedged_after_s`."""

    kind: str
    root_pid: int
    start_ticks: int
    wedged_for_s: float
    failures: int
    error: str
    counter: str  # the engine's progress counter that did not move (core.engines.progress), and its value
    counter_value: float


def targets_of(trees: tuple[EngineTree, ...], boots: tuple[BootState, ...]) -> dict[tuple[int, int], Target]:
    """The engines to probe: each tree whose root's command line names an endpoint, or whose launch gave one."""
    by_root = {b.root_pid: b for b in boots}
    out: dict[tuple[int, int], Target] = {}
    for tree in trees:
        boot = by_root.get(tree.root.pid)
        endpoint = None
        if boot is not None and boot.probe_url:
            endpoint = core.endpoint_of_url(boot.probe_url)
        if endpoint is None:
            endpoint = core.endpoint_of(tree.root.argv)
        if endpoint is None:
            continue
        booting = boot is not None and boot.phase in _BOOTING
        out[tree.root.key] = Target(
            tree.kind, tree.root.pid, tree.root.start_ticks, tree.root.argv, tree.pids, endpoint, booting
        )
        if len(out) >= TARGETS_MAX:
            break
    return out


class ProbeWatch:
    def __init__(
        self,
        proc_root: str,
        params: core.ServingParams,
        *,
        kill_wedged_after_s: float = 0.0,
        on_event: Callable[[Event], None] | None = None,
        on_wedged: Callable[[Wedged], None] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`params.interval_s` 0: no probe at all. `on_event`: engine_wedged / engine_serving_again (called on this
        thread). `on_wedged`: the guard's hand-over, each probe of an engine wedged at least `kill_wedged_after_s`."""
        self.proc_root = proc_root
        self.params = params
        self.kill_wedged_after_s = kill_wedged_after_s
        self.on_event = on_event
        self.on_wedged = on_wedged
        self.wall_clock = wall_clock
        self._targets: dict[tuple[int, int], Target] = {}
        self._tracks: dict[tuple[int, int], core.ServingTrack] = {}
        self.states: tuple[EngineServing, ...] = ()  # published by a reference swap
        self.probes_total = 0
        self.counter_reads_total = 0  # reads of the engines' progress counters (one after each failed probe)
        self.errors_total = 0
        self._told_uncounted: set[tuple[int, int]] = set()  # engines whose lack of counters was logged
        # Engines in another network namespace: the address a connection of ours was seen landing in theirs (after
        # that, a connection that fails there is the engine's failure), and the address each was last dialled at.
        self._proven: dict[tuple[int, int], str] = {}
        self._dialled: dict[tuple[int, int], str] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def counters(self) -> dict[str, int]:
        """Errors it survived, for sparkwatch_internal_errors_total{component="probe"} (a failed probe is the
        engine's, not sparkwatch's: it is in sparkwatch_engine_probe_failures)."""
        return {"errors": self.errors_total}

    def configure(self, params: core.ServingParams, kill_wedged_after_s: float) -> None:
        self.params, self.kill_wedged_after_s = params, kill_wedged_after_s
        self._wake.set()

    def observe(self, trees: tuple[EngineTree, ...], boots: tuple[BootState, ...]) -> tuple[EngineServing, ...]:
        """The engines of this cycle (no I/O); returns the states as last probed, of engines still here."""
        if self.params.interval_s <= 0:
            self._targets = {}
            return ()
        targets = targets_of(trees, boots)
        new = any(key not in self._targets for key in targets)
        self._targets = targets
        if targets and self._thread is None:
            self._thread = daemon_thread(self._run, "sparkwatch-probe")
            self._thread.start()
        elif new:
            self._wake.set()
        return tuple(s for s in self.states if any(s.root_pid == k[0] for k in targets))

    def settle(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) for the engines of the last `observe` to have been probed once: a one-shot view
        (`status --once`) shows their word. True when each has a state."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            probed = {s.root_pid for s in self.states}
            if all(key[0] in probed for key in self._targets):
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            # A probe in flight ends at its own deadline; the thread is a daemon thread: stopping never waits for it.
            self._thread.join(1.0)
            self._thread = None

    # --- the thread
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                wait = self.round()
            except Exception as exc:  # a bug: counted and survived, the next round comes
                self.errors_total += 1
                log.error("serving probe failed: %s: %s", type(exc).__name__, exc)
                wait = self.params.retry_s
            self._wake.wait(max(min(wait, self.params.interval_s or 1.0), 0.05))
            self._wake.clear()

    def round(self) -> float:
        """Probe every engine that is due; returns the seconds until the next one is."""
        targets = self._targets
        for key in [k for k in self._tracks if k not in targets]:
            del self._tracks[key]  # the engine is gone: its track goes with it
        self._told_uncounted &= set(targets)
        for seen in (self._proven, self._dialled):
            for key in [k for k in seen if k not in targets]:
                del seen[key]
        for key, target in targets.items():
            if self._stop.is_set():
                break
            track = self._tracks.get(key, core.ServingTrack())
            if track.next_due > time.monotonic():
                continue
            result, dial, secret = self._probe(target)
            self.probes_total += result.outcome not in (core.Outcome.NOT_LISTENING, core.Outcome.NOT_PROBED)
            counters = None
            if result.outcome == core.Outcome.FAILED and dial is not None and not target.booting:
                # Busy or wedged? Its own counters tell (core.engines.progress); read only after a failed probe, on the
                # socket the probe dialled.
                from sparkwatch.telemetry.sources.enginecounters import read_counters  # noqa: PLC0415

                counters = read_counters(
                    dial.host,
                    dial.port,
                    prefix=target.endpoint.prefix,
                    key=secret,
                    timeout_s=self.params.timeout_s,
                )
                self.counter_reads_total += 1
            track, change = core.step(
                track, result, time.monotonic(), self.params, booting=target.booting, counters=counters
            )
            self._tracks[key] = track
            if change is not None:
                self._event(target, track, change)
            self._hand_over(target, track)
        self._publish()
        now = time.monotonic()
        dues = [t.next_due - now for k, t in self._tracks.items() if k in self._targets]
        return min(dues) if dues else self.params.interval_s

    def probe(self, target: Target) -> core.ProbeResult:
        """One probe of one engine, if it owns its port; never raises for what the engine or the network does."""
        return self._probe(target)[0]

    def _probe(self, target: Target) -> tuple[core.ProbeResult, Dial | None, str | None]:
        """The probe's result, the socket it dialled (None: the engine owns none on its port, or it was not probed) and
        the key it sent (for the counters' read right after; never kept). The socket tables' parser and the HTTP
        client are loaded at the first engine to probe: `status` and `engines` on a box without engines load neither."""
        from sparkwatch.telemetry.sources.completion import send_probe  # noqa: PLC0415
        from sparkwatch.telemetry.sources.listeners import Unreachable, dial_of, landing_check  # noqa: PLC0415

        ep = target.endpoint
        dial = dial_of(self.proc_root, target.root_pid, target.pids, ep.port)
        if dial is None:
            return core.ProbeResult(core.Outcome.NOT_LISTENING, self.wall_clock()), None, None
        if isinstance(dial, Unreachable):
            return core.ProbeResult(core.Outcome.NOT_PROBED, self.wall_clock(), None, dial.reason), None, None
        key = None
        if ep.server != "url":
            environ = read_environ(self.proc_root, target.root_pid) or {}
            key = core.api_key_of(target.argv, environ, ep.server)
        check = None
        tree = (target.root_pid, target.start_ticks)
        if dial.netns_pid:
            self._dialled[tree] = dial.address
            check = landing_check(self.proc_root, dial)
        answer = send_probe(
            dial.host, dial.port, prefix=ep.prefix, key=key, timeout_s=self.params.timeout_s, check=check
        )
        if dial.netns_pid and answer.connected and answer.outcome != core.Outcome.NOT_PROBED:
            self._proven[tree] = dial.address
        elif dial.netns_pid and not answer.connected and self._proven.get(tree) != dial.address:
            why = (
                f"{dial.address}, its address in its own network namespace (a container's), could not be reached "
                f"from the host ({answer.error})"
            )
            return core.ProbeResult(core.Outcome.NOT_PROBED, self.wall_clock(), None, why), None, None
        result = core.ProbeResult(answer.outcome, self.wall_clock(), answer.latency_s, answer.error)
        return result, (dial if answer.outcome != core.Outcome.NOT_PROBED else None), key

    def _endpoint(self, target: Target) -> str:
        """host:port as its command line names it, or the address it was dialled at in its own network namespace."""
        dialled = self._dialled.get((target.root_pid, target.start_ticks))
        return dialled if dialled is not None else f"{target.endpoint.host}:{target.endpoint.port}"

    def _publish(self) -> None:
        now = self.wall_clock()
        out = []
        for key, target in self._targets.items():
            track = self._tracks.get(key)
            if track is None:
                continue
            out.append(
                EngineServing(
                    kind=target.kind,
                    root_pid=target.root_pid,
                    endpoint=self._endpoint(target),
                    state=str(track.state),
                    failures=track.failures,
                    latency_s=track.last.latency_s if track.last is not None else None,
                    last_ok_ts=track.last_ok_ts,
                    wedged_for_s=core.wedged_for_s(track, now),
                    error=track.last.error if track.last is not None else "",
                    counted=track.counted,
                    running=track.counters.running if track.counters is not None else None,
                    moved=track.moved,
                )
            )
        self.states = tuple(out)

    def _event(self, target: Target, track: core.ServingTrack, change: core.Change) -> None:
        ep = self._endpoint(target)
        fields: dict[str, object] = {
            "engine": target.kind,
            "root_pid": target.root_pid,
            "endpoint": ep,
            "failures": change.failures,
        }
        if change.new == core.Serving.WEDGED:
            kind = EventKind.ENGINE_WEDGED
            summary = (
                f"{target.kind} engine {target.root_pid} is up but not serving: {change.failures} one-token "
                f"completions in a row to {ep} failed ({change.error}) while its process lives"
            )
            if track.uncounted:
                summary += f"; {self._uncounted_words(target)}."
            elif track.counters is not None:
                summary += f", and its own counters did not move ({stall_words(track.counters)})."
            else:
                summary += "; its counters could not be read (/metrics gave no answer): not proven, not killed."
            fields["error"] = change.error
            fields["failing_since"] = change.since_ts
            fields["progress_counter"] = track.counters.lead[0] if track.counters is not None else None
            fields["killable"] = track.killable
        elif change.new == core.Serving.BUSY:
            kind = EventKind.ENGINE_SERVING_AGAIN
            wedged = self.wall_clock() - change.since_ts if change.since_ts is not None else None
            summary = (
                f"{target.kind} engine {target.root_pid} makes progress again: its own counters moved"
                + (f" ({track.moved:.0f})" if track.moved is not None else "")
                + f" though the probe to {ep} still waits ({change.error}): busy, not wedged."
            )
            fields["wedged_s"] = round(wedged, 3) if wedged is not None else None
            fields["busy"] = True
        else:
            kind = EventKind.ENGINE_SERVING_AGAIN
            wedged = self.wall_clock() - change.since_ts if change.since_ts is not None else None
            latency = track.last.latency_s if track.last is not None else None
            took = f" after {wedged:.0f} s wedged" if wedged is not None else ""
            ms = f" in {latency * 1000:.0f} ms" if latency is not None else ""
            summary = f"{target.kind} engine {target.root_pid} serves again: a token from {ep}{ms}{took}."
            fields["wedged_s"] = round(wedged, 3) if wedged is not None else None
            fields["latency_s"] = latency
        if self.on_event is None:
            return
        try:
            self.on_event(make_event(kind, summary, fields))
        except Exception as exc:  # an unwritable event log is counted there
            self.errors_total += 1
            log.error("could not record %s event: %s", kind, exc)

    def _uncounted_words(self, target: Target) -> str:
        return (
            f"engine {target.root_pid} ({target.kind}) serves no progress counters: a wedge cannot be told from "
            "busy, it is never killed as wedged"
        )

    def _hand_over(self, target: Target, track: core.ServingTrack) -> None:
        after = self.kill_wedged_after_s
        if self.on_wedged is None or after <= 0:
            return
        key = (target.root_pid, target.start_ticks)
        if track.uncounted and track.state == core.Serving.WEDGED and key not in self._told_uncounted:
            self._told_uncounted.add(key)  # once per engine: kill_wedged_after_s is refused for it, and why
            log.warning("kill_wedged_after_s refused: %s (no /metrics with them)", self._uncounted_words(target))
        wedged_for = core.wedged_for_s(track, self.wall_clock())
        if not track.killable or track.counters is None or wedged_for is None or wedged_for < after:
            return  # not wedged that long, or its own counters did not prove the stall at this look
        last = track.last.error if track.last is not None else ""
        name, value = track.counters.lead
        self.on_wedged(
            Wedged(
                target.kind,
                target.root_pid,
                target.start_ticks,
                round(wedged_for, 3),
                track.failures,
                last,
                name,
                value,
            )
        )
