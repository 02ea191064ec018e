"""The kill policy end to end: a real `sparkwatch run`, real engine-shaped trees, real memory pressure.

Every floor is set relative to this machine's MemAvailable at the start, and every allocation is bounded by it, so
the tests are safe on a shared box. The guard is confined to this test process's descendants (ancestor_pid).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import cast

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.core.units import GiB, MiB
from tests.conftest import (
    FAKE_ENGINE,
    Spawner,
    alive,
    descendants,
    pids_in,
    require_tool,
    settled_available_bytes,
    wait_until,
)
from tests.daemon import RunningDaemon, sparkwatch_run

HEADROOM_BYTES = int(1.5 * GiB)  # floor = MemAvailable now - this
STEADY_MIB = 256  # what the old serving engine holds, steady


def available_bytes() -> int:
    with MeminfoReader() as reader:
        return reader.read().available_bytes


def floor_or_skip(want_bytes: int = 6 * GiB) -> int:
    available = settled_available_bytes()
    if available < want_bytes:
        pytest.skip(f"only {available >> 20} MiB available; this test wants {want_bytes >> 20} MiB")
    return available - HEADROOM_BYTES


def events(daemon: RunningDaemon, kind: str) -> list[dict[str, object]]:
    return [e for e in read_events(daemon.events_path) if e["kind"] == kind]


def root_of(pidfile: Path) -> tuple[int, int]:
    (root,) = [(pid, ticks) for pid, (ticks, role) in pids_in(pidfile).items() if role == "root"]
    return root


def victim_roots(kills: list[dict[str, object]]) -> list[int]:
    """The root pid of each kill's tree, in the order of the kills (each kill takes exactly one tree)."""
    out = []
    for event in kills:
        ranking = event["ranking"]
        victims = event["victims"]
        assert isinstance(victims, list) and isinstance(ranking, list)
        pids = {v["pid"] for v in victims}
        roots = [r["root_pid"] for r in ranking if r["root_pid"] in pids]
        assert len(roots) == 1, f"one tree per kill, got {roots}"
        out.append(roots[0])
    return out


def steady_engine(spawner: Spawner, tmp_path: Path, name: str) -> Path:
    """An engine that loaded its weights long ago and serves: it holds STEADY_MIB and does not grow."""
    pidfile = tmp_path / f"{name}.pids"
    spawner.engine(
        "--worker",
        "VLLM::Worker_TP0",
        "--hog-rate-mib",
        "2048",
        "--hog-limit-mib",
        str(STEADY_MIB),
        pidfile=pidfile,
        wait_for=3,
    )
    return pidfile


def spiking_engine(spawner: Spawner, tmp_path: Path, name: str, rate_mib: int, limit_mib: int) -> Path:
    """An engine in its start-up spike: its worker allocates at `rate_mib` MiB/s up to `limit_mib`, then holds."""
    pidfile = tmp_path / f"{name}.pids"
    spawner.engine(
        "--worker",
        "VLLM::Worker_TP0",
        "--ignore-term",
        "--hog-rate-mib",
        str(rate_mib),
        "--hog-limit-mib",
        str(limit_mib),
        pidfile=pidfile,
        wait_for=3,
    )
    return pidfile


def tree_alive(pidfile: Path) -> bool:
    return all(alive(pid, ticks) for pid, (ticks, _role) in pids_in(pidfile).items())


def tree_dead(pidfile: Path) -> bool:
    return not any(alive(pid, ticks) for pid, (ticks, _role) in pids_in(pidfile).items())


@pytest.mark.pressure
def test_two_trees_the_spiking_one_dies_the_old_steady_one_lives(spawner: Spawner, tmp_path: Path) -> None:
    floor = floor_or_skip()
    # A small re-arm headroom: memory comes back to about floor + 1.25 GiB here, and the box is shared.
    env = {"SPARKWATCH_FLOOR": f"{floor}B", "SPARKWATCH_REARM_HEADROOM": "256MiB"}
    with sparkwatch_run(tmp_path, env=env) as daemon:
        old = steady_engine(spawner, tmp_path, "old")
        time.sleep(2.5)  # the scout has seen it steady for a few scans
        # 1 GiB past the floor from what is available now: others on the box may have freed memory since the start.
        past_floor = max(HEADROOM_BYTES, available_bytes() - floor) + GiB
        new = spiking_engine(spawner, tmp_path, "new", rate_mib=512, limit_mib=past_floor // MiB)
        assert wait_until(lambda: bool(events(daemon, "kill")), 60)
        assert wait_until(lambda: tree_dead(new), 15)
        assert wait_until(lambda: available_bytes() > floor + 512 * MiB, 15)
        time.sleep(2.5)  # longer than a teardown of this size plus the settle time: no second kill follows
        kills = events(daemon, "kill")
        assert victim_roots(kills) == [root_of(new)[0]]
        assert tree_alive(old)
        (kill,) = kills
        assert kill["victim_rss_bytes"] and int(kill["victim_rss_bytes"]) > 256 * MiB  # type: ignore[call-overload]
        assert kill["mem_available_after_settle_bytes"] is not None
        why = " ".join(kill["why"])  # type: ignore[arg-type]
        assert "grew" in why or "no growth measured yet" in why
        assert wait_until(lambda: any("re-armed" in line for line in daemon.stderr_lines), 10)
        kill_lines = [i for i, line in enumerate(daemon.stderr_lines) if "sparkwatch: KILL vllm tree" in line]
        rearmed = [i for i, line in enumerate(daemon.stderr_lines) if "re-armed" in line]
        assert kill_lines and rearmed and kill_lines[0] < rearmed[0]  # the KILL line first, always


@pytest.fixture
def stress_ng() -> str:
    return require_tool("stress-ng")


def start_stress_ng(spawner: Spawner, binary: str, size_bytes: int) -> subprocess.Popen[bytes]:
    """A real non-engine allocator: one vm worker that touches `size_bytes` once and holds it (--vm-hang 0)."""
    argv = [
        binary,
        "--vm",
        "1",
        "--vm-bytes",
        f"{size_bytes >> 20}M",
        "--vm-keep",
        "--vm-hang",
        "0",
        "--oomable",
        "--timeout",
        "120s",
        "-q",
    ]
    return spawner.popen(argv)


@pytest.mark.pressure
@pytest.mark.parametrize("dry_run", [False, True], ids=["kill", "dry-run"])
def test_memory_still_under_the_floor_kills_the_next_engine_never_the_allocator(
    spawner: Spawner, tmp_path: Path, stress_ng: str, dry_run: bool
) -> None:
    """After the spiking engine dies, stress-ng keeps memory under the floor: the old engine dies next; stress-ng is
    never touched. In dry-run the same plan is recorded in the same order, and nothing is signalled."""
    floor = floor_or_skip(7 * GiB)
    args = ("--dry-run",) if dry_run else ()
    with sparkwatch_run(tmp_path, *args, env={"SPARKWATCH_FLOOR": f"{floor}B"}) as daemon:
        old = steady_engine(spawner, tmp_path, "old")
        time.sleep(2.5)
        new = spiking_engine(spawner, tmp_path, "new", rate_mib=256, limit_mib=1024)
        time.sleep(1.5)  # it grows under the scout's eyes
        # Enough that memory stays 768 MiB under the floor once both engines are gone (they hold 1 GiB + 256 MiB),
        # from what is available now: others on the box may have freed memory since the floor was set.
        engines_hold = (1024 + STEADY_MIB) * MiB
        stress = start_stress_ng(spawner, stress_ng, max(0, available_bytes() - floor) + engines_hold + 768 * MiB)
        kind = "would_kill" if dry_run else "kill"  # a dry run's decisions are never `kill` events
        assert wait_until(lambda: len(events(daemon, kind)) >= 2, 60), daemon.stderr_lines[-20:]
        assert wait_until(lambda: bool(events(daemon, "no_victim")), 15)  # then it keeps looking, finds nothing
        kills = events(daemon, kind)
        assert victim_roots(kills) == [root_of(new)[0], root_of(old)[0]]
        assert [k["dry_run"] for k in kills] == [dry_run, dry_run]
        # The next tree died in the same episode: on the floor after the settle time ("escalate"), or on the
        # allocator's measured fall toward it; never after a re-arm (memory never came back above floor + 1 GiB).
        assert kills[1]["trigger"] in ("escalate", "floor", "predicted")
        assert not any("re-armed" in line for line in daemon.stderr_lines)
        stress_pids = {stress.pid, *descendants(stress.pid)}
        assert len(stress_pids) >= 2 and stress.poll() is None
        for event in kills:
            assert not stress_pids & {v["pid"] for v in cast("list[dict[str, object]]", event["victims"])}
        if dry_run:
            assert tree_alive(old) and tree_alive(new)
            assert sum("DRY-RUN would KILL vllm tree" in line for line in daemon.stderr_lines) == 2
            # Both decisions (the first trigger and the next: escalate, floor or predicted) are would-kills only.
            with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            counts = {"sparkwatch_guard_kills_total": 0.0, "sparkwatch_guard_would_kills_total": 0.0}
            for line in text.splitlines():
                name = line.split("{", 1)[0]
                if name in counts:
                    counts[name] += float(line.rsplit(" ", 1)[1])
            assert counts == {"sparkwatch_guard_kills_total": 0.0, "sparkwatch_guard_would_kills_total": 2.0}, text
        else:
            assert wait_until(lambda: tree_dead(new) and tree_dead(old), 15)
        assert all(alive(pid) for pid in stress_pids)


def ballast(spawner: Spawner, tmp_path: Path, size_bytes: int) -> Path:
    """A process that is no engine (title 'sw-ballast') holding memory under the floor."""
    pidfile = tmp_path / "ballast.pids"
    spawner.engine(
        "--role",
        "hog",
        "--title",
        "sw-ballast",
        "--hog-rate-mib",
        "2048",
        "--hog-limit-mib",
        str(size_bytes >> 20),
        pidfile=pidfile,
        wait_for=1,
    )
    return pidfile


@pytest.mark.pressure
def test_an_engine_started_under_the_floor_dies_as_soon_as_it_is_found(spawner: Spawner, tmp_path: Path) -> None:
    floor_or_skip()
    hog = ballast(spawner, tmp_path, 2 * GiB)
    time.sleep(1.0)  # the ballast holds its memory
    # The floor sits 1 GiB above what is available now (the ballast took its share): the box is under the floor
    # with no engine from the start, whatever others on this shared box free meanwhile. Nothing more is allocated.
    # The ballast keeps floor + rearm_headroom under MemTotal on an idle box, which the config requires.
    floor = settled_available_bytes() + GiB
    env = {"SPARKWATCH_FLOOR": f"{floor}B", "SPARKWATCH_REARM_HEADROOM": "512MiB"}
    with sparkwatch_run(tmp_path, env=env) as daemon:
        assert wait_until(lambda: bool(events(daemon, "no_victim")), 60), "\n".join(daemon.stderr_lines)
        pidfile = tmp_path / "late.pids"
        spawner.engine("--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=1)
        started = time.monotonic()
        assert wait_until(lambda: tree_dead(pidfile), 10)
        took_s = time.monotonic() - started
        assert wait_until(lambda: bool(events(daemon, "kill")), 10)  # recorded after the reap and the settle time
        (kill,) = events(daemon, "kill")
        assert kill["trigger"] in ("hunt", "floor")  # "floor" only if others' frees briefly lifted the box over it
        assert float(kill["detect_to_signal_ms"]) < 1000  # type: ignore[arg-type]
        assert took_s < 5, f"the late engine lived {took_s:.1f} s under the floor"
        assert root_of(pidfile)[0] in {v["pid"] for v in cast("list[dict[str, object]]", kill["victims"])}
        assert tree_alive(hog)  # no engine, never touched
        assert len(events(daemon, "no_victim")) == 1  # one record of the empty look, not one per look


@pytest.mark.pressure
def test_a_supervisor_restarting_into_the_spike_gets_one_loop_alert(spawner: Spawner, tmp_path: Path) -> None:
    floor = floor_or_skip()
    pidfile = tmp_path / "looped.pids"
    engine = [
        sys.executable,
        str(FAKE_ENGINE),
        "--worker",
        "VLLM::Worker_TP0",
        "--hog-rate-mib",
        "1024",
        "--hog-limit-mib",
        str((HEADROOM_BYTES + 2 * GiB) >> 20),  # 2 GiB past the floor: a margin for what others free meanwhile
        "--pidfile",
        str(pidfile),
    ]
    # A supervisor like systemd's Restart=always: the engine comes back 0.3 s after each death.
    script = f"while :; do {shlex.join(engine)}; sleep 0.3; done"
    with sparkwatch_run(tmp_path, env={"SPARKWATCH_FLOOR": f"{floor}B"}) as daemon:
        spawner.pidfiles.append(pidfile)
        spawner.popen(["bash", "-c", script])
        assert wait_until(lambda: len(events(daemon, "kill")) >= 4, 90), daemon.stderr_lines[-20:]
        kills = events(daemon, "kill")
        loops = events(daemon, "kill_loop")
    for kill in kills:  # every kill was made under the floor, or on a measured fall predicted to cross it
        avail = int(kill["mem_available_bytes"])  # type: ignore[call-overload]
        if kill["trigger"] == "predicted":
            assert float(kill["fill_rate_bytes_per_second"]) > 0 and avail <= floor + 2 * GiB  # type: ignore[arg-type]
        else:
            assert avail <= floor
    assert len(loops) == 1
    assert loops[0]["name"] == "VLLM::EngineCore" and int(loops[0]["kills"]) == 3  # type: ignore[call-overload]
    assert "Kill loop" in str(loops[0]["summary"])
