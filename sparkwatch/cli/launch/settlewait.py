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
from collections.abc import Callable
from typing import TYPE_CHECKING

from sparkwatch.cli.wait_settled import DEFAULT_INTERVAL_S, ProgressLine
from sparkwatch.common.sources.enginetrees import EngineFinder, still_letting_go
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.core.launch.settle import SettleParams, SettleState, SettleVerdict, describe, settle_step

if TYPE_CHECKING:
    from sparkwatch.cli.peerread import PeerReading
    from sparkwatch.config.settings import Settings


# One node's look: its name (THIS_NODE here), its engine processes still letting go, MemAvailable, Shmem.
Look = tuple[str, int, int, int]
THIS_NODE = ""


def settle(settings: Settings, timeout_s: float, quiet: bool = False) -> bool:
    """Wait up to `timeout_s`; True when settled. Progress on stderr (one line a change)."""
    finder = EngineFinder.from_settings(settings, settings.proc_root, any_user=True)
    with MeminfoReader(settings.proc_root) as reader:

        def look() -> list[Look] | str:
            procs, trees = finder.scan()
            held = still_letting_go(procs, trees, str(settings.proc_root))
            try:
                mem = reader.read()
            except MeminfoError as exc:
                return str(exc)
            return [(THIS_NODE, held, mem.available_bytes, mem.shmem_bytes)]

        return _wait(look, timeout_s, quiet)


def settle_nodes(settings: Settings, timeout_s: float, quiet: bool = False) -> list[PeerReading]:
    """For an engine that spans nodes: wait up to `timeout_s` while any other node's pool is still being handed back,
    as its agent (`peers`) says: engine processes exiting or orphaned workers holding its GPU, MemAvailable rising,
    Shmem falling (the same rule, core.launch.settle, over the agent's last cycle). A node whose agent does not
    answer is not waited for (the plan says its share is not checked). Returns the last reading of every peer: the
    plan's read of the other nodes (cli.peerread.read_peers), taken at the end of the wait."""
    from sparkwatch.cli.peerread import PeerReading, read_peers

    last: dict[str, PeerReading] = {}  # each peer's last reading, or the last that took a document

    def look() -> list[Look]:
        for r in read_peers(settings):
            if r.doc is not None or last.get(r.label) is None or last[r.label].doc is None:
                last[r.label] = r
        return [
            (r.doc.node, r.doc.memory.letting_go, r.doc.memory.available_bytes, r.doc.memory.shmem_bytes)
            for r in last.values()
            if r.doc is not None and r.doc.memory is not None
        ]

    _wait(look, timeout_s, quiet)
    return [last.get(p, PeerReading(p, None, "not read")) for p in settings.peers]


def _wait(look: Callable[[], list[Look] | str], timeout_s: float, quiet: bool) -> bool:
    """The one wait, over whatever nodes `look` reports (or the error that ends it): True when all settled. Nothing
    handed back anywhere in the first second: go at once (the quiet window is for after a teardown)."""
    params = SettleParams()
    progress = ProgressLine(sys.stderr, quiet=quiet)
    start = time.monotonic()
    deadline = start + timeout_s
    states: dict[str, SettleState] = {}
    waited = False
    while True:
        now = time.monotonic()
        looked = look()
        if isinstance(looked, str):
            progress.finish(f"sparkwatch: {looked}")
            return False
        pending: list[tuple[str, SettleVerdict]] = []
        settled: list[SettleVerdict] = []
        for node, held, available, shmem in looked:
            states[node], verdict = settle_step(states.get(node, SettleState()), params, now, held, available,
                                                shmem_bytes=shmem)  # fmt: skip
            waited = waited or bool(held) or verdict.recent_rise_bytes > params.tolerance_bytes
            if verdict.settled:
                settled.append(verdict)
            else:
                pending.append((node, verdict))
        if not waited:
            if now - start >= min(1.0, timeout_s) or not pending:
                return True
        elif not pending:
            here = [node for node, *_ in looked] == [THIS_NODE]
            said = describe(settled[0], params) if here else "the other nodes settled"
            progress.finish(f"sparkwatch: {said} (waited {now - start:.1f} s)")
            return True
        if now >= deadline:
            node, verdict = pending[0]
            where = f"{node} " if node else ""
            progress.finish(f"sparkwatch: {where}still settling after {timeout_s:g} s: {describe(verdict, params)}")
            return False
        if waited:
            node, verdict = pending[0]
            where = f" on {node}" if node else ""
            text = describe(verdict, params).replace("engine process", "exiting engine process")
            key = (node, verdict.engine_processes, waited)
            progress.update(f"sparkwatch: settling{where} {now - start:.0f}s: {text}", key, now)
        time.sleep(max(min(DEFAULT_INTERVAL_S, deadline - time.monotonic()), 0.0))
