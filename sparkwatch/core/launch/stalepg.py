"""Placement groups a new engine over Ray would wait behind, left by a run that is over or stuck (issue 30): pure.

"Killed vLLM runs leak placement groups that keep the GPUs reserved, so the next launch hangs on Waiting for
creating a placement group" (vLLM waits up to 1800 s). Ray removes a placement group when the job that made it
ends, so the one that stays is held by a driver that did not end: wedged (stopped, as a SIGSTOP or a debugger leaves
it), or its job dead while Ray still keeps the group (a detached group). A group whose driver runs is another
engine's, and never stale here: launch cannot tell a busy driver from a hung one, and says nothing of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sparkwatch.core.kill.raygroup import RayState

HELD = frozenset({"CREATED", "PENDING", "RESCHEDULING"})  # states in which a group holds or waits for resources


@dataclass(frozen=True, slots=True)
class StaleGroup:
    group: str  # the placement group's id
    state: str
    job_id: str
    driver_pid: int | None
    driver_ip: str
    why: str

    def line(self) -> str:
        driver = f"driver pid {self.driver_pid} on {self.driver_ip}" if self.driver_pid else "no driver"
        return f"placement group {self.group[:12]} ({self.state}, job {self.job_id}, {driver}): {self.why}"


def stale_groups(state: RayState, stopped_drivers: Iterable[int]) -> tuple[StaleGroup, ...]:
    """The groups held (or waiting) for a job whose driver is stopped (`stopped_drivers`: pids this node's /proc
    shows stopped, for drivers on this node) or whose job Ray lists as ended."""
    stopped = frozenset(stopped_drivers)
    jobs = {j.job_id: j for j in state.jobs}
    out = []
    for pg in state.placement_groups:
        if pg.state not in HELD:
            continue
        job = jobs.get(pg.creator_job_id)
        if job is None or not job.running:
            why = "its job has ended"
        elif job.driver_pid is not None and job.driver_pid in stopped:
            why = "its driver is stopped (wedged)"
        else:
            continue
        pid, ip = (job.driver_pid, job.driver_ip) if job is not None else (None, "")
        out.append(StaleGroup(pg.placement_group_id, pg.state, pg.creator_job_id, pid, ip, why))
    return tuple(out)
