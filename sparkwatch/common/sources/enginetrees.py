"""The engine trees on this node now: one /proc scan through ProcScanner, judged by core.engines.identity.

Commands that look repeatedly (`wait-settled`, `status`) keep one finder so the scanner's argv cache is reused
between scans; one-shot commands (`engines`) build one and call it once.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from pathlib import Path

from sparkwatch.common.enginerules import EngineSettings, engine_rules, engine_scope
from sparkwatch.common.launched import Declaration, LaunchedWatch
from sparkwatch.common.sources.procs import ProcScanner, holds_gpu_device
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.launch.settle import is_orphan_worker
from sparkwatch.core.model import EngineTree, Proc

# Process states that hold nothing any more: a zombie has already closed its files (the GPU driver's included) and
# dropped its memory; only its parent's wait() is missing. Counting it as "left" could wait forever on a careless
# parent.
GONE_STATES = frozenset({"Z", "X"})


class EngineFinder:
    def __init__(
        self, proc_root: Path, rules: EngineRules, scope: Scope, launched: LaunchedWatch | None = None
    ) -> None:
        self.rules = rules
        self.scope = scope
        self.scanner = ProcScanner(proc_root)
        # Engines `sparkwatch launch` declared (common.launched): engines here as they are for the guard.
        self.launched = launched
        self.declarations: tuple[Declaration, ...] = ()

    @classmethod
    def from_settings(cls, settings: EngineSettings, proc_root: Path, *, any_user: bool = False) -> EngineFinder:
        """The guard's view (`any_user=False`: only what this user may kill), or every user's engines.

        Read-only commands that ask "is the pool still held?" pass any_user=True: a root-owned engine in a Docker
        container holds the same unified pool as one of ours.
        """
        state_dir = getattr(settings, "state_dir", None)
        watch = LaunchedWatch.of(os.environ, state_dir, proc_root) if isinstance(state_dir, Path) else None
        return cls(proc_root, engine_rules(settings), engine_scope(settings, any_user=any_user), watch)

    def find(self) -> list[EngineTree]:
        return self.scan()[1]

    def scan(self, gpu_holders: Collection[tuple[int, int]] = ()) -> tuple[tuple[Proc, ...], list[EngineTree]]:
        """The process table and the engine trees in it (gpu_holders: see core.engines.identity.find_engine_trees)."""
        procs = self.scanner.scan().procs
        self.declarations = self.launched.poll() if self.launched is not None else ()
        live = [d for d in self.declarations if d.exited_at is None]
        declared = {d.tree_key: (d.kind, d.uid) for d in live}
        launchers = {d.tree_key: d.launcher_pid for d in live}
        return procs, find_engine_trees(
            procs, self.rules, self.scope, gpu_holders, declared=declared, launchers=launchers
        )


def live_processes(trees: list[EngineTree]) -> list[Proc]:
    """The engine-tree processes still alive, roots first (zombies excluded: see GONE_STATES)."""
    return [p for t in trees for p in t.members if p.state not in GONE_STATES]


def still_letting_go(procs: Sequence[Proc], trees: Sequence[EngineTree], proc_root: str) -> int:
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
