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
from sparkwatch.common.sources.enginetrees import EngineFinder
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.common.sources.procs import holds_gpu_device
from sparkwatch.core.launch.settle import SettleParams, SettleState, describe, is_orphan_worker, settle_step
from sparkwatch.core.model import EngineTree, Proc

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings


def still_letting_go(procs: tuple[Proc, ...], trees: list[EngineTree], proc_root: str) -> int:
    """Engine processes still handing memory back: exiting ones, and orphaned workers holding the GPU."""
    by_pid = {p.pid: p for p in procs}
    count = 0
    for tree in trees:
        for p in tree.members:
            if p.exiting:
                count += 1
                continue
            parent = by_pid.get(p.ppid)
            orphan = p is tree.root and is_orphan_worker(p.display_name, p.ppid, parent.comm if parent else None)
            if orphan and holds_gpu_device(proc_root, p.pid):
                count += 1
    return count


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
