"""The killer against real process trees shaped like engines. Every signal goes to processes this test started."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner, read_start_ticks
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees
from sparkwatch.core.kill.killrecord import KillFacts
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, MemInfo
from sparkwatch.guard.killer import Killer, KillJob, Reaper, find_cgroup2_mount
from tests.conftest import Spawner, alive, pids_in, require_tool, wait_until

RULES = EngineRules.build()
MEM = MemInfo(
    total_bytes=1 << 34,
    available_bytes=1 << 30,
    free_bytes=1 << 30,
    buffers_bytes=0,
    cached_bytes=0,
    swap_total_bytes=0,
    swap_free_bytes=0,
)


def scope() -> Scope:
    # Only engines below this test process: another test run on the box can never be a candidate.
    return Scope(self_pid=os.getpid(), own_uid=os.geteuid(), ancestor_pid=os.getpid())


def trees_now() -> list[EngineTree]:
    return find_engine_trees(ProcScanner().scan().procs, RULES, scope())


def kill_and_reap(trees: list[EngineTree], dry_run: bool = False) -> tuple[KillFacts, list[str], str]:
    killer = Killer(Path("/proc"), RULES, scope())
    detected = time.monotonic()
    victims, signaled_at, notes, method = killer.kill(trees, dry_run=dry_run)
    facts = KillFacts(
        trigger=Trigger.FLOOR,
        mem=MEM,
        floor_bytes=1 << 31,
        fill_rate_bytes_per_s=0.0,
        dry_run=dry_run,
        trees=tuple(trees),
        victims=tuple((v.proc, v.engine) for v in victims),
        method=method,
    )
    reaper = Reaper(Path("/proc"), announce=lambda job: None, finish=lambda job, facts: None, settle_s=0.05)
    job = KillJob(
        facts=facts,
        victims=victims,
        detected_at=detected,
        signaled_at=signaled_at,
        available_at_signal=MEM.available_bytes,
        notes=notes,
    )
    return reaper.reap(job), notes, method


def test_whole_vllm_tree_dies_even_ignoring_sigterm_and_forking(spawner: Spawner, tmp_path: Path) -> None:
    pidfile = tmp_path / "tree.pids"
    root = spawner.engine(
        "--worker",
        "VLLM::Worker_TP0",
        "--worker",
        "VLLM::Worker_TP1",
        "--compiler",
        "--forker",
        "--ignore-term",
        pidfile=pidfile,
        wait_for=9,
    )
    assert wait_until(lambda: sum(r == "leaf" for _, r in pids_in(pidfile).values()) >= 5)
    trees = trees_now()
    assert [t.root.pid for t in trees] == [root.pid]
    assert trees[0].kind == "vllm"
    facts, _notes, method = kill_and_reap(trees)
    assert method.endswith("pidfd")
    # Everything recorded, including leaves forked after the scan, is gone.
    recorded = pids_in(pidfile)
    survivors = [pid for pid, (ticks, _) in recorded.items() if alive(pid, ticks)]
    assert survivors == []
    assert facts.survivors == ()
    assert facts.signal_to_reaped_ms is not None and facts.signal_to_reaped_ms < 5000
    assert facts.detect_to_signal_ms is not None and facts.detect_to_signal_ms < 1000


def test_decoys_and_protected_processes_survive(spawner: Spawner, tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO vllm serve started\n")
    script = tmp_path / "serve_vllm.sh"
    script.write_text("vllm serve meta-llama/Llama-3.1-8B\n")
    sshd = tmp_path / "sshd"
    shutil.copy("/bin/sleep", sshd)  # comm is taken from the executable: this process *is* named sshd
    decoys = [
        spawner.popen(["tail", "-f", str(log)], stdout=subprocess.DEVNULL),
        spawner.popen(["bash", "-c", "sleep 600 # vllm serve --model x", "vllm serve"]),
        spawner.popen(["grep", "-q", "vllm", "/dev/stdin"], stdin=subprocess.PIPE),
        spawner.popen([sys.executable, "-c", "import time; time.sleep(600)", "vllm", "serve"]),
        spawner.popen(["sh", "-c", "sleep 600; true", "VLLM::EngineCore"]),
        spawner.popen(["vim", "-u", "NONE", str(script)])
        if shutil.which("vim")
        else spawner.popen(["less", str(script)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL),
    ]
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=2)
    root_pid = next(pid for pid, (_t, role) in pids_in(pidfile).items() if role == "root")
    protected_child = spawner.popen([str(sshd), "600"])  # not in the tree: a sibling
    time.sleep(0.3)
    trees = trees_now()
    assert [t.root.pid for t in trees] == [root_pid]
    member_pids = set(trees[0].pids)
    for decoy in [*decoys, protected_child]:
        assert decoy.pid not in member_pids
    kill_and_reap(trees)
    assert wait_until(lambda: not alive(root_pid))
    for decoy in [*decoys, protected_child]:
        assert decoy.poll() is None, f"decoy {decoy.args!r} was killed"


def test_protection_inside_an_engine_tree_is_by_executable_not_by_name(spawner: Spawner, tmp_path: Path) -> None:
    """A real tmux server (/usr/bin/tmux, in the foreground with -D) that an engine started survives the kill; a copy
    of sleep named tmux and a worker that titles itself `tmux: server` are the engine's and die with it."""
    tmux = require_tool("tmux")
    fake_tmux = tmp_path / "tmux"
    shutil.copy("/bin/sleep", fake_tmux)
    sock = f"sparkwatch-test-{os.getpid()}"
    engine = spawner.popen(
        [
            sys.executable,
            "-c",
            "import setproctitle, subprocess, sys, time;"
            "setproctitle.setproctitle('VLLM::EngineCore');"
            f"subprocess.Popen([{tmux!r}, '-D', '-L', {sock!r}], stdin=subprocess.DEVNULL,"
            " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
            f"subprocess.Popen([{str(fake_tmux)!r}, '600']);"
            "subprocess.Popen([sys.executable, '-c', 'import setproctitle, time;"
            ' setproctitle.setproctitle("tmux: server"); time.sleep(600)\']);'
            "time.sleep(600)",
        ]
    )

    def children() -> dict[str, int]:
        return {
            ("real" if p.exe == os.path.realpath(tmux) else p.argv[0]): p.pid
            for p in ProcScanner().scan().procs
            if p.ppid == engine.pid
        }

    assert wait_until(lambda: {"real", str(fake_tmux), "tmux: server"} <= set(children()), 20), children()
    kids = children()
    tree = next(t for t in trees_now() if t.root.pid == engine.pid)
    assert set(tree.pids) == {engine.pid, kids[str(fake_tmux)], kids["tmux: server"]}
    real_ticks = read_start_ticks("/proc", kids["real"])
    kill_and_reap([tree])
    assert wait_until(lambda: engine.poll() is not None)
    assert wait_until(lambda: not alive(kids["tmux: server"]) and not alive(kids[str(fake_tmux)]))
    assert alive(kids["real"], real_ticks)
    os.kill(kids["real"], signal.SIGKILL)  # ours: the test started it through the engine


def test_reused_pid_is_never_signalled(spawner: Spawner) -> None:
    """The scan saw pid P with start time T; by the kill, P belongs to another process. It must survive."""
    bystander = spawner.popen(["sleep", "600"])
    time.sleep(0.05)
    ticks = read_start_ticks("/proc", bystander.pid)
    assert ticks is not None
    engine = spawner.popen(
        [
            sys.executable,
            "-c",
            "import setproctitle, time;setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(600)",
        ]
    )
    assert wait_until(lambda: any(t.root.pid == engine.pid for t in trees_now()))
    tree = next(t for t in trees_now() if t.root.pid == engine.pid)
    stale = replace(tree.root, pid=bystander.pid, start_ticks=ticks - 1)  # what an old scan would have said
    doctored = EngineTree(kind="vllm", root=tree.root, members=(tree.root, stale))
    facts, _, _ = kill_and_reap([doctored])
    assert engine.wait(5) == -signal.SIGKILL
    assert bystander.poll() is None
    assert bystander.pid not in [p.pid for p, _ in facts.victims]


def test_dry_run_signals_nothing(spawner: Spawner, tmp_path: Path) -> None:
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--worker", "VLLM::Worker_TP0", "--compiler", pidfile=pidfile, wait_for=5)
    trees = trees_now()
    assert trees
    facts, _, method = kill_and_reap(trees, dry_run=True)
    assert method == "dry-run"
    assert facts.signal_to_reaped_ms is None
    time.sleep(0.2)
    for pid, (ticks, _) in pids_in(pidfile).items():
        assert alive(pid, ticks)
        with open(f"/proc/{pid}/stat", "rb") as fh:
            assert fh.read().rsplit(b")", 1)[1].split()[0] != b"T", "dry run must not even stop the tree"


def _cgroup_dir(name: str) -> Path:
    mount = find_cgroup2_mount(Path("/proc"))
    if mount is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v2 hierarchy")
    path = mount / name
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup here: {exc}")
    if not (path / "cgroup.kill").exists():
        path.rmdir()
        pytest.skip("kernel has no cgroup.kill")
    return path


def test_cgroup_kill_when_the_tree_owns_its_cgroup(spawner: Spawner, tmp_path: Path) -> None:
    cg = _cgroup_dir(f"sparkwatch-test-{os.getpid()}-own")
    try:
        # Like `systemd-run --user --scope vllm serve`: the engine starts inside its own cgroup.
        pidfile = tmp_path / "tree.pids"
        starter = spawner.popen(
            [
                "sh",
                "-c",
                f'echo $$ > {cg}/cgroup.procs && exec "$@"',
                "sh",
                sys.executable,
                str(Path(__file__).parent / "helpers" / "fake_engine.py"),
                "--worker",
                "VLLM::Worker_TP0",
                "--compiler",
                "--pidfile",
                str(pidfile),
            ]
        )
        assert wait_until(lambda: pidfile.exists() and len(pids_in(pidfile)) >= 5)
        trees = [t for t in trees_now() if t.root.pid == starter.pid]
        assert trees
        _facts, notes, method = kill_and_reap(trees)
        assert method == "cgroup.kill+pidfd", notes
        assert all(not alive(pid, t) for pid, (t, _) in pids_in(pidfile).items())
    finally:
        wait_until(lambda: not (cg / "cgroup.procs").read_text().strip(), 5)
        cg.rmdir()


def test_no_cgroup_kill_when_the_cgroup_holds_anything_else(spawner: Spawner, tmp_path: Path) -> None:
    cg = _cgroup_dir(f"sparkwatch-test-{os.getpid()}-shared")
    try:
        bystander = spawner.popen(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec sleep 600"])
        pidfile = tmp_path / "tree.pids"
        spawner.popen(
            [
                "sh",
                "-c",
                f'echo $$ > {cg}/cgroup.procs && exec "$@"',
                "sh",
                sys.executable,
                str(Path(__file__).parent / "helpers" / "fake_engine.py"),
                "--pidfile",
                str(pidfile),
            ]
        )
        assert wait_until(lambda: pidfile.exists() and len(pids_in(pidfile)) >= 1)
        trees = trees_now()
        assert trees
        _facts, _notes, method = kill_and_reap(trees)
        assert method == "pidfd"
        assert all(not alive(pid, t) for pid, (t, _) in pids_in(pidfile).items())
        assert bystander.poll() is None
    finally:
        for proc in spawner.procs:
            proc.kill()
            proc.wait(5)
        wait_until(lambda: not (cg / "cgroup.procs").read_text().strip(), 5)
        cg.rmdir()


def test_reaper_reports_a_process_that_does_not_exit(spawner: Spawner) -> None:
    """A victim stuck in D state never becomes readable on its pidfd: the wait gives up, it never hangs."""
    stubborn = spawner.popen(["sleep", "600"])
    fd = os.pidfd_open(stubborn.pid)
    from sparkwatch.guard.killer import Victim

    proc = ProcScanner().read_proc(stubborn.pid)
    assert proc is not None
    victim = Victim(proc=proc, engine="test", pidfd=fd, tree_root=stubborn.pid)
    facts = KillFacts(
        trigger=Trigger.FLOOR,
        mem=MEM,
        floor_bytes=1 << 31,
        fill_rate_bytes_per_s=0.0,
        dry_run=False,
        trees=(),
        victims=(),
    )
    reaper = Reaper(Path("/proc"), announce=lambda job: None, finish=lambda job, facts: None, wait_s=0.3, settle_s=0.05)
    t0 = time.monotonic()
    out = reaper.reap(KillJob(facts, [victim], t0, t0, MEM.available_bytes))  # "signalled", never exits
    assert time.monotonic() - t0 < 1.5
    assert out.survivors == (stubborn.pid,)
    assert out.signal_to_reaped_ms is None
    assert out.available_after_settle_bytes is not None
