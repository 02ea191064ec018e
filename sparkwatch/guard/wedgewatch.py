"""A wedged engine, the guard's half: telemetry's serving probe says an engine has been up but not serving for
`kill_wedged_after_s` (common.messages.WedgedMsg); the guard checks it itself and, if it passes, kills its tree.

Off unless the guard's own `kill_wedged_after_s` is set (0, the default: telemetry's word is only an event). The
message is a reason to look, never a reason to kill. The engine is handed to the one kill path (guard.killpath,
trigger `wedged`) only when, in the guard's own reads of /proc:
- its root is alive with the pid and start time telemetry named (a reused pid is never hit);
- it is the root of an engine tree by the guard's own rules and scope (core.engines.identity: `never_kill`, the
  protected processes, other users' processes and the guard's ancestors stay out), so the whole tree dies with it;
- the wedge telemetry reports is at least the guard's own `kill_wedged_after_s`;
- telemetry names the engine's own progress counter that did not move (core.engines.progress): a word without one is
  a failed probe alone, which a busy engine gives too (six concurrent requests to a batch-1 engine did), and an engine
  that serves no counters is never killed as wedged.
The kill path then does what it does for every kill: pin by pidfd, SIGSTOP, sweep, SIGKILL, count, and one `kill`
event with trigger `wedged` and the reason; a tree already killed in this episode is not signalled twice.

Runs on the supervisor's thread (it receives the message): one /proc scan per message, at most one a probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from sparkwatch.common.guardconfig import GuardSnapshot
from sparkwatch.common.messages import WedgedMsg
from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.engines.identity import Declared, Launchers, find_engine_trees
from sparkwatch.core.engines.progress import PROGRESS_COUNTERS
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.guard.killpath import KillRequest, WedgedFacts

PROGRESS_NAMES = frozenset(name for names in PROGRESS_COUNTERS.values() for name in names)


class WedgeWatch:
    def __init__(
        self,
        snapshot: Callable[[], GuardSnapshot],
        submit: Callable[[KillRequest], None],
        *,
        declared: Callable[[], Declared] | None = None,
        launchers: Callable[[], Launchers] | None = None,
    ) -> None:
        """`snapshot`: the guard's config snapshot now. `submit`: hands the checked tree to the kill path (the
        guard's inbox, guard.inbox.KillInbox.submit). `declared`, `launchers`: the engines `launch` declared, as
        the guard took them (guard.launchwatch): their roots are engine trees here as on the kill path."""
        self.snapshot = snapshot
        self.submit = submit
        self.declared = declared
        self.launchers = launchers
        self.scanner = ProcScanner(snapshot().config.proc_root)
        self.kills_total = 0  # wedged engines handed to the kill path
        self.refused_total = 0  # named engines the guard's own checks refused
        self.off_total = 0  # messages while kill_wedged_after_s is 0 here
        self.errors_total = 0

    def counters(self) -> dict[str, int]:
        return {"kills": self.kills_total, "refused": self.refused_total, "errors": self.errors_total}

    def handle(self, msg: WedgedMsg) -> bool:
        """Check the named engine and hand it to the kill path if it passes; returns whether it was handed over."""
        snap = self.snapshot()
        after = snap.config.kill_wedged_after_s
        if after <= 0:
            self.off_total += 1
            return False
        if msg.wedged_for_s < after or msg.counter not in PROGRESS_NAMES:
            self.refused_total += 1  # not wedged that long, or no counter of its own proved the stall
            return False
        try:
            procs = self.scanner.scan().procs
        except Exception:  # a scan failure is never a reason to kill
            self.errors_total += 1
            return False
        trees = find_engine_trees(
            procs,
            snap.rules,
            snap.scope,
            declared=self.declared() if self.declared is not None else None,
            launchers=self.launchers() if self.launchers is not None else None,
        )
        tree = next(
            (t for t in trees if t.root.pid == msg.root_pid and t.root.start_ticks == msg.start_ticks),
            None,
        )
        if tree is None:
            self.refused_total += 1
            return False
        facts = WedgedFacts(tree, msg.wedged_for_s, msg.failures, msg.error[:200], msg.counter, msg.counter_value)
        self.submit(KillRequest(Trigger.WEDGED, time.monotonic(), facts))
        self.kills_total += 1
        return True
