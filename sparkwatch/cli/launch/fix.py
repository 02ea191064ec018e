"""`sparkwatch launch --fix`: the fixes that need no guessing, applied where this user may.

- drop_caches: `sync`, then 1 into /proc/sys/vm/drop_caches (the page cache only: clean pages, nothing is lost). It
  turns page cache back into MemFree, which is what cudaMemGetInfo reports on a GB10 (unslothai/unsloth#10704).
- compact: 1 into /proc/sys/vm/compact_memory: the kernel moves pages to make free blocks of high order again, what
  owners ask for before a launch on a fragmented Spark (FujitsuPolycom/sparkring#173).
Both need root. Without it each fix says the command to run, and nothing else is tried.
"""

from __future__ import annotations

import os
from pathlib import Path

from sparkwatch.core.launch.plan import FixAction, Plan

_FILES = {FixAction.DROP_CACHES: "sys/vm/drop_caches", FixAction.COMPACT: "sys/vm/compact_memory"}
_HOW = {
    FixAction.DROP_CACHES: "sudo sh -c 'sync; echo 1 > /proc/sys/vm/drop_caches'",
    FixAction.COMPACT: "sudo sh -c 'echo 1 > /proc/sys/vm/compact_memory'",
}


def apply_fixes(plan: Plan, proc_root: Path) -> list[str]:
    """Apply each automatic fix of the plan; one line per fix saying what was done (or why not)."""
    out = []
    for fix in plan.fixes:
        if not fix.automatic or fix.action not in _FILES:
            continue
        path = proc_root / _FILES[fix.action]
        if fix.action == FixAction.DROP_CACHES:
            os.sync()
        try:
            with open(path, "w", encoding="ascii") as fh:
                fh.write("1\n")
        except OSError as exc:
            out.append(f"{fix.action}: {exc.strerror or exc} ({path}); run: {_HOW[fix.action]}")
            continue
        out.append(f"{fix.action}: wrote 1 to {path}")
    if not out:
        out.append("nothing --fix may apply: the remaining fixes need a choice (see the line below)")
    return out
