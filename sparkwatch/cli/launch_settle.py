"""`sparkwatch launch`'s first step: wait while the pool is still being handed back (core.launch.settle decides).

Waited for: engine processes exiting (PF_EXITING: a SIGKILLed engine unmaps tens of GiB for seconds), engine workers
orphaned by their engine and still holding the GPU (an NVIDIA device open), a rising MemAvailable and a falling
Shmem. Engines that run steadily are no reason to wait: the plan counts them. Any user's engines count (a root-owned
engine holds the same unified pool); nothing is signalled. After the timeout the plan runs anyway and names what is
still held.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from sparkwatch.cli.wait_settled import DEFAULT_INTERVAL_S, ProgressLine
from sparkwatch.common.sources.enginetrees import EngineFinder, still_letting_go
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.core.launch.settle import SettleParams, SettleState, SettleVerdict, describe, settle_step

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings


def settle(settings: Settings, timeout_s: float, quiet: bool = False) -> bool:
    """Wait up to `timeout_s`; True when settled. Progress on stderr (one line a change)."""
    finder = EngineFinder.from_settings(settings, settings.proc_root, any_user=True)
    params = SettleParams()
    progress = ProgressLine(sys.stderr, quiet=quiet)
    start = time.monotonic()
    deadline = start + timeout_s
    state = SettleState()
    waited = False
    with MeminfoReader(settings.proc_root) as reader:
        while True:
            now = time.monotonic()
            procs, trees = finder.scan()
            held = still_letting_go(procs, trees, str(settings.proc_root))
            try:
                mem = reader.read()
            except MeminfoError as exc:
                progress.finish(f"sparkwatch: {exc}")
                return False
            state, verdict = settle_step(state, params, now, held, mem.available_bytes, shmem_bytes=mem.shmem_bytes)
            # Nothing to wait for from the first look on: start now (the quiet window is for after a teardown).
            if held == 0 and verdict.recent_rise_bytes <= params.tolerance_bytes and not waited:
                if now - start >= min(1.0, timeout_s) or verdict.settled:
                    return True
            elif held or verdict.recent_rise_bytes > params.tolerance_bytes:
                waited = True
            if verdict.settled:
                progress.finish(f"sparkwatch: {describe(verdict, params)} (waited {now - start:.1f} s)")
                return True
            if now >= deadline:
                progress.finish(f"sparkwatch: still settling after {timeout_s:g} s: {describe(verdict, params)}")
                return False
            if not waited:
                time.sleep(max(min(DEFAULT_INTERVAL_S, deadline - now), 0.0))
                continue
            text = describe(verdict, params).replace("engine process", "exiting engine process")
            progress.update(f"sparkwatch: settling {now - start:.0f}s: {text}", (held, waited), now)
            time.sleep(max(min(DEFAULT_INTERVAL_S, deadline - now), 0.0))


def settle_nodes(settings: Settings, timeout_s: float, quiet: bool = False) -> bool:
    """For an engine that spans nodes: wait up to `timeout_s` while any other node's pool is still being handed back,
    as its agent (`peers`) says: engine processes exiting or orphaned workers holding its GPU, MemAvailable rising,
    Shmem falling (the same rule, core.launch.settle, over the agent's last cycle). True when every node that answers
    has settled; a node whose agent does not answer is not waited for (the plan says its share is not checked)."""
    from sparkwatch.telemetry.peerwatch import PeerWatch

    watch = PeerWatch(settings, lambda event: None)
    params = SettleParams()
    progress = ProgressLine(sys.stderr, quiet=quiet)
    start = time.monotonic()
    deadline = start + timeout_s
    states: dict[str, SettleState] = {}
    waited = False
    while True:
        now = time.monotonic()
        watch.poll_once()
        pending: list[tuple[str, SettleVerdict]] = []
        busy = False
        for peer in watch.peers:
            mem = peer.doc.memory if peer.doc is not None else None
            if peer.doc is None or mem is None:
                continue
            state, verdict = settle_step(states.get(peer.label, SettleState()), params, now, mem.letting_go,
                                         mem.available_bytes, shmem_bytes=mem.shmem_bytes)  # fmt: skip
            states[peer.label] = state
            busy = busy or bool(mem.letting_go) or verdict.recent_rise_bytes > params.tolerance_bytes
            if not verdict.settled:
                pending.append((peer.doc.node, verdict))
        waited = waited or busy
        if not waited:  # nothing handed back anywhere from the first looks on: go (the quiet window is for after)
            if now - start >= min(1.0, timeout_s) or not pending:
                return True
        elif not pending:
            progress.finish(f"sparkwatch: the other nodes settled (waited {now - start:.1f} s)")
            return True
        if now >= deadline:
            node, verdict = pending[0]
            progress.finish(f"sparkwatch: {node} still settling after {timeout_s:g} s: {describe(verdict, params)}")
            return False
        if waited:
            node, verdict = pending[0]
            text = describe(verdict, params).replace("engine process", "exiting engine process")
            progress.update(f"sparkwatch: settling on {node} {now - start:.0f}s: {text}", (node, waited), now)
        time.sleep(max(min(DEFAULT_INTERVAL_S, deadline - time.monotonic()), 0.0))
