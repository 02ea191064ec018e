"""What `sparkwatch launch` checks of a Ray cluster before an engine over it starts (issue 30; docs/launch.md):

- the raylets, held to what the engine's ranks need (core.launch.rayletenv): this node's (those in launch's own
  network namespace) as telemetry.sources.rayletfacts reads them, and the other nodes' as their agents (`peers`)
  say (telemetry.peerdoc);
- the placement groups the new engine would wait behind (core.launch.stalepg), from Ray's state API
  (`ray_dashboard_url`), and with `--fix` their removal through Ray (the helper the group watch uses).
Read once, before the start.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sparkwatch.common.sources.procs import ProcParseError, ProcScanner
from sparkwatch.core.launch.rayletenv import (
    Problem,
    RayletFacts,
    check,
    check_driver,
    fabric_settings,
    fix_line,
    mine,
)
from sparkwatch.core.launch.stalepg import StaleGroup, stale_groups
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.sources.rayletfacts import local_facts
from sparkwatch.telemetry.sources.raylets import LocalRaylet, local_raylets
from sparkwatch.telemetry.sources.raystate import RayStateError, RayStateSource, cluster_owner, start_remove_pg

if TYPE_CHECKING:
    from sparkwatch.cli.peerread import PeerReading
    from sparkwatch.config.settings import Settings

REMOVE_TIMEOUT_S = 30.0  # the helper connects as a Ray driver: 2-3 s on the 2-core test box
GONE_WAIT_S = 10.0  # after the removal, how long Ray may take to list the group REMOVED


def read_peers(settings: Settings) -> list[PeerReading]:
    """One read of each peer's agent (`peers`), at most a second each and all at once (cli.peerread): what launch
    checks of the other nodes (their raylets, their pools) comes from this one read."""
    from sparkwatch.cli.peerread import read_peers as read

    return read(settings)


# Where a raylet was seen: HERE (this node's /proc) or the label of the peer whose agent named it.
RayletCheck = tuple[str, RayletFacts, tuple[Problem, ...], str | None]  # where, raylet, what it lacks, its fix
HERE = ""


def problems(settings: Settings, jobs: int, peers: list[PeerReading]) -> list[RayletCheck]:
    """Each raylet of the cluster that launch can see and that runs as the launching user (this node's, from /proc;
    the peers', from their agents: telemetry.peerdoc; core.launch.rayletenv.mine), where it was seen, what it lacks
    for an engine that may run `jobs` compile jobs, and the line that fixes it. A peer that did not answer adds none
    (its node's raylets are then unchecked, and a line says so)."""
    seen = [(HERE, r) for r in local_facts(Path(settings.proc_root), Path(settings.root))]
    for peer in peers:
        if peer.doc is None:
            print(f"sparkwatch: peer {peer.label}: no answer ({peer.error}): its raylets are not checked",
                  file=sys.stderr)  # fmt: skip
            continue
        seen += [(peer.label, peerdoc.raylet_facts(r)) for r in peer.doc.raylets]
    out: list[RayletCheck] = []
    uid = os.geteuid()
    for where, raylet in seen:
        if not mine([raylet], uid):  # another user's process named raylet is not the cluster
            continue
        found = check(raylet, jobs)
        out.append((where, raylet, found, fix_line(raylet, found, jobs) if found else None))
    return out


def serve_command(env: Mapping[str, str], raylets: list[RayletCheck]) -> tuple[tuple[Problem, ...], str | None]:
    """What the serve command's environment (`env`, launch's own) lacks to join the ranks' collectives from this
    node's address (core.launch.rayletenv.check_driver, against this node's raylet), and the line that fixes it."""
    local = [r for where, r, _lacks, _fix in raylets if where == HERE]
    if not local:
        return (), None
    lacks = check_driver(env, local[0])
    if not lacks:
        return (), None
    settings = " ".join(fabric_settings(local[0], {p.variable for p in lacks}))
    return lacks, f"on {local[0].node}: {settings} sparkwatch launch …"


def stale(settings: Settings) -> tuple[tuple[StaleGroup, ...], str | None]:
    """The placement groups a new engine would wait behind, and None; or () and why Ray's state could not be read
    (no dashboard: not checked, said once, never a refusal). Only a dashboard of the launching user's own cluster on
    this node (raystate.cluster_owner) is read: another user's port is not this launch's Ray, and another host's
    answers are display-only (`--fix` would remove groups on their word): launch on the head node checks them."""
    owner, why = cluster_owner(settings.ray_dashboard_url, settings.proc_root)
    if owner is not None and owner != os.geteuid():
        why = f"served by uid {owner}, not yours"
    if why is not None:
        return (), f"Ray's state API at {settings.ray_dashboard_url}: not read: {why}"
    source = RayStateSource(settings.ray_dashboard_url)
    try:
        state = source.poll()
    except RayStateError as exc:
        return (), f"Ray's state API at {settings.ray_dashboard_url}: {exc.kind}: {exc}"
    finally:
        source.close()
    scanner = ProcScanner(Path(settings.proc_root))
    stopped = set()
    for job in state.jobs:
        if job.driver_pid is None:
            continue
        try:
            proc = scanner.read_proc(job.driver_pid)
        except (ProcParseError, ValueError):
            continue
        if proc is not None and proc.state in ("T", "t"):
            stopped.add(job.driver_pid)
    return stale_groups(state, stopped), None


def remove(
    settings: Settings, groups: tuple[StaleGroup, ...]
) -> tuple[list[str], tuple[tuple[StaleGroup, ...], str | None]]:
    """Remove these groups through Ray (a helper in the local raylet's interpreter, one at a time, each at most
    REMOVE_TIMEOUT_S), then wait until Ray no longer lists them held: one line per group, and what `stale` said
    last (the groups still held, and why none could be read, if so). The helper acts as the invoking user, through
    that user's own raylet only (raystate.start_remove_pg)."""
    proc_root = Path(settings.proc_root)
    raylet: LocalRaylet | None = next(
        (
            r
            for r in local_raylets(ProcScanner(proc_root).scan().procs, proc_root)
            if r.uid == os.geteuid() and r.python and r.gcs_address
        ),
        None,
    )
    if raylet is None:
        why = "not removed: no raylet of yours on this node names an interpreter"
        return [f"{g.group[:12]}: {why}" for g in groups], (groups, None)
    out = []
    for group in groups:
        try:
            helper = start_remove_pg(raylet, group.group, proc_root)
        except OSError as exc:
            out.append(f"{group.group[:12]}: not removed: {raylet.python}: {exc.strerror or exc}")
            continue
        try:
            rc = helper.wait(REMOVE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()
            rc = None
        failed = "timed out" if rc is None else f"exited {rc}"
        out.append(
            f"placement group {group.group[:12]} removed" if rc == 0 else f"{group.group[:12]}: not removed: {failed}"
        )
    deadline = time.monotonic() + GONE_WAIT_S
    while True:
        left = stale(settings)
        if not {g.group for g in left[0]} & {g.group for g in groups} or time.monotonic() >= deadline:
            return out, left
        time.sleep(0.2)
