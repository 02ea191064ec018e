"""Group teardown, the guard's half: telemetry says a group spanning nodes lost a member and names this node's
members of it (common.messages.GroupTeardownMsg); the guard checks each one itself and kills those that pass.

Telemetry's word is a reason to look, never a reason to kill. A member is signalled only when, in the guard's own
reads of /proc:
- it is alive with the pid and start time telemetry named (a reused pid is never hit);
- it runs in the guard's own network namespace (this node: on a Spark that is the host's; in the two-node test each
  node is one);
- it has its role's shape (core.raygroup.member_shape: `ray::<Actor>` for a rank, `VLLM::EngineCore` for a driver,
  `vllm serve` for the API server), and the guard's own rules let it be touched (core.engines.may_touch: its uid,
  never a protected or system process, never the guard's ancestors).
The members that pass are one tree for guard.killer.Killer (pin by pidfd, SIGSTOP, sweep children, SIGKILL), and one
`group_teardown` event says the group, the cause, and the node and pid of the first death.

Runs on the supervisor's thread (it receives the message); a kill takes milliseconds and never waits for the exits.
TODO(killpath): hand the tree to guard.killpath.KillPath once it takes a request that is not about memory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from sparkwatch.common import logs
from sparkwatch.common.events import EventLog, EventLogError, make_event
from sparkwatch.common.guardconfig import GuardSnapshot
from sparkwatch.common.messages import GroupTeardownMsg
from sparkwatch.common.sources.procs import ProcParseError, ProcScanner
from sparkwatch.core import raygroup
from sparkwatch.core.engines import may_touch
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.guard.killer import Killer

log = logs.get("groupwatch")
ROLES = (raygroup.API, raygroup.DRIVER, raygroup.RANK)  # the tree's order: the API server first (it is the root)


class GroupWatch:
    def __init__(self, snapshot: Callable[[], GuardSnapshot], events: EventLog) -> None:
        """`snapshot`: the guard's config snapshot now (the pool watch's, swapped whole on SIGHUP): the rules, scope
        and dry_run of each teardown are those in force when it comes."""
        self.snapshot = snapshot
        self.events = events
        first = snapshot()
        self.proc_root = first.config.proc_root
        self.rules = first.rules
        self.scope = first.scope
        self.scanner = ProcScanner(first.config.proc_root)
        self.killer = Killer(first.config.proc_root, first.rules, first.scope)  # its own: on the supervisor's thread
        self.teardowns_total = 0
        self.refused_total = 0  # members telemetry named that the guard's own checks refused
        self.errors_total = 0

    def counters(self) -> dict[str, int]:
        return {"teardowns": self.teardowns_total, "refused": self.refused_total, "errors": self.errors_total}

    def verified(self, msg: GroupTeardownMsg) -> list[tuple[Proc, str]]:
        """The named members that pass the guard's own checks, with their roles."""
        try:
            own_ns = os.readlink(f"{self.proc_root}/self/ns/net")
        except OSError:
            self.errors_total += 1
            return []
        out = []
        for pid, start_ticks, role in msg.members:
            proc = self._read(pid)
            ok = (
                proc is not None
                and proc.start_ticks == start_ticks
                and self._netns(pid) == own_ns
                and raygroup.member_shape(role, proc.argv)
                and may_touch(proc, self.rules, self.scope)
            )
            if proc is not None and ok:
                out.append((proc, role))
            else:
                self.refused_total += 1
        return out

    def handle(self, msg: GroupTeardownMsg) -> int:
        """Kill this node's verified members of the group; returns how many were signalled."""
        snap = self.snapshot()
        self.rules, self.scope = snap.rules, snap.scope
        members = self.verified(msg)
        if not members:
            return 0
        members.sort(key=lambda m: ROLES.index(m[1]) if m[1] in ROLES else len(ROLES))
        procs = tuple(p for p, _role in members)
        tree = EngineTree(kind="ray-group", root=procs[0], members=procs)
        dry_run = snap.config.dry_run
        victims, _signaled_at, notes, method = self.killer.kill(
            [tree], dry_run=dry_run, rules=self.rules, scope=self.scope
        )
        if not dry_run:
            for v in victims:
                os.close(v.pidfd)
        if not victims:
            return 0
        self.teardowns_total += 1
        roles = {p.pid: role for p, role in members}
        latency = round(time.time() - msg.detected_ts, 3) if msg.detected_ts else None
        summary = (
            f"group {msg.group[:12]}: {msg.cause} on {msg.first_node} (pid {msg.first_pid}); "
            f"{'would stop' if dry_run else 'stopped'} {len(victims)} local member(s): "
            + ", ".join(f"{roles.get(v.proc.pid, 'child')} {v.proc.pid}" for v in victims)
        )
        fields: dict[str, object] = {
            "group": msg.group,
            "cause": msg.cause,
            "first_node": msg.first_node,
            "first_pid": msg.first_pid,
            "members": [{"pid": v.proc.pid, "role": roles.get(v.proc.pid, "child")} for v in victims],
            "method": method,
            "dry_run": dry_run,
            "detected_ts": msg.detected_ts or None,  # wall clock: when telemetry saw the death in Ray's state
            "since_detected_s": latency,
        }
        if notes:
            fields["notes"] = notes
        log.warning("%s", summary)
        try:
            self.events.append(make_event(EventKind.GROUP_TEARDOWN, summary, fields))
        except EventLogError as exc:
            self.errors_total += 1
            log.error("could not record group_teardown event: %s", exc)
        return len(victims)

    def _read(self, pid: int) -> Proc | None:
        try:
            return self.scanner.read_proc(pid)
        except (ProcParseError, ValueError):
            self.errors_total += 1
            return None

    def _netns(self, pid: int) -> str | None:
        try:
            return os.readlink(f"{self.proc_root}/{pid}/ns/net")
        except OSError:
            return None
