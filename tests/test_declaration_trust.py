"""Declarations the kernel vouches for (issue 27): what another user can make a root guard believe through the files
`sparkwatch launch` declares its engines in (common.launched).

A root guard (the system unit) reads every user's `/run/user/UID/sparkwatch/launched/`. Here the other users are real:
`nobody` (uid 65534) and `lp` (uid 7, whose uid sorts after nobody's as a string, as the old reader sorted /run/user)
write their declarations and run their engines through setpriv. The guard and root's commands run in a mount
namespace of the test's own, where a scratch directory is /run/user and another /run/sparkwatch (the system runtime
dir), so nothing here reads or writes the host's. Root only (skipped otherwise).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkwatch.common import launched
from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.common.wiretypes import WireError
from sparkwatch.core.launch.bootphase import BootPhase
from sparkwatch.core.units import GiB, MiB
from sparkwatch.guard.launchwatch import LaunchedEngines
from tests.conftest import FAKE_ENGINE, Spawner, alive, pids_in, settled_available_bytes, wait_until
from tests.daemon import sparkwatch_run, wait_for_event
from tests.launchbox import Box, box_for, fitting_util, small_args, small_model

NOBODY = 65534
VICTIM = 7  # lp
SYSTEM_MOUNTPOINT = Path("/run/sparkwatch")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("unshare") is None,
    reason="needs root, setpriv and unshare to act as other users against a root guard",
)


@dataclass
class Runtime:
    """The scratch /run/user and /run/sparkwatch of one test, and the command prefix that mounts them."""

    root: Path

    @property
    def users(self) -> Path:
        return self.root / "users"

    @property
    def system(self) -> Path:
        return self.root / "system"

    @property
    def prefix(self) -> list[str]:
        script = 'mount --bind "$1" /run/user && mount --bind "$2" /run/sparkwatch && shift 2 && exec "$@"'
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(self.users),
                str(self.system)]  # fmt: skip

    def login(self, uid: int) -> Path:
        """/run/user/UID as logind makes it: the user's own, 0700."""
        path = self.users / str(uid)
        path.mkdir(mode=0o700, exist_ok=True)
        os.chown(path, uid, uid)
        return path

    def launched(self, uid: int) -> Path:
        return self.users / str(uid) / "sparkwatch" / "launched"


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    root = Path(tempfile.mkdtemp(prefix="sw-decl-", dir="/tmp"))
    root.chmod(0o755)
    (root / "users").mkdir(mode=0o755)
    (root / "system").mkdir(mode=0o755)
    made = not SYSTEM_MOUNTPOINT.exists()
    if made:
        SYSTEM_MOUNTPOINT.mkdir(mode=0o755)  # the mount point only; the namespace mounts the scratch dir on it
    try:
        yield Runtime(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if made:
            with contextlib.suppress(OSError):  # another test may have put something of its own there meanwhile
                SYSTEM_MOUNTPOINT.rmdir()


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    yield from box_for(tmp_path)


def as_user(uid: int, script: str, *args: str, data: bytes | None = None) -> None:
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sh", "-c", script, "sh", *args]
    subprocess.run(cmd, input=data, check=True, timeout=30)


def declare(rt: Runtime, uid: int, body: bytes, name: str) -> None:
    """`uid` writes one declaration into its runtime dir, atomically (a temporary file renamed), as launch does."""
    script = 'mkdir -p "$1" && cat > "$1/.tmp-$2" && mv "$1/.tmp-$2" "$1/$2"'
    as_user(uid, script, str(rt.launched(uid)), name, data=body)


def declaration(pid: int, ticks: int, uid: int, budget: int | None, **kw: Any) -> launched.Declaration:
    now = time.time()
    decl = launched.Declaration(root_pid=pid, start_ticks=ticks, uid=uid, kind="vllm", model=f"m{pid}", key="k",
                                budget_bytes=budget, launched_at=now, launcher_pid=os.getpid())  # fmt: skip
    return replace(decl.entered(BootPhase.STARTING, now), **kw)


@functools.cache
def user_code() -> Path:
    """A world-readable copy of what another user's engine runs: the fake engine and setproctitle (its one import
    beyond the standard library). The checkout and its venv may sit where that user may not enter (a clone under a
    0700 `mktemp -d` or root's home): the test must pass wherever the clone is. Removed when the session ends."""
    import setproctitle

    base = Path(tempfile.mkdtemp(prefix="sw-usercode-", dir="/tmp"))
    shutil.copy(FAKE_ENGINE, base / "fake_engine.py")
    package = Path(setproctitle.__file__).parent
    shutil.copytree(package, base / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [base, *base.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    atexit.register(shutil.rmtree, base, True)
    return base


def user_python(uid: int) -> list[str]:
    """A command line that runs this interpreter's Python as `uid`, with user_code() on its path: sys.executable where
    `uid` may run it, else the system's python of the same version (a venv on a pyenv under root's 0700 home is not)."""
    real = os.path.realpath(sys.executable)
    mode = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "test", "-x", real]
    if subprocess.run(mode, check=False).returncode == 0:
        python = sys.executable
    else:
        found = shutil.which(f"python{sys.version_info.major}.{sys.version_info.minor}", path="/usr/bin:/usr/local/bin")
        if found is None:
            pytest.skip(f"uid {uid} may not run {real} and there is no system python of its version")
        python = found
    return ["env", f"PYTHONPATH={user_code()}", python]


def user_engine(spawner: Spawner, rt: Runtime, uid: int, *args: str) -> tuple[int, int]:
    """A fake engine tree run by `uid`; (root pid, start ticks) once its processes recorded themselves."""
    pidfile = rt.root / f"engine-{uid}-{len(spawner.procs)}.pids"
    pidfile.touch()
    os.chown(pidfile, uid, uid)
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *user_python(uid),
            str(user_code() / "fake_engine.py"), *args, "--pidfile", str(pidfile)]  # fmt: skip
    spawner.pidfiles.append(pidfile)
    spawner.popen(argv)
    assert wait_until(lambda: len(pidfile.read_text().splitlines()) >= 1, 20)
    root = next(pid for pid, (_t, role) in pids_in(pidfile).items() if role == "root")
    return root, pids_in(pidfile)[root][0]


def kinds(events_path: Path) -> list[str]:
    return [str(e["kind"]) for e in read_events(events_path)] if events_path.exists() else []


def enough_memory(need: int) -> None:
    with MeminfoReader() as r:
        avail = r.read().available_bytes
    if avail < need + 2 * GiB:
        pytest.skip(f"needs {need >> 20} MiB more than the 2 GiB kept free; {avail >> 20} MiB available")


def root_command(rt: Runtime, env: dict[str, str], *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [*rt.prefix, sys.executable, "-m", "sparkwatch", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


OVERFLOW = b'{"version":1,"root_pid":1,"start_ticks":1,"uid":65534,"kind":"vllm","model":"m","key":"k",' + (
    b'"budget_bytes":null,"launched_at":1' + b"0" * 400 + b',"launcher_pid":1}'
)


@pytest.mark.pressure
def test_a_declaration_too_big_for_a_float_stops_no_budget(runtime: Runtime, spawner: Spawner, tmp_path: Path) -> None:
    """Old main: `launched_at: 10**400` raised OverflowError on every tick; no budget ran (680 MiB under 64 MiB)."""
    enough_memory(1 * GiB)
    runtime.login(NOBODY)
    declare(runtime, NOBODY, OVERFLOW, "1-1.json")
    budgets = json.dumps(["64MiB=sw-decl-overflow"])
    env = {"SPARKWATCH_ENGINE_BUDGETS": budgets}
    with sparkwatch_run(tmp_path, env=env, prefix=runtime.prefix) as daemon:
        pidfile = tmp_path / "tree.pids"
        spawner.engine("--title", "VLLM::EngineCore_sw-decl-overflow", "--hog-rate-mib", "200",
                       "--hog-limit-mib", "700", pidfile=pidfile, wait_for=1)  # fmt: skip
        event = wait_for_event(daemon.events_path, "kill", timeout_s=20)
        assert event["trigger"] == "budget" and event["budget_bytes"] == 64 * MiB
        # Said once by each reader (the guard and telemetry), not on every read.
        said = [line for line in daemon.stderr_lines if "skipped" in line and "1-1.json" in line]
        assert 1 <= len(said) <= 2, said


def test_roots_commands_skip_a_declaration_they_cannot_decode(runtime: Runtime, box: Box, tmp_path: Path) -> None:
    """Old main: root's `engines`, `wait-settled` and `launch` ended in a traceback (OverflowError)."""
    runtime.login(NOBODY)
    declare(runtime, NOBODY, OVERFLOW, "1-1.json")
    declare(runtime, NOBODY, b"[" * 100_000, "2-2.json")  # nested past the recursion limit (and over the size cap)
    declare(runtime, NOBODY, b"[" * 5_000, "3-3.json")  # nested past json's recursion limit, under the cap
    model = small_model(tmp_path)
    for argv in (("engines", "--json", "--window", "0"), ("wait-settled", "--timeout", "1"),
                 ("launch", "--plan", "--json", "--", *small_args(model, fitting_util()))):  # fmt: skip
        done = root_command(runtime, box.env, *argv)
        assert "Traceback" not in done.stderr and done.returncode in (0, 1), (argv, done.returncode, done.stderr)


def budget_kill_via_declaration(spawner: Spawner, rt: Runtime, daemon_events: Path, *, shadow_first: bool) -> None:
    """lp runs an engine growing at 200 MiB/s and declares a 64 MiB budget for it; with `shadow_first`, nobody
    declared the same engine (no budget) before lp did."""
    pid, ticks = user_engine(spawner, rt, VICTIM, "--title", "VLLM::EngineCore_sw-decl-victim", "--hog-rate-mib",
                             "150", "--hog-limit-mib", "900")  # fmt: skip
    name = f"{pid}-{ticks}.json"
    if shadow_first:
        rt.login(NOBODY)
        declare(rt, NOBODY, launched.encode(declaration(pid, ticks, NOBODY, None)), name)
    rt.login(VICTIM)
    declare(rt, VICTIM, launched.encode(declaration(pid, ticks, VICTIM, 64 * MiB)), name)
    event = wait_for_event(daemon_events, "kill", timeout_s=20)
    assert event["trigger"] == "budget" and event["budget_source"] == "launch"
    victims: list[dict[str, Any]] = event["victims"]  # type: ignore[assignment]  # a kill event's victims
    assert event["budget_bytes"] == 64 * MiB and pid in {v["pid"] for v in victims}


@pytest.mark.pressure
def test_another_users_declaration_never_drops_a_budget(runtime: Runtime, spawner: Spawner, tmp_path: Path) -> None:
    """Old main: nobody's declaration of lp's engine came first (/run/user/65534 < /run/user/7), was not trusted, and
    hid lp's own: the budget was silently dropped."""
    enough_memory(1 * GiB)
    runtime.login(VICTIM)
    runtime.login(NOBODY)  # both logged in before the guard started (the old guard listed /run/user only then)
    with sparkwatch_run(tmp_path, prefix=runtime.prefix) as daemon:
        budget_kill_via_declaration(spawner, runtime, daemon.events_path, shadow_first=True)


@pytest.mark.pressure
def test_a_user_who_logs_in_after_the_guard_started_is_read(runtime: Runtime, spawner: Spawner, tmp_path: Path) -> None:
    """Old main listed /run/user once, at start: lp's budget, declared after lp logged in, was never read."""
    enough_memory(1 * GiB)
    with sparkwatch_run(tmp_path, prefix=runtime.prefix) as daemon:
        budget_kill_via_declaration(spawner, runtime, daemon.events_path, shadow_first=False)


@pytest.mark.pressure
def test_another_users_declaration_never_sets_a_budget(runtime: Runtime, spawner: Spawner, tmp_path: Path) -> None:
    """Old main took a replacement declaration without checking trust again: nobody's "budget 1 B" for lp's engine
    killed it (it holds 320 MiB: over 1 B + the 256 MiB margin)."""
    enough_memory(512 * MiB)
    runtime.login(VICTIM)
    runtime.login(NOBODY)
    with sparkwatch_run(tmp_path, prefix=runtime.prefix) as daemon:
        pid, ticks = user_engine(spawner, runtime, VICTIM, "--title", "VLLM::EngineCore_sw-decl-steady",
                                 "--hog-rate-mib", "400", "--hog-limit-mib", "320")  # fmt: skip
        name = f"{pid}-{ticks}.json"
        own = declaration(pid, ticks, VICTIM, None)
        declare(runtime, VICTIM, launched.encode(own), name)
        wait_for_event(daemon.events_path, "engine_started", timeout_s=20)
        declare(runtime, NOBODY, launched.encode(declaration(pid, ticks, NOBODY, 1)), name)
        declare(runtime, NOBODY, launched.encode(declaration(pid, ticks, VICTIM, 1)), f"{pid}-{ticks}-x.json")
        # The old guard killed within a discovery (immediate: a budgeted declaration appeared) and two samples: ~1 s.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            assert "kill" not in kinds(daemon.events_path)
            time.sleep(0.1)
        assert alive(pid, ticks)
        # lp's own updates still count (the old guard had taken nobody's in their place: no engine_ready came).
        declare(runtime, VICTIM, launched.encode(own.entered(BootPhase.READY, time.time())), name)
        wait_for_event(daemon.events_path, "engine_ready", timeout_s=20)


def test_a_declaration_naming_pid_1_does_not_block_roots_launch(runtime: Runtime, box: Box, tmp_path: Path) -> None:
    """Old main: nobody's declaration of PID 1 (its real start time) with a 100 TiB budget was a reservation in
    root's plan: "wait for … pid 1"."""
    ticks = read_start_ticks("/proc", 1)
    assert ticks is not None
    runtime.login(NOBODY)
    declare(runtime, NOBODY, launched.encode(declaration(1, ticks, NOBODY, 100 << 40)), f"1-{ticks}.json")
    model = small_model(tmp_path)
    done = root_command(runtime, box.env, "launch", "--plan", "--json", "--", *small_args(model, fitting_util()))
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "pid 1" not in done.stdout + done.stderr


def idle_process(spawner: Spawner, uid: int) -> tuple[int, int]:
    """An idle process of `uid` (a `sleep`): (pid, start ticks) once the kernel says `uid` owns it."""
    proc = spawner.popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "120"])
    assert wait_until(lambda: read_start_ticks("/proc", proc.pid) is not None and
                      os.stat(f"/proc/{proc.pid}").st_uid == uid, 10)  # fmt: skip
    ticks = read_start_ticks("/proc", proc.pid)
    assert ticks is not None
    return proc.pid, ticks


def roots_plan(rt: Runtime, box: Box, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    model = tmp_path / "model"
    if not model.exists():
        small_model(tmp_path)
    return root_command(rt, box.env, "launch", "--plan", *flags, "--", *small_args(model, fitting_util()))


def reserved_for(plan: dict[str, Any], pid: int) -> dict[str, Any]:
    entries: list[dict[str, Any]] = plan["reserved"]
    return next(r for r in entries if r["root_pid"] == pid)


def test_another_users_idle_declaration_of_100_tib_does_not_block_roots_launch(
    runtime: Runtime, box: Box, spawner: Spawner, tmp_path: Path
) -> None:
    """Old main: nobody's `sleep`, declared booting with a 100 TiB budget and estimate, was a 100 TiB reservation:
    every launch on the box refused ("short by 100.0 TiB")."""
    runtime.login(NOBODY)
    pid, ticks = idle_process(spawner, NOBODY)
    decl = declaration(pid, ticks, NOBODY, 100 << 40, estimate_bytes=100 << 40)
    declare(runtime, NOBODY, launched.encode(decl), f"{pid}-{ticks}.json")
    done = roots_plan(runtime, box, tmp_path, "--json")
    assert done.returncode == 0, (done.stdout, done.stderr)
    plan = json.loads(done.stdout)
    mine = reserved_for(plan, pid)  # read, vouched for, and held to the rule
    assert mine["reserved_bytes"] == 0 and mine["why"] == "its tree is no engine" and mine["uid"] == NOBODY, mine
    text = roots_plan(runtime, box, tmp_path)
    assert text.returncode == 0 and f"pid {pid}" not in text.stdout + text.stderr, text.stdout


def test_seven_idle_1_gib_declarations_take_nothing_off_roots_plan(
    runtime: Runtime, box: Box, spawner: Spawner, tmp_path: Path
) -> None:
    """Old main: seven idle processes of nobody's, each declared with 1 GiB, took 7 GiB off every plan."""
    runtime.login(NOBODY)
    pids = set()
    for _ in range(7):
        pid, ticks = idle_process(spawner, NOBODY)
        decl = declaration(pid, ticks, NOBODY, GiB, estimate_bytes=GiB)
        declare(runtime, NOBODY, launched.encode(decl), f"{pid}-{ticks}.json")
        pids.add(pid)
    done = roots_plan(runtime, box, tmp_path, "--json")
    assert done.returncode == 0, (done.stdout, done.stderr)
    plan = json.loads(done.stdout)
    theirs = [r for r in plan["reserved"] if r["root_pid"] in pids]
    assert len(theirs) == 7 and sum(r["reserved_bytes"] for r in theirs) == 0, theirs
    mem = plan["memory"]
    assert plan["available_bytes"] == mem["available_bytes"] - mem["floor_bytes"] - mem["margin_bytes"]
    assert {r["uid"] for r in theirs} == {NOBODY}


def tree_rss_bytes(root: int) -> int:
    from sparkwatch.common.sources.procs import read_descendants, read_rss_bytes

    return read_rss_bytes("/proc", read_descendants("/proc", [root]))


def test_another_users_booting_engine_reserves_its_estimate_less_what_it_holds(
    runtime: Runtime, box: Box, spawner: Spawner, tmp_path: Path
) -> None:
    """nobody's engine tree (VLLM::EngineCore and a child holding 256 MiB) declared loading its weights, with an
    estimate of 2 GiB and a budget of 100 TiB: it reserves 2 GiB less what its tree holds, named as nobody's, and
    nothing once declared ready. Old main reserved the budget less the declared peak: 100 TiB."""
    enough_memory(512 * MiB)
    runtime.login(NOBODY)
    pid, ticks = user_engine(spawner, runtime, NOBODY, "--title", "VLLM::EngineCore_sw-decl-boot", "--hog-rate-mib",
                             "400", "--hog-limit-mib", "256")  # fmt: skip
    assert wait_until(lambda: tree_rss_bytes(pid) >= 256 * MiB, 20)
    decl = declaration(pid, ticks, NOBODY, 100 << 40, estimate_bytes=2 * GiB).entered(BootPhase.LOADING_WEIGHTS,
                                                                                      time.time())  # fmt: skip
    name = f"{pid}-{ticks}.json"
    declare(runtime, NOBODY, launched.encode(decl), name)
    done = roots_plan(runtime, box, tmp_path, "--json")
    held = tree_rss_bytes(pid)
    assert done.returncode == 0, (done.stdout, done.stderr)
    plan = json.loads(done.stdout)
    mine = reserved_for(plan, pid)
    # What the tree held when the plan read it, within what its interpreters may have grown meanwhile.
    assert 2 * GiB - held <= mine["reserved_bytes"] <= 2 * GiB - 256 * MiB, (mine, held)
    assert mine["uid"] == NOBODY and mine["why"].startswith("booting (loading_weights, "), mine
    mem = plan["memory"]
    assert plan["available_bytes"] == mem["available_bytes"] - mem["floor_bytes"] - mem["margin_bytes"] - sum(
        r["reserved_bytes"] for r in plan["reserved"]
    )
    text = roots_plan(runtime, box, tmp_path)
    line = next(x for x in text.stdout.splitlines() if f"(pid {pid}" in x)
    assert line.startswith(f"  reserved for vllm m{pid} (pid {pid}, another user's: uid {NOBODY}): "), line
    assert "its plan's estimate 2.0 GiB less the " in line and "its tree holds" in line, line
    declare(runtime, NOBODY, launched.encode(decl.entered(BootPhase.READY, time.time())), name)
    ready = json.loads(roots_plan(runtime, box, tmp_path, "--json").stdout)
    assert reserved_for(ready, pid)["reserved_bytes"] == 0


def dead_pids(count: int) -> list[int]:
    with open("/proc/sys/kernel/pid_max") as fh:
        top = int(fh.read())
    return [pid for pid in range(top - 1, 300, -1) if not os.path.exists(f"/proc/{pid}")][:count]


def test_exited_declarations_for_dead_pids_make_no_events(runtime: Runtime, spawner: Spawner, tmp_path: Path) -> None:
    """Old main trusted an exited declaration whose process was gone: 2,462 fake engine_started/engine_exited events
    in 20 s. nobody's own live process, declared after the flood, is the sync: its engine_started comes."""
    runtime.login(NOBODY)
    with sparkwatch_run(tmp_path, prefix=runtime.prefix) as daemon:
        now = time.time()
        flood = dead_pids(40)
        for pid in flood:
            decl = declaration(pid, 1000 + pid, NOBODY, None, exited_at=now, exit_code=0, phase=BootPhase.EXITED)
            declare(runtime, NOBODY, launched.encode(decl), f"{pid}-{1000 + pid}.json")
        own = spawner.popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "60"])
        assert wait_until(lambda: read_start_ticks("/proc", own.pid) is not None and
                          os.stat(f"/proc/{own.pid}").st_uid == NOBODY, 10)  # fmt: skip
        ticks = read_start_ticks("/proc", own.pid)
        assert ticks is not None
        declare(runtime, NOBODY, launched.encode(declaration(own.pid, ticks, NOBODY, None)), f"{own.pid}-{ticks}.json")
        started = wait_for_event(daemon.events_path, "engine_started", timeout_s=20)
        assert started["root_pid"] == own.pid
        time.sleep(1.5)  # a liveness round (every 1 s) after the sync: the old guard's exits came by then
        named = {e.get("root_pid") for e in read_events(daemon.events_path) if str(e["kind"]).startswith("engine_")}
        assert named == {own.pid}


@pytest.mark.pressure
def test_sudo_launch_without_a_runtime_dir_is_enforced_by_the_system_guard(
    runtime: Runtime, box: Box, tmp_path: Path
) -> None:
    """Old main: root's launch without XDG_RUNTIME_DIR declared into its own state dir, which the system guard never
    reads: "budget 64 MiB" was printed and the engine grew past it unseen."""
    enough_memory(1500 * MiB)
    env = {k: v for k, v in box.env.items() if k != "XDG_RUNTIME_DIR"}
    env["SPARKWATCH_STATE_DIR"] = str(tmp_path / "sudo-home-state")  # not the system guard's
    with sparkwatch_run(tmp_path, prefix=runtime.prefix) as daemon:
        model = small_model(tmp_path)
        argv = [*runtime.prefix, sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", "--budget",
                "128MiB", "-q", "--", *small_args(model, fitting_util()), "--phase-mib", "loading_weights=64",
                "--phase-s", "0.1", "--grow-mib-per-s", "300", "--grow-limit-mib", "1000", "--pidfile",
                str(box.pidfile)]  # fmt: skip
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            _out, err = proc.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            _out, err = proc.communicate(timeout=30)
            raise AssertionError(f"the engine outgrew its budget unseen; launch said:\n{err.decode()}") from None
        assert proc.returncode == 137, err.decode()
        event = wait_for_event(daemon.events_path, "kill")
        assert event["trigger"] == "budget" and event["budget_source"] == "launch"
        assert event["budget_bytes"] == 128 * MiB
        assert [p.name for p in runtime.system.glob("launched/*.json")], "declared in the system runtime dir"


def make_entries(directory: Path, count: int) -> None:
    """`count` directory entries, cheaply: hard links (ext4 allows 65,000 per inode) to a few empty files."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        per = 60_000
        for j in range(0, count, per):
            src = directory.parent / f"src{j}"
            src.touch()
            for i in range(j, min(j + per, count)):
                os.link(src, f"{i:07d}.json", dst_dir_fd=fd)
    finally:
        os.close(fd)


@pytest.mark.pressure
@pytest.mark.slow
def test_a_directory_of_500000_entries_does_not_delay_a_floor_kill(
    runtime: Runtime, spawner: Spawner, tmp_path: Path
) -> None:
    """nobody's `launched/` holds 500,000 entries and is touched every 20 ms. Old main listed it on the guard's tick
    (0.6 s a listing here): a floor crossing at 400 MiB/s was detected 288 MiB under the floor. 500,000 because the
    cost must be a large share of a tick: 100,000 entries list in ~0.08 s here, which the prediction still absorbs;
    hard links make them in ~8 s."""
    headroom = int(1.5 * GiB)
    runtime.login(NOBODY)
    big = runtime.launched(NOBODY)
    as_user(NOBODY, 'mkdir -p "$1"', str(big))
    make_entries(big, 500_000)
    os.chown(big.parent / "src0", NOBODY, NOBODY)
    available = settled_available_bytes()
    if available < 6 * GiB:
        pytest.skip(f"only {available >> 20} MiB available; this test wants 6 GiB")
    floor = available - headroom
    touch = "import os, sys, time\nwhile True:\n os.utime(sys.argv[1]); time.sleep(0.02)"
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    toucher = spawner.popen([*as_nobody, *user_python(NOBODY), "-c", touch, str(big)])
    try:
        with sparkwatch_run(tmp_path, env={"SPARKWATCH_FLOOR": f"{floor}B"}, prefix=runtime.prefix) as daemon:
            from tests.test_guard_pressure import MinTracker, hog_args

            tracker = MinTracker()
            tracker.start()
            pidfile = tmp_path / "tree.pids"
            hog = [*hog_args(floor, headroom, extra_bytes=GiB), "--hog-rate-mib", "400"]  # the later rate wins
            spawner.engine(*hog, pidfile=pidfile, wait_for=1)
            event = wait_for_event(daemon.events_path, "kill", timeout_s=60)
            tracker.stop.set()
            tracker.join()
            assert event["trigger"] in ("floor", "predicted")
            assert tracker.min_available > floor, f"went {(floor - tracker.min_available) >> 20} MiB under the floor"
    finally:
        toucher.send_signal(signal.SIGKILL)
        toucher.wait(10)


# --- the property: whatever nobody writes, the root reader stays fast and gives nobody nothing of anyone else's

_NAMES = st.one_of(
    st.text(st.characters(exclude_characters="/\x00", exclude_categories=["Cs"]), min_size=1, max_size=40),
    st.builds(lambda a, b: f"{a}-{b}.json", st.integers(0, 1 << 22), st.integers(0, 1 << 40)),
).filter(lambda n: n not in (".", "..") and len(n.encode()) < 200)


@st.composite
def _declaration_bytes(draw: st.DrawFn, targets: list[tuple[int, int]]) -> bytes:
    pid, ticks = draw(st.sampled_from(targets))
    big = st.one_of(st.integers(-(1 << 80), 1 << 80), st.just(10**400), st.floats(allow_nan=True))
    body: dict[str, Any] = json.loads(launched.encode(declaration(pid, ticks, NOBODY, 1)))
    body["uid"] = draw(st.sampled_from([NOBODY, 0, VICTIM]))
    body["budget_bytes"] = draw(st.one_of(st.none(), st.just(1), big))
    if draw(st.booleans()):
        body["launched_at"] = draw(big)
    if draw(st.booleans()):
        body["exited_at"], body["phase"] = time.time(), "exited"
    text = json.dumps(body, allow_nan=True).encode()
    return text if draw(st.booleans()) else text + b" " * draw(st.integers(0, 20_000))


@st.composite
def _tree(draw: st.DrawFn, targets: list[tuple[int, int]]) -> list[tuple[str, str, Any]]:
    """(relative path, what, payload) entries: files, declarations, symlinks, dirs, FIFOs."""
    base = draw(
        st.sampled_from(["runtime", "runtime/sparkwatch", "runtime/sparkwatch/launched", "state", "state/launched"])
    )
    out: list[tuple[str, str, Any]] = []
    for _ in range(draw(st.integers(0, 12))):
        name = draw(_NAMES)
        what = draw(st.sampled_from(["decl", "decl", "bytes", "symlink", "dir", "fifo"]))
        if what == "decl":
            out.append((f"{base}/{name}", what, draw(_declaration_bytes(targets))))
        elif what == "bytes":
            out.append((f"{base}/{name}", what, draw(st.binary(max_size=2048))))
        elif what == "symlink":
            out.append((f"{base}/{name}", what, draw(st.sampled_from(["/proc/1/environ", "/dev/zero", "..", "/"]))))
        else:
            out.append((f"{base}/{name}", what, None))
    if draw(st.booleans()):
        out.append(("runtime/sparkwatch/launched", "many", draw(st.integers(0, 3000))))
    if draw(st.booleans()):
        out.append(
            (draw(st.sampled_from(["runtime/sparkwatch/launched", "runtime/sparkwatch"])), "link-elsewhere", None)
        )
    return out


def _build(home: Path, entries: list[tuple[str, str, Any]], elsewhere: Path) -> None:
    (home / "runtime" / "sparkwatch" / "launched").mkdir(parents=True, exist_ok=True)
    (home / "state" / "launched").mkdir(parents=True, exist_ok=True)
    for rel, what, payload in entries:
        path = home / rel
        if os.path.lexists(path) and what not in ("many", "link-elsewhere"):
            continue  # two draws named the same path: the first one stands (never open a FIFO drawn before)
        try:
            if what in ("decl", "bytes"):
                path.write_bytes(payload)
            elif what == "symlink":
                path.symlink_to(payload)
            elif what == "dir":
                path.mkdir()
            elif what == "fifo":
                os.mkfifo(path)
            elif what == "many":
                for i in range(payload):
                    (path / f"{i:06d}.json").touch()
            elif what == "link-elsewhere":  # runtime/sparkwatch[/launched] made a link to root's directory
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.is_symlink():
                    path.unlink()
                path.symlink_to(elsewhere / rel.removeprefix("runtime/"))
        except OSError:
            continue  # two draws named the same path: the first one stands
    for dirpath, dirnames, filenames in os.walk(home):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), NOBODY, NOBODY)  # nobody's, as if nobody had written them
    os.lchown(home, NOBODY, NOBODY)


def test_whatever_another_user_writes_the_root_reader_stays_fast_and_grants_nothing(
    runtime: Runtime, spawner: Spawner
) -> None:
    runtime.login(NOBODY)
    victim_pid, victim_ticks = user_engine(spawner, runtime, VICTIM, "--title", "VLLM::EngineCore_sw-decl-prop")
    mine = os.getpid()
    mine_ticks = read_start_ticks("/proc", mine)
    init_ticks = read_start_ticks("/proc", 1)
    assert mine_ticks is not None and init_ticks is not None
    targets = [(1, init_ticks), (mine, mine_ticks), (victim_pid, victim_ticks), (victim_pid, victim_ticks + 1)]
    # Somewhere else nobody may point its links at: a directory of root's with a valid declaration of root's own.
    elsewhere = runtime.root / "elsewhere"
    launched.write(elsewhere / "sparkwatch" / "launched", declaration(mine, mine_ticks, 0, 1))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(entries=_tree(targets))
    def prop(entries: list[tuple[str, str, Any]]) -> None:
        home = runtime.users / str(NOBODY)
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(mode=0o700)
        _build(home, entries, elsewhere)
        # What a root reader reads of nobody's: its runtime dir; and its state dir, which no root reader reads (a
        # reader that did must still be safe).
        dirs = [home / "runtime" / "sparkwatch" / "launched", home / "state" / "launched"]
        engines = LaunchedEngines(dirs, "/proc", lambda *_a: None)
        for _ in range(2):  # the first read, and the next one (nothing changed: a stat per directory)
            started = time.thread_time()
            engines.poll(time.monotonic())
            took = time.thread_time() - started
            assert took < 0.010, f"a poll took {took * 1000:.1f} ms of CPU"
        for (pid, _ticks), (_kind, uid) in engines.declared().items():
            assert os.stat(f"/proc/{pid}").st_uid == uid == NOBODY, (pid, uid)
        assert not engines.live(), engines.live()  # nobody runs no engine here: nothing of anyone else's is granted

    prop()


def test_a_symlinked_launched_dir_is_refused_and_said_once(
    runtime: Runtime, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """nobody links its `launched` dir to root's: nothing in it counts, and one log line names it."""
    home = runtime.login(NOBODY)
    mine = os.getpid()
    ticks = read_start_ticks("/proc", mine)
    assert ticks is not None
    target = tmp_path / "sparkwatch" / "launched"
    launched.write(target, declaration(mine, ticks, 0, 1))
    (home / "sparkwatch").mkdir()
    (home / "sparkwatch" / "launched").symlink_to(target)
    os.lchown(home / "sparkwatch", NOBODY, NOBODY)
    os.lchown(home / "sparkwatch" / "launched", NOBODY, NOBODY)
    result = launched.scan(home / "sparkwatch" / "launched")
    assert result.declarations == () and result.errors == 1
    watch = launched.LaunchedWatch([], users_root=runtime.users)
    for _ in range(3):
        assert watch.poll() == ()
        os.utime(target)
    assert watch.errors_total >= 1
    assert sum("is a symlink" in r.getMessage() for r in caplog.records) == 1, caplog.records
    assert stat.S_ISLNK(os.lstat(home / "sparkwatch" / "launched").st_mode)


def test_every_decoding_failure_is_one_wire_error() -> None:
    """Whatever the bytes, decode raises WireError (a counted bad file), never OverflowError or RecursionError."""
    good = json.loads(launched.encode(declaration(1, 1, NOBODY, None)))
    for body in (OVERFLOW, b"[" * 5_000, b"\xff\xfe", json.dumps({**good, "budget_bytes": 1.5}).encode(),
                 json.dumps({**good, "phases": [["ready", 10**400]]}).encode()):  # fmt: skip
        with pytest.raises(WireError):
            launched.decode(body, NOBODY)
    with pytest.raises(WireError, match="declares uid 65534 in a file owned by uid 7"):
        launched.decode(launched.encode(declaration(1, 1, NOBODY, None)), VICTIM)
    assert launched.decode(launched.encode(declaration(1, 1, VICTIM, None)), 0).uid == VICTIM  # root's: any uid
