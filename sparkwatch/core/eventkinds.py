"""Every kind of event sparkwatch records: the one list, typed, so a misspelt kind is a mypy error, not a lost alert.

The values are the `kind` field of events.jsonl, the journal's SPARKWATCH_EVENT field and the webhook body: a contract
(docs/contract.md). Add a kind here first; `core.report.alerts` says whether and how often it alerts.
"""

from __future__ import annotations

from enum import StrEnum


class EventKind(StrEnum):
    # The guard
    KILL = "kill"  # engine trees SIGKILLed below the floor
    WOULD_KILL = "would_kill"  # dry run: the same decision as a kill, and nothing was signalled
    NO_VICTIM = "no_victim"  # the guard fired and found no engine it may kill
    KILL_CANCELLED = "kill_cancelled"  # memory recovered between the decision and the signal: nothing was signalled
    KILL_LOOP = "kill_loop"  # the same engine was killed again and again (a supervisor restarts it into the spike)
    GROUP_TEARDOWN = "group_teardown"  # a group spanning nodes lost a member: this node stopped its members of it
    # The other nodes' agents (config `peers`)
    PEER_LOST = "peer_lost"  # a peer that answered stopped answering: what it last said
    PEER_BACK = "peer_back"  # a lost peer answers again
    # The driver (drift between the running kernel, the next boot and the NVIDIA packages)
    DRIVER_STRANDED = "driver_stranded"
    DRIVER_WILL_STRAND = "driver_will_strand"
    DRIVER_VERSION_MISMATCH = "driver_version_mismatch"
    DRIVER_NOT_LOADED = "driver_not_loaded"
    DRIVER_RECOVERED = "driver_recovered"
    # The kernel log (NVRM and Xid lines)
    XID = "xid"
    DRIVER_ALLOC_FAILED = "driver_alloc_failed"
    # Memory and the boot
    LOW_HEADROOM = "low_headroom"
    COMPILE_BURST = "compile_burst"
    MAX_JOBS_MISSING = "max_jobs_missing"
    JIT_STALLED = "jit_stalled"
    JIT_STATE = "jit_state"
    # Launched engines (sparkwatch launch declares them; the guard records what it sees) and their budgets
    ENGINE_STARTED = "engine_started"
    ENGINE_READY = "engine_ready"
    ENGINE_EXITED = "engine_exited"
    # The serving probe (telemetry/probewatch.py): up but not serving, and back
    ENGINE_WEDGED = "engine_wedged"  # failures_wedged one-token completions in a row failed while the process lives
    ENGINE_SERVING_AGAIN = "engine_serving_again"  # the next good completion after engine_wedged
    BUDGET_NEAR = "budget_near"  # a tree's footprint reached 90 % of its budget (once, until it falls under 80 %)
    PREVIOUS_BOOT = (
        "previous_boot"  # how the previous boot ended (core.postmortem.verdict), judged once per boot at start
    )
    # Engines in containers: a restart policy starting a container again after the guard killed its engine
    # (telemetry/afterkill.py, config container_after_kill, label io.sparkwatch.after-kill; docs/containers.md)
    CONTAINER_GATED = "container_gated"  # restarted after a guard kill: paused until the pool has settled and it fits
    CONTAINER_RELEASED = "container_released"  # a gated container unpaused (by sparkwatch, or by its owner)
    CONTAINER_STOPPED = "container_stopped"  # its restart after a guard kill cancelled through the API's kill
    CONTAINER_ALLOWED = "container_allowed"  # its restart after a guard kill let run (after-kill allow)
    CONTAINER_KILL_LOOP = "container_kill_loop"  # killed twice within the loop window: stopped, whatever its policy
    # sparkwatch itself
    OUTBOX_DROPPED = "outbox_dropped"  # the alert outbox hit its cap and dropped its oldest alerts
    OUTBOX_QUARANTINED = "outbox_quarantined"  # an unreadable spool file was moved to outbox/bad/
    COMPONENT_RESTARTED = "component_restarted"  # a supervised part (telemetry) died and was restarted
