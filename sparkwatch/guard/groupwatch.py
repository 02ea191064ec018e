"""Group teardown, the guard's half: telemetry says a group spanning nodes lost a member and names this node's
members of it (common.messages.GroupTeardownMsg); the guard checks each one itself and kills those that pass.

Telemetry's word is a reason to look, never a reason to kill. A member is signalled only when, in the guard's own
reads of /proc:
- it is alive with the pid and start time telemetry named (a reused pid is never hit);
- it runs in the guard's own network namespace (this node: on a Spark that is the host's; in the two-node test each
  node is one);
- it is the process of the user the group belongs to (the message's `owner_uid`: the uid of the raylets of its Ray
  cluster, or of its members without Ray): a root guard never stops another user's process for a group;
- it has its role's shape (core.kill.raygroup.member_shape: `ray::<Actor>` for a rank, `VLLM::EngineCore` for a driver,
  `vllm serve` for the API server; for a group without Ray, core.kill.mpgroup.member_of: its command line names the
  group's rendezvous; for a process a dead member left behind, an engine's own shape by the guard's engine rules, e.g.
  `VLLM::EngineCore`), and the guard's own rules let it be touched (core.engines.identity.may_touch: its
  uid, never a protected or system process, never the guard's ancestors).
The members that pass are one tree (the API server first), handed to the guard's one kill path as a request
(guard.killpath, trigger `group_teardown`) through the guard's inbox (guard.inbox): the pool watch's next tick, woken
at once, kills it (pin by pidfd, SIGSTOP, sweep children, SIGKILL), counts it and tracks its teardown like any other
kill, and the reaper records one `group_teardown` event: the group, the cause, the node and pid of the first death,
this node's members.

Runs on the supervisor's thread (it receives the message): the checks read a few small /proc files per member.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from sparkwatch.common.guardconfig import GuardSnapshot
from sparkwatch.common.messages import GroupTeardownMsg
from sparkwatch.common.sources.procs import ProcParseError, ProcScanner
from sparkwatch.core.engines.identity import engine_kind, may_touch
from sparkwatch.core.kill import mpgroup, raygroup
from sparkwatch.core.kill.killrecord import GroupLoss
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.guard.killpath import GROUP_COUNTERS, GroupFacts, KillRequest

# the tree's order: the API server first (it is the root); a group without Ray has one member a node, its engine's root
ROLES = (mpgroup.MP_RANK, mpgroup.MP_ORPHAN, raygroup.API, raygroup.DRIVER, raygroup.RANK)
MP_ROLES = frozenset({mpgroup.MP_RANK, mpgroup.MP_ORPHAN})


class GroupWatch:
    def __init__(self, snapshot: Callable[[], GuardSnapshot], submit: Callable[[KillRequest], None]) -> None:
        """`snapshot`: the guard's config snapshot now (the pool watch's, swapped whole on SIGHUP): the rules and scope
        of each check are those in force when it comes. `submit`: hands the checked members to the kill path (the
        guard's inbox, guard.inbox.KillInbox.submit)."""
        self.snapshot = snapshot
        self.submit = submit
        first = snapshot()
        self.proc_root = first.config.proc_root
        self.rules = first.rules
        self.scope = first.scope
        self.scanner = ProcScanner(first.config.proc_root)
        self.teardowns_total = 0  # teardowns handed to the kill path
        self.refused_total = 0  # members telemetry named that the guard's own checks refused
        self.errors_total = 0

    def counters(self) -> dict[str, int]:
        return dict(zip(GROUP_COUNTERS, (self.teardowns_total, self.refused_total, self.errors_total), strict=True))

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
                and msg.owner_uid >= 0
                and proc.uid == msg.owner_uid
                and proc.start_ticks == start_ticks
                and self._netns(pid) == own_ns
                and self._shaped(msg.group, role, proc)
                and may_touch(proc, self.rules, self.scope)
            )
            if proc is not None and ok:
                out.append((proc, role))
            else:
                self.refused_total += 1
        return out

    def handle(self, msg: GroupTeardownMsg) -> int:
        """Check this node's members of the group and hand those that pass to the kill path; returns how many."""
        snap = self.snapshot()
        self.rules, self.scope = snap.rules, snap.scope
        members = self.verified(msg)
        if not members:
            return 0
        members.sort(key=lambda m: ROLES.index(m[1]) if m[1] in ROLES else len(ROLES))
        procs = tuple(p for p, _role in members)
        loss = GroupLoss(
            group=msg.group,
            cause=msg.cause,
            first_node=msg.first_node,
            first_pid=msg.first_pid,
            roles=tuple((p.pid, role) for p, role in members),
            detected_ts=msg.detected_ts,
            peer_word=msg.peer_word,
        )
        kind = "mp-group" if members[0][1] in MP_ROLES else "ray-group"
        target = GroupFacts(EngineTree(kind=kind, root=procs[0], members=procs), loss)
        self.submit(KillRequest(Trigger.GROUP_TEARDOWN, time.monotonic(), target))
        self.teardowns_total += 1
        return len(members)

    def _shaped(self, group: str, role: str, proc: Proc) -> bool:
        """A group without Ray (core.kill.mpgroup): its own command line names the group's rendezvous; what a dead
        member left behind: an engine by its own identity (the guard's engine rules). Ray's: the role's shape
        (core.kill.raygroup.member_shape)."""
        if role == mpgroup.MP_RANK:
            return mpgroup.member_of(group, proc.argv)
        if role == mpgroup.MP_ORPHAN:
            return engine_kind(proc, self.rules) is not None
        return raygroup.member_shape(role, proc.argv)

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
