"""Reading what compilers inherit, from real processes: a retitled engine's environ is unknown, never 'unset'."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sparkwatch.common.sources.procs import ProcScanner, read_start_ticks
from sparkwatch.core.engines.compile import tool_of
from sparkwatch.core.engines.identity import EngineRules
from sparkwatch.core.engines.proctree import tree_rows
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.telemetry.sources.procenv import EnvironReader
from tests.conftest import Spawner, wait_until

CODE = "import setproctitle, sys, time; sys.argv[1:] and setproctitle.setproctitle(sys.argv[1]); time.sleep(600)"


def test_setproctitle_clobbers_environ_so_max_jobs_is_unknown(spawner: Spawner) -> None:
    env = {**os.environ, "MAX_JOBS": "3"}
    plain = spawner.popen([sys.executable, "-c", CODE], env=env)
    titled = spawner.popen([sys.executable, "-c", CODE, "VLLM::EngineCore"], env=env)

    def retitled() -> bool:
        proc = ProcScanner().read_proc(titled.pid)
        assert proc is not None  # was `or plain`: a Popen has no .comm, so a vanished process failed here too
        return proc.comm.startswith("VLLM::")

    assert wait_until(retitled)
    reader = EnvironReader(Path("/proc"), ["MAX_JOBS"])
    assert reader.read(plain.pid, read_start_ticks("/proc", plain.pid) or 0) == {"MAX_JOBS": "3"}
    # setproctitle reuses the environ area for the title: all NULs now. Unknown, not "unset".
    assert reader.read(titled.pid, read_start_ticks("/proc", titled.pid) or 0) is None


def test_zombie_compilers_are_not_counted() -> None:
    live = Proc(pid=10, ppid=1, uid=0, comm="nvcc", state="S", start_ticks=1, rss_bytes=1, argv=("nvcc",))
    zombie = Proc(pid=11, ppid=1, uid=0, comm="nvcc", state="Z", start_ticks=1, rss_bytes=0, argv=())
    assert tool_of(live) == "nvcc"
    assert tool_of(zombie) is None


def test_the_tree_view_and_the_census_share_one_compiler_rule() -> None:
    """A finished nvcc not yet reaped is not a compiler in the census, and not one in `sparkwatch engines` either."""
    root = Proc(
        pid=10, ppid=1, uid=0, comm="VLLM::EngineCor", state="S", start_ticks=1, rss_bytes=1, argv=("VLLM::EngineCore",)
    )
    ninja = Proc(pid=11, ppid=10, uid=0, comm="ninja", state="S", start_ticks=2, rss_bytes=1, argv=("ninja",))
    zombie = Proc(pid=12, ppid=11, uid=0, comm="nvcc", state="Z", start_ticks=3, rss_bytes=0, argv=())
    host = Proc(
        pid=13,
        ppid=11,
        uid=0,
        comm="aarch64-linux-gnu-g++-13"[:15],
        state="R",
        start_ticks=4,
        rss_bytes=1,
        argv=("aarch64-linux-gnu-g++-13",),
    )
    gcc = Proc(pid=14, ppid=11, uid=0, comm="gcc-13", state="R", start_ticks=5, rss_bytes=1, argv=("gcc-13",))
    tree = EngineTree("vllm", root, (root, ninja, zombie, host, gcc))
    roles = {row.proc.pid: row.role for row in tree_rows(tree, EngineRules.build())}
    assert roles == {10: "root", 11: "compiler", 12: "process", 13: "process", 14: "compiler"}
    assert {pid: tool_of(p) is not None for pid, p in ((11, ninja), (12, zombie), (13, host), (14, gcc))} == {
        pid: roles[pid] == "compiler" for pid in (11, 12, 13, 14)
    }
