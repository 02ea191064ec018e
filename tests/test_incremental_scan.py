"""The telemetry's incremental process table on a fixture /proc: new and hot pids fresh, the rest within a sweep."""

from __future__ import annotations

import shutil
from pathlib import Path

from sparkwatch.common.sources.procs import IncrementalScanner, ProcScanner
from sparkwatch.core.engines.identity import EngineRules, engine_kind
from tests.helpers.proctree import PAGE, FakeProc, write_proc


def set_stat(root: Path, pid: int, comm: str, state: str = "S", rss_pages: int = 1) -> None:
    rest = f"{state} 1 {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 1000 0 {rss_pages} 0 0\n"
    (root / str(pid) / "stat").write_text(f"{pid} ({comm}) {rest}")


def test_incremental_matches_full_scan_and_sees_changes_within_a_sweep(tmp_path: Path) -> None:
    procs = [FakeProc(pid, 1, "bash", ["bash"]) for pid in range(100, 150)]
    root = write_proc(tmp_path / "proc", procs)
    inc = IncrementalScanner(root, slices=5)
    first = {p.pid: p for p in inc.scan().procs}
    assert first == {p.pid: p for p in ProcScanner(root).scan().procs}
    assert inc.reads_last_cycle == 50
    inc.scan()
    assert inc.reads_last_cycle == 10  # one slice of five

    # A process retitles itself (vLLM calls setproctitle after start): seen within one sweep, not at once.
    set_stat(root, 123, "VLLM::EngineCor")
    (root / "123" / "cmdline").write_bytes(b"VLLM::EngineCore\0")
    seen_after = None
    for cycle in range(1, 6):
        table = {p.pid: p for p in inc.scan().procs}
        if table[123].comm == "VLLM::EngineCor":
            seen_after = cycle
            break
    assert seen_after is not None and seen_after <= 5
    assert engine_kind(table[123], EngineRules.build()) == "vllm"

    # A hot pid is re-read every cycle; a new one at once; an exited one is gone at once.
    set_stat(root, 140, "bash", rss_pages=999)
    write_proc(tmp_path / "proc", [FakeProc(777, 1, "nvcc", ["nvcc"])], meminfo="MemTotal: 1 kB\n")
    shutil.rmtree(root / "101")
    table = {p.pid: p for p in inc.scan(hot={140}).procs}
    assert table[140].rss_bytes == 999 * PAGE
    assert table[777].comm == "nvcc"
    assert 101 not in table


def test_kind_cache_follows_a_new_title() -> None:
    from sparkwatch.core.model import Proc

    rules = EngineRules.build()
    before = Proc(5, 1, 0, "python3", "S", 1, 0, ("python3", "-c", "pass"))
    after = Proc(5, 1, 0, "VLLM::EngineCor", "S", 1, 0, ("VLLM::EngineCore",))
    assert engine_kind(before, rules) is None
    assert engine_kind(after, rules) == "vllm"  # (comm, argv) is the key: a retitle is a new entry
    assert engine_kind(before, rules) is None
