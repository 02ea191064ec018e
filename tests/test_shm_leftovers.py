"""What a killed engine leaves in /dev/shm: real files, real processes holding them, the real commands.

Files live in a scratch shm directory (the commands' --root) or in the real /dev/shm under names unique to the test,
removed at its end. A holder is a real child process: one file it maps (its fd closed: held by the mapping alone),
one it only holds open. `--fix` runs only on scratch roots: on the real /dev/shm it would take any engine-named orphan
of this box. The docker test SIGKILLs a container that ran with --ipc=host and a scratch /dev/shm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sparkwatch.core.enums import CheckStatus
from sparkwatch.core.launch.shmleft import fix_command, judge, kept_why, removable, summary
from sparkwatch.core.model import EngineTree, Proc, ShmFile, ShmLeft, ShmScan
from sparkwatch.core.report.doctorchecks import shm_check
from sparkwatch.core.units import MiB, format_size
from sparkwatch.telemetry import shmwatch
from sparkwatch.telemetry.sources.shmfiles import scan
from tests.conftest import wait_until, wakeups
from tests.daemon import scrape, sparkwatch_run
from tests.dockerd import Dockerd, run_args

SHM = Path("/dev/shm")
NOBODY = 65534

# Maps the first file and closes its fd (as sem_open does), holds the second by an open fd alone. Through libc's mmap:
# Python's mmap object keeps a dup of the fd, which would hold the file by an fd too.
HOLDER = """
import ctypes, mmap, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
fd = os.open(sys.argv[1], os.O_RDWR)
addr = libc.mmap(None, os.fstat(fd).st_size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
os.close(fd)
held = os.open(sys.argv[2], os.O_RDONLY)
print("ready", flush=True)
time.sleep(600)
"""


def unique(prefix: str) -> str:
    return f"{prefix}swtest-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def write(path: Path, written_bytes: int, apparent_bytes: int | None = None) -> Path:
    """A file with `written_bytes` of data (its pages allocated), sparse up to `apparent_bytes`."""
    with open(path, "wb") as fh:
        fh.write(os.urandom(written_bytes))
        if apparent_bytes is not None:
            fh.truncate(apparent_bytes)
    return path


def held_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@contextmanager
def holder(mapped: Path, held: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(mapped), str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


class Files:
    """The four kinds of file, in one directory: mapped and held (in use), an engine's orphan, another's orphan."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.mapped = write(where / unique("psm_"), 2 * MiB)
        self.held = write(where / unique("psm_"), 1 * MiB)
        self.orphan = write(where / unique("psm_"), 3 * MiB)
        # sparse: 64 MiB apparent, 1 MiB of pages; a database's segment, say: named, never removed
        self.other = write(where / unique("pgsql-"), 1 * MiB, 64 * MiB)

    def remove(self) -> None:
        for path in (self.mapped, self.held, self.orphan, self.other):
            path.unlink(missing_ok=True)


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[tuple[Path, Files]]:
    """A root whose dev/shm holds the four files (the commands' --root)."""
    root = tmp_path / "root"
    (root / "dev" / "shm").mkdir(parents=True)
    files = Files(root / "dev" / "shm")
    yield root, files
    files.remove()


@pytest.fixture
def real_shm() -> Iterator[Files]:
    files = Files(SHM)
    try:
        yield files
    finally:
        files.remove()


def clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg-config")
    env["XDG_STATE_HOME"] = str(tmp_path / "xdg-state")
    env["SPARKWATCH_ANCESTOR_PID"] = str(os.getpid())  # wait-settled waits for no one else's engine
    return env


def sparkwatch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(tmp_path),
        check=False,
    )


WAIT = ("wait-settled", "--quiet-for", "0.2", "--interval", "0.05", "--tolerance", "64GiB", "--timeout", "60")


# --- the scan, in this process, over real processes -----------------------------------------------------------------


def test_only_the_files_no_process_maps_or_holds_are_orphans(scratch: tuple[Path, Files]) -> None:
    _root, files = scratch
    with holder(files.mapped, files.held):
        left = judge(scan(files.where, Path("/proc")), euid=0)
    assert left.certain, left.why_uncertain
    assert [f.name for f in left.orphans] == [files.orphan.name, files.other.name]  # the largest first
    orphan, other = left.orphans
    assert orphan.held_bytes == held_bytes(files.orphan) >= 3 * MiB
    assert other.held_bytes == held_bytes(files.other) < 2 * MiB  # its pages, never its 64 MiB apparent size
    assert orphan.uid == os.geteuid()
    assert [f.name for f in removable(left, os.geteuid())] == [files.orphan.name]
    assert kept_why(other, left, os.geteuid()) == "not an engine's name"


def test_what_one_part_of_a_process_showed_counts_when_the_other_cannot_be_read(scratch: tuple[Path, Files]) -> None:
    """A fixture /proc: pid 42 holds a file by an fd and its maps cannot be read (a directory: EISDIR, as root reads
    any file); pid 43 maps another in the kernel's maps shape. /proc shows no namespace: not the whole table."""
    _root, files = scratch
    proc = scratch[0] / "proc"
    (proc / "42" / "fd").mkdir(parents=True)
    (proc / "42" / "fd" / "3").symlink_to(files.held)
    (proc / "42" / "maps").mkdir()
    (proc / "43" / "fd").mkdir(parents=True)
    st = os.stat(files.mapped)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    (proc / "43" / "maps").write_text(
        "7f0000000000-7f0000200000 rw-s 00000000 " + dev + f" {st.st_ino}                    {files.mapped}\n"
        "7f0000200000-7f0000201000 r--p 00000000 fd:01 123                        /usr/lib/libc.so.6\n"
    )
    (proc / "44").mkdir()  # no fd, no maps: it exited mid-read
    found = scan(files.where, proc)
    assert found.used == {(st.st_dev, st.st_ino), (os.stat(files.held).st_dev, os.stat(files.held).st_ino)}
    assert found.unreadable == (os.stat(proc / "42").st_uid,)
    assert found.partial_table
    left = judge(found, euid=0)
    assert {f.name for f in left.orphans} == {files.orphan.name, files.other.name}
    assert not left.certain and removable(left, 0) == ()


def test_a_process_of_another_user_that_cannot_be_read_makes_it_uncertain(real_shm: Files) -> None:
    """As nobody, root's processes cannot be read: the orphan is named, uncertain, and nothing is removable."""
    read_r, read_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nobody, scanning the real /dev/shm and /proc (an interpreter already loaded)
        code = 1
        try:
            os.close(read_r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            found = scan(SHM, Path("/proc"))
            left = judge(found, os.geteuid())
            doc = {
                "unreadable": len(found.unreadable),
                "certain": left.certain,
                "why": left.why_uncertain,
                "orphans": [f.name for f in left.orphans],
                "removable": [f.name for f in removable(left, os.geteuid())],
            }
            os.write(read_w, json.dumps(doc).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(read_w)
    with os.fdopen(read_r, "rb") as fh:
        raw = fh.read()
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    doc = json.loads(raw)
    assert doc["unreadable"] > 0 and not doc["certain"]
    assert "could not be read" in doc["why"]
    assert real_shm.orphan.name in doc["orphans"]
    assert doc["removable"] == []


# --- the pure rules -------------------------------------------------------------------------------------------------


def file(name: str, uid: int = 1000, size: int = MiB, ino: int = 1) -> ShmFile:
    return ShmFile(name, 27, ino, uid, size)


def test_removal_rules_owner_name_and_certainty() -> None:
    mine, theirs, odd = file("psm_a", 1000, ino=1), file("nccl-b", 1001, ino=2), file("pulse-shm-1", 1000, ino=3)
    left = judge(ShmScan((mine, theirs, odd), frozenset()), euid=1000)
    assert left.certain
    assert removable(left, 1000) == (mine,)
    assert kept_why(theirs, left, 1000) == "uid 1001's"
    assert kept_why(odd, left, 1000) == "not an engine's name"
    assert set(removable(left, 0)) == {mine, theirs}  # root may remove anyone's; still never a stranger's name
    unsure = judge(ShmScan((mine,), frozenset(), unreadable=(0, 0, 1001)), euid=1000)
    assert not unsure.certain and removable(unsure, 1000) == ()
    assert unsure.why_uncertain == "3 processes of uid 0, 1001 could not be read (root can)"
    assert fix_command(unsure, 1000, "sparkwatch doctor") == (
        "sudo sparkwatch doctor --fix",
        "reads every process, and removes the ones named like an engine's",
    )
    assert judge(ShmScan((mine,), frozenset(), unreadable=(0,)), euid=0).certain  # root's read error: see judge
    assert not judge(ShmScan((mine,), frozenset(), partial_table=True), euid=0).certain
    held = judge(ShmScan((mine, odd), frozenset({mine.key})), euid=1000)
    assert held.orphans == (odd,)


def test_summary_and_doctor_check_words() -> None:
    left = judge(ShmScan((file("psm_a", 0, 3 * MiB, 1), file("sem.mp-x", 0, 4096, 2)), frozenset()), euid=0)
    assert summary(left, "/dev/shm") == (
        "/dev/shm: 2 files no process holds, 3.0 MiB out of the pool: psm_a (3.0 MiB), sem.mp-x (4.0 KiB)"
    )
    check = shm_check(left, "/dev/shm", None, 0)
    assert check.status == CheckStatus.WARN
    assert check.fix is not None and check.fix.startswith("sparkwatch doctor --fix   # removes")
    assert check.detail == "psm_a: 3.0 MiB, uid 0 (removable)\nsem.mp-x: 4.0 KiB, uid 0 (removable)"
    assert shm_check(judge(ShmScan((), frozenset()), 0), "/dev/shm", None, 0).status == CheckStatus.OK
    assert shm_check(None, "/dev/shm", "Permission denied", 0).status == CheckStatus.SKIP


# --- the commands ---------------------------------------------------------------------------------------------------


def test_wait_settled_names_the_orphans_and_fix_removes_only_an_engines(
    tmp_path: Path, scratch: tuple[Path, Files]
) -> None:
    root, files = scratch
    where = files.where
    with holder(files.mapped, files.held):
        said = sparkwatch(tmp_path, *WAIT, "--root", str(root))
        assert said.returncode == 0, said.stderr
        total = format_size(held_bytes(files.orphan) + held_bytes(files.other))
        orphan = f"{files.orphan.name} ({format_size(held_bytes(files.orphan))})"
        other = f"{files.other.name} ({format_size(held_bytes(files.other))})"
        assert f"sparkwatch: {where}: 2 files no process holds, {total} out of the pool: {orphan}, {other}\n" in (
            said.stderr
        )
        assert "`sparkwatch wait-settled --fix` removes the ones named like an engine's" in said.stderr
        assert files.mapped.name not in said.stderr and files.held.name not in said.stderr
        assert files.orphan.exists()  # naming removes nothing

        back = format_size(held_bytes(files.orphan))
        fixed = sparkwatch(tmp_path, *WAIT, "--root", str(root), "--fix")
        assert fixed.returncode == 0, fixed.stderr
        assert f"sparkwatch: fix: removed 1 file from {where} ({files.orphan.name}): {back} back in the pool" in (
            fixed.stderr
        )
        assert f"sparkwatch: fix: kept {files.other.name} (not an engine's name)" in fixed.stderr
        assert not files.orphan.exists()
        assert files.other.exists() and files.mapped.exists() and files.held.exists()


def test_launch_names_them_at_its_settle_step_and_fix_removes_them_before_the_plan(
    tmp_path: Path, scratch: tuple[Path, Files]
) -> None:
    root, files = scratch
    launch = ("launch", "--settle-timeout", "0", "--budget", "64MiB", "--no-scope", "--root", str(root))
    with holder(files.mapped, files.held):
        said = sparkwatch(tmp_path, *launch, "--", "true")
        assert said.returncode == 0, said.stderr
        lines = said.stderr.splitlines()
        shm_line = next(i for i, line in enumerate(lines) if "no process holds" in line)
        plan_line = next(i for i, line in enumerate(lines) if line.startswith("sparkwatch: plan for"))
        assert shm_line < plan_line, said.stderr
        assert files.orphan.name in lines[shm_line] and files.mapped.name not in said.stderr
        assert "`sparkwatch launch --fix` removes" in said.stderr
        fixed = sparkwatch(tmp_path, *launch, "--fix", "--", "true")
        assert fixed.returncode == 0, fixed.stderr
        assert f"removed 1 file from {files.where} ({files.orphan.name})" in fixed.stderr
    assert not files.orphan.exists() and files.other.exists()


def doctor_shm(tmp_path: Path, *extra: str) -> tuple[dict[str, str], str]:
    done = sparkwatch(tmp_path, "doctor", "--json", *extra)
    assert done.returncode in (0, 1), done.stderr
    checks = {c["id"]: c for c in json.loads(done.stdout)["checks"]}
    return checks["shm-leftovers"], done.stderr


def test_doctor_on_the_real_dev_shm_names_them(tmp_path: Path, real_shm: Files) -> None:
    """The real /dev/shm and /proc, read only: a test never removes a file it did not make, and --fix on the real
    /dev/shm would take any engine-named orphan of this box (the fix is tested on a scratch root below)."""
    files = real_shm
    with holder(files.mapped, files.held):
        check, _ = doctor_shm(tmp_path)
        assert check["status"] == "warn"
        detail = check["detail"].splitlines()
        uid = os.geteuid()
        assert f"{files.orphan.name}: {format_size(held_bytes(files.orphan))}, uid {uid} (removable)" in detail
        assert f"{files.other.name}: {format_size(held_bytes(files.other))}, uid {uid} (not an engine's name)" in detail
        assert files.mapped.name not in check["detail"] and files.held.name not in check["detail"]
        assert check["fix"].startswith("sparkwatch doctor --fix")


def test_doctor_fix_removes_only_an_engines_orphan(tmp_path: Path, scratch: tuple[Path, Files]) -> None:
    root, files = scratch
    where = ("--root", str(root), "--proc-root", "/proc")
    with holder(files.mapped, files.held):
        check, stderr = doctor_shm(tmp_path, *where, "--fix")
        assert "sparkwatch: fix: removed" in stderr and "back in the pool" in stderr
        assert not files.orphan.exists()
        assert files.other.exists() and files.mapped.exists() and files.held.exists()
        assert files.orphan.name not in check.get("detail", "")
        assert files.other.name in check["detail"]  # named still, never removed


# --- the metric's watch ---------------------------------------------------------------------------------------------


def names(left: ShmLeft | None) -> set[str]:
    return {f.name for f in left.orphans} if left is not None else set()


def test_the_watch_scans_again_soon_after_an_engine_tree_ends(
    scratch: tuple[Path, Files], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, files = scratch
    monkeypatch.setattr(shmwatch, "SCAN_EVERY_S", 3600.0)  # only the end of the tree can bring the next scan
    monkeypatch.setattr(shmwatch, "AFTER_END_S", 0.3)
    engine = Proc(4242, 1, 0, "python3", "S", 99, 0, ("VLLM::EngineCore",))
    trees = (EngineTree("vllm", engine, (engine,)),)
    watch = shmwatch.ShmWatch(root, Path("/proc"))
    files.orphan.unlink()
    watch.start()
    try:
        watch.observe(trees)  # telemetry's cycles, as the telemetry process hands them on
        assert wait_until(lambda: watch.latest is not None, 10)
        assert watch.latest is not None and files.orphan.name not in names(watch.latest)
        write(files.orphan, 3 * MiB)  # the tree's leftover
        for _ in range(6):
            watch.observe(trees)
            time.sleep(0.1)
        assert files.orphan.name not in names(watch.latest)  # no scan while the tree runs
        assert watch.scans_total == 1
        watch.observe(())  # the cycle that no longer sees it
        assert wait_until(lambda: watch.latest is not None and files.orphan.name in names(watch.latest), 5)
        assert watch.scans_total == 2
    finally:
        watch.stop()


def test_with_no_engine_the_watch_sleeps_between_its_scans(
    scratch: tuple[Path, Files], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cycles with no engine tree wake nothing: the thread sleeps until its next scan (it woke every 2 s to compare
    the engine roots itself), and a tree's end is told, not looked for."""
    root, _files = scratch
    monkeypatch.setattr(shmwatch, "SCAN_EVERY_S", 3600.0)
    monkeypatch.setattr(shmwatch, "AFTER_END_S", 0.3)
    watch = shmwatch.ShmWatch(root, Path("/proc"))
    watch.start()
    try:
        assert wait_until(lambda: watch.scans_total == 1, 10)  # the scan at start
        time.sleep(0.2)
        before = wakeups(watch._thread)
        for _ in range(45):  # 4.5 s of telemetry cycles, none with an engine
            watch.observe(())
            time.sleep(0.1)
        assert wakeups(watch._thread) - before <= 1  # looking every 2 s it woke twice or more
        assert watch.scans_total == 1
        engine = Proc(4242, 1, 0, "python3", "S", 99, 0, ("VLLM::EngineCore",))
        watch.observe((EngineTree("vllm", engine, (engine,)),))
        watch.observe(())  # it ended: a scan AFTER_END_S later
        assert wait_until(lambda: watch.scans_total == 2, 10)
    finally:
        watch.stop()


def test_the_daemon_exports_the_orphans_bytes(tmp_path: Path, scratch: tuple[Path, Files]) -> None:
    """A real `sparkwatch run` over the scratch root: its first scan at start, scraped."""
    root, files = scratch
    want = held_bytes(files.orphan) + held_bytes(files.other)
    with holder(files.mapped, files.held), sparkwatch_run(tmp_path, env={"SPARKWATCH_ROOT": str(root)}) as daemon:
        text = ""

        def exported() -> bool:
            nonlocal text
            text = scrape(daemon.port)
            return "sparkwatch_shm_orphaned_bytes" in text

        assert wait_until(exported, 20, 0.2), text
        values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("sparkwatch_shm_orphaned_"))
        assert float(values["sparkwatch_shm_orphaned_bytes"]) == want, text
        assert float(values["sparkwatch_shm_orphaned_files"]) == 2


# --- an engine in Docker with --ipc=host ----------------------------------------------------------------------------

# The container's process writes the host's /dev/shm (--ipc=host) and keeps both files mapped until it is killed.
CONTAINER_ENGINE = """
import mmap, os, sys, time
views = []
for name in sys.argv[1:]:
    fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(4 << 20))
    views.append(mmap.mmap(fd, 0))
    os.close(fd)
print("ready", flush=True)
time.sleep(600)
"""


def running(dockerd: Dockerd, name: str) -> bool:
    state = dockerd.inspect(name)["State"]
    assert isinstance(state, dict)
    return bool(state["Running"])


@pytest.mark.docker
def test_a_killed_containers_shm_files_are_named_and_fixed(dockerd: Dockerd, tmp_path: Path) -> None:
    """--ipc=host, with the container's /dev/shm a scratch directory of the host (the commands' --root dev/shm): the
    files are the host's, held by the container's process until it dies, and the fix never touches the real
    /dev/shm."""
    name = f"sw-shm-{os.getpid()}"
    psm, sem = unique("psm_"), unique("sem.mp-")
    root = tmp_path / "root"
    shm = root / "dev" / "shm"
    shm.mkdir(parents=True)
    where = ("--root", str(root), "--proc-root", "/proc")
    dockerd.remove(name)
    try:
        flags = ("--ipc=host", "-v", f"{shm}:/dev/shm", "--network", "none")
        dockerd.docker(*run_args(dockerd, name, *flags, src=False), "python3", "-c", CONTAINER_ENGINE, psm, sem)
        assert wait_until(lambda: "ready" in dockerd.docker("logs", name, check=False).stdout, 30)
        check, _ = doctor_shm(tmp_path, *where)
        assert psm not in check.get("detail", "") and sem not in check.get("detail", "")  # mapped in the container
        assert (shm / psm).exists() and (shm / sem).exists()  # the host's directory
        dockerd.docker("kill", name)
        assert wait_until(lambda: not running(dockerd, name), 30)
        check, _ = doctor_shm(tmp_path, *where)
        detail = check["detail"].splitlines()
        for leftover in (psm, sem):  # the container ran as root: uid 0, which root's --fix may remove
            assert f"{leftover}: 4.0 MiB, uid 0 (removable)" in detail, check
        fixed = sparkwatch(tmp_path, *WAIT, *where, "--fix")
        assert fixed.returncode == 0 and "sparkwatch: fix: removed" in fixed.stderr, fixed.stderr
        assert not (shm / psm).exists() and not (shm / sem).exists()
    finally:
        dockerd.remove(name)
