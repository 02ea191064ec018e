"""An engine tree laid out for people: parent before child, with the drawing and a role for each process.

Roles: `root` (the engine process the tree is named after), `worker` (a member that is itself an engine by identity:
VLLM::Worker_TP0, ray::RayWorkerWrapper), `compiler` (a live process of the JIT burst, by core.engines.compile's one
rule: ninja, nvcc, cicc, ptxas, fatbinary, host compilers) and `process` for anything else (a resource tracker, a shell,
a finished compiler not yet reaped).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkwatch.core.engines.compile import is_compiler
from sparkwatch.core.engines.identity import EngineRules, engine_kind
from sparkwatch.core.enums import ProcRole
from sparkwatch.core.model import EngineTree, Proc


def role_of(proc: Proc, tree: EngineTree, rules: EngineRules) -> ProcRole:
    if proc.pid == tree.root.pid:
        return "root"
    if is_compiler(proc):
        return "compiler"
    if engine_kind(proc, rules) is not None:
        return "worker"
    return "process"


@dataclass(frozen=True, slots=True)
class TreeRow:
    proc: Proc
    depth: int
    prefix: str  # box drawing before the pid: "", "├─ ", "│  └─ "
    role: ProcRole


def tree_rows(tree: EngineTree, rules: EngineRules) -> list[TreeRow]:
    """Depth-first rows, children by pid. Members whose parent is not in the tree hang off the root."""
    pids = set(tree.pids)
    children: dict[int, list[Proc]] = {}
    for proc in tree.members[1:]:
        parent = proc.ppid if proc.ppid in pids and proc.ppid != proc.pid else tree.root.pid
        children.setdefault(parent, []).append(proc)
    rows: list[TreeRow] = []
    seen: set[int] = set()

    def walk(proc: Proc, depth: int, lead: str, last: bool) -> None:
        seen.add(proc.pid)
        branch = "" if depth == 0 else lead + ("└─ " if last else "├─ ")
        rows.append(TreeRow(proc, depth, branch, role_of(proc, tree, rules)))
        kids = [c for c in sorted(children.get(proc.pid, ()), key=lambda c: c.pid) if c.pid not in seen]
        child_lead = "" if depth == 0 else lead + ("   " if last else "│  ")
        for i, kid in enumerate(kids):
            walk(kid, depth + 1, child_lead, i == len(kids) - 1)

    walk(tree.root, 0, "", True)
    return rows
