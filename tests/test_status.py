"""`sparkwatch status` as a real command: real fake-engine trees, a real nvcc build, a fixture meminfo.

The fixture meminfo is bind-mounted over /proc/meminfo in a private mount namespace (`unshare --mount`), the way
LXCFS presents a container its own meminfo. Everything else the command reads is this machine's real /proc, so the
engine tree, the compilers and their environments are real processes, and the product needs no test-only flag.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, make_event
from sparkwatch.common.sources.procs import read_children
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.units import GiB
from sparkwatch.tui.status_view import FLOOR_MARK, WARN_MARK
from tests.conftest import require, require_tool, rewrite_in_place
from tests.helpers.engine_tree import staged_engine
from tests.helpers.jit_build import flashinfer_module

GB10_TOTAL_KB = 127600748  # a GB10's MemTotal, as a real one reads it
STATUS = [sys.executable, "-m", "sparkwatch", "status"]
# Runs the rest of the command line with $0 bind-mounted over /proc/meminfo, in a mount namespace of its own.
UNSHARE = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "--",
    "sh",
    "-c",
    'mount --bind "$0" /proc/meminfo && exec "$@"',
]


def write_meminfo(path: Path, available_bytes: int, cached_bytes: int = 3 * GiB) -> None:
    """GB10-shaped meminfo, fixed-width numbers rewritten in place (readers keep the file open)."""
    text = (
        f"MemTotal:       {GB10_TOTAL_KB:>12} kB\n"
        f"MemFree:        {(available_bytes - cached_bytes) // 1024:>12} kB\n"
        f"MemAvailable:   {available_bytes // 1024:>12} kB\n"
        f"Buffers:        {61372:>12} kB\n"
        f"Cached:         {cached_bytes // 1024:>12} kB\n"
        f"SwapTotal:      {0:>12} kB\n"
        f"SwapFree:       {0:>12} kB\n"
    )
    rewrite_in_place(path, text)


@pytest.fixture(scope="module")
def mount_namespace() -> None:
    require_tool("unshare")
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "true"], check=False, capture_output=True, text=True
    )
    require(probe.returncode == 0, f"cannot make a mount namespace for the fixture meminfo: {probe.stderr.strip()}")


def status_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_") and k != "MAX_JOBS"}
    env.update(
        SPARKWATCH_ANCESTOR_PID=str(os.getpid()),  # only this test's engines; others run tests on this machine too
        SPARKWATCH_JIT_CACHE_DIRS=json.dumps([str(home / ".cache" / "flashinfer")]),
        SPARKWATCH_VLLM_CACHE_DIRS="[]",
        SPARKWATCH_STATE_DIR=str(home / "state"),
        XDG_RUNTIME_DIR=str(home / "run"),  # where a guard of this test would publish its state (guard.json)
        HOME=str(home),
        TZ="UTC",
    )
    env.update(extra)
    return env


def tree_comms(root: int) -> dict[int, str]:
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        nxt = []
        for pid in frontier:
            for child in read_children("/proc", pid) or []:
                try:
                    out[child] = Path(f"/proc/{child}/comm").read_text().strip()
                except OSError:
                    continue
                nxt.append(child)
        frontier = nxt
    return out


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    assert callable(predicate)
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def section(out: str, label: str) -> list[str]:
    """The lines of one section: the labelled line and its continuation lines."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(label))
    body = [lines[start][len(label) :].strip()]
    for line in lines[start + 1 :]:
        if line[:1] != " ":
            break
        body.append(line.strip())
    return body


def test_once_during_a_real_nvcc_build(tmp_path: Path, mount_namespace: None) -> None:
    require_tool("nvcc")
    require_tool("ninja")
    module_dir = flashinfer_module(tmp_path)
    meminfo = tmp_path / "meminfo"
    write_meminfo(meminfo, 10 * GiB)  # 2 GiB above the 8 GiB floor: inside the 4 GiB warn band
    kill_ts = time.time() - 3 * 3600
    EventLog(tmp_path / "state" / "events.jsonl").append(
        make_event(
            EventKind.KILL,
            "Killed vllm (root pid 4242, 9 processes): MemAvailable 4726 MiB <= floor 8192 MiB.",
            {"dry_run": False},
            ts=kill_ts,
            node="spark-a",
        )
    )
    env = status_env(tmp_path)
    # The engine's environment, inherited by ninja and nvcc: what the MAX_JOBS check must find.
    engine_env = {**env, "MAX_JOBS": "2"}
    small_o = module_dir / "norm_small.cuda.o"
    heavy_o = module_dir / "norm_heavy.cuda.o"
    with staged_engine(
        children=("VLLM::Worker_TP0",),
        extra=["--hold-mib", "16", "--spawn-cwd", str(module_dir)],
        command=["ninja", "-j2"],
        env=engine_env,
    ) as engine:
        root = engine.root_pid
        # One object done, the heavy one still in cicc/ptxas: a build in progress.
        wait_for(lambda: small_o.exists() and small_o.stat().st_size > 0, 90, "the small object")
        wait_for(lambda: {"cicc", "ptxas"} & set(tree_comms(root).values()), 30, "the heavy compile")
        during = subprocess.run(
            [*UNSHARE, str(meminfo), *STATUS, "--once"],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        still_compiling = not heavy_o.exists()
        wait_for((module_dir / "rmsnorm.so").exists, 180, "the module to link")
        wait_for(lambda: "ninja" not in tree_comms(root).values(), 10, "ninja to exit")
        after = subprocess.run(
            [*UNSHARE, str(meminfo), *STATUS, "--once"],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert still_compiling, "the heavy object finished before the frame was taken; make it heavier"
    assert during.returncode == 0, during.stderr
    assert "Traceback" not in during.stderr
    out = during.stdout
    assert "\x1b[" not in out  # plain text on a pipe
    assert out.splitlines()[0].startswith("sparkwatch status · ")

    pool = section(out, "POOL")
    assert FLOOR_MARK in pool[0] and WARN_MARK in pool[0]
    assert pool[0].index(WARN_MARK) < pool[0].index(FLOOR_MARK)
    assert pool[1] == "used 112 GiB · page cache 3.1 GiB · available 10.0 GiB of 122 GiB"
    assert pool[2].startswith(f"{FLOOR_MARK} floor 8.0 GiB (2.0 GiB above)  {WARN_MARK} warn at 12.0 GiB")
    assert pool[3].startswith("fill rate: measuring")  # one frame, one sample: no rate is claimed

    engines = section(out, "ENGINES")
    assert len(engines) == 1
    assert engines[0].startswith(f"vllm {root} · VLLM::EngineCore · ")
    assert " · JIT compiling" in engines[0]

    # Node-wide counts include other people's builds on this shared machine; the engine's own line is ours alone.
    compilers = section(out, "COMPILERS")
    assert "parallel nvcc/cicc jobs" in compilers[1] and "arch 121a" in compilers[1]
    (mine,) = [line for line in compilers if line.startswith(f"vllm {root}: ")]
    assert "ninja 1" in mine and "nvcc 1" in mine and ("cicc 1" in mine or "ptxas 1" in mine)
    assert mine.endswith(" · MAX_JOBS=2 (from the compiler's environment)")

    (jit,) = section(out, "JIT")
    assert jit.startswith("flashinfer 0.2.8 121a  ")
    assert " 1/2 objects · 0/1 modules · rate: measuring · changed " in jit

    gpu = section(out, "GPU")
    assert gpu[0].startswith(("GPU not available", "no GPU source", "NVIDIA"))  # no GPU here: said, not crashed
    (kill,) = section(out, "LAST KILL")
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(kill_ts))
    assert kill.startswith(f"{stamp} (3h00m ago)  Killed vllm (root pid 4242, 9 processes)")

    assert after.returncode == 0, after.stderr
    (jit_after,) = section(after.stdout, "JIT")
    assert " 2/2 objects · 1/1 modules · done" in jit_after
    assert not [line for line in section(after.stdout, "COMPILERS") if line.startswith(f"vllm {root}: ")]
    assert section(after.stdout, "ENGINES")[0].startswith(f"vllm {root} · ")


def test_once_degrades_with_nothing_to_show(tmp_path: Path) -> None:
    # No engines (under this pytest process), no caches, no events, no GPU on this machine: every row says so.
    env = status_env(tmp_path)
    result = subprocess.run([*STATUS, "--once"], check=False, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert section(out, "ENGINES") == ["no engine processes"]
    # No guard runs for this state and runtime dir (a dead guard's file would be stale, never "running").
    assert section(out, "GUARD") == ["no guard is running: nothing is killed before the pool runs out"]
    compilers = section(out, "COMPILERS")
    # Other people's builds may run on this shared machine: then they are all counted outside any engine.
    if compilers != ["no compiler processes"]:
        total = int(compilers[0].split()[0])
        assert compilers[1].endswith(f" · {total} outside any engine") and len(compilers) == 2
    assert section(out, "JIT") == ["no JIT caches found"]
    assert section(out, "LAST KILL") == [f"none recorded in {tmp_path / 'state' / 'events.jsonl'}"]
    assert section(out, "GPU")[0]
    assert "ERRORS" not in out
    # It reads only: the state directory it was pointed at was not created.
    assert not (tmp_path / "state").exists()


def test_bad_config_is_exit_2(tmp_path: Path) -> None:
    env = status_env(tmp_path, SPARKWATCH_FLOOR="lots")
    result = subprocess.run([*STATUS, "--once"], check=False, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2
    assert "floor" in result.stderr and "Traceback" not in result.stderr


@pytest.fixture
def ctrl_c_reaches_children() -> Iterator[None]:
    """A suite started as a background job of a script (`nohup scripts/test &`) inherits SIGINT ignored, and so would
    the viewer: Python then installs no Ctrl-C handler and the test's Ctrl-C does nothing (both live tests timed out
    that way). A handler here is reset to the default at exec, so the viewer gets a working Ctrl-C."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


@pytest.fixture
def pty_pair() -> Iterator[tuple[int, int]]:
    main_fd, sub_fd = pty.openpty()
    # 120 columns, 60 rows: the whole frame fits, so rich redraws it in place rather than cropping.
    fcntl_winsize = struct.pack("HHHH", 60, 120, 0, 0)
    import fcntl

    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, fcntl_winsize)
    try:
        yield main_fd, sub_fd
    finally:
        for fd in (main_fd, sub_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def read_for(fd: int, seconds: float) -> bytes:
    chunks = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        try:
            data = os.read(fd, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def read_until(fd: int, needle: bytes, timeout_s: float) -> bytes:
    """Read until `needle` has appeared (a start-up on a loaded machine can take seconds), bounded by timeout_s."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while needle not in data and time.monotonic() < deadline:
        data += read_for(fd, 0.1)
    return data


def test_live_frames_update_in_place(
    tmp_path: Path, mount_namespace: None, pty_pair: tuple[int, int], ctrl_c_reaches_children: None
) -> None:
    main_fd, sub_fd = pty_pair
    meminfo = tmp_path / "meminfo"
    available = 40 * GiB
    write_meminfo(meminfo, available)
    env = status_env(tmp_path, TERM="xterm-256color", COLUMNS="120", LINES="60")
    proc = subprocess.Popen(
        [*UNSHARE, str(meminfo), *STATUS, "--interval", "0.3"],
        stdin=sub_fd,
        stdout=sub_fd,
        stderr=sub_fd,
        env=env,
        start_new_session=True,
    )
    try:
        # The drain starts only once the first full frame is on the screen, however slow the start-up.
        first = read_until(main_fd, b"available 40.0 GiB", 30)
        assert b"available 40.0 GiB" in first, first[-2000:]
        # The pool drains 1 GiB every 0.2 s: about 5 GiB/s, a start-up spike's order of magnitude (a real one on a
        # Spark went 34 -> 12.7 GiB in ~1.5 s).
        stream = [first]
        for _ in range(12):
            available -= GiB
            write_meminfo(meminfo, available)
            stream.append(read_for(main_fd, 0.2))
        stream.append(read_for(main_fd, 0.7))
        os.kill(proc.pid, signal.SIGINT)  # our own child: Ctrl-C
        rc = proc.wait(10)
        stream.append(read_for(main_fd, 0.3))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = b"".join(stream).decode(errors="replace")
    assert rc == 0
    frames = text.count("sparkwatch status · ")
    assert frames >= 6, text[-2000:]
    assert "\x1b[?1049h" not in text  # never the alternate screen: the last frame stays in the scrollback
    assert "\x1b[1A" in text  # redrawn in place: cursor up over the previous frame
    assert "\x1b[" in text and "Ctrl-C quits" in text
    # The frames changed with the pool: the first and the last available figures differ, and the drain was seen.
    assert "available 40.0 GiB" in text
    assert f"available {available / GiB:.1f} GiB" in text
    assert "fill rate: falling" in text and "floor in" in text
    # Light over SSH: a redraw is a few KiB (colour codes included), once per interval.
    per_frame = len(text.encode()) / frames
    print(f"{frames} frames, {per_frame:.0f} bytes per frame")
    assert per_frame < 8192


def test_q_ends_the_live_view_and_gives_the_terminal_back(tmp_path: Path, pty_pair: tuple[int, int]) -> None:
    """A keypress q ends the live view, as in top and less; the terminal's modes are as they were before."""
    main_fd, sub_fd = pty_pair
    before = termios.tcgetattr(sub_fd)
    env = status_env(tmp_path, TERM="xterm-256color", COLUMNS="120", LINES="60")
    proc = subprocess.Popen(
        [*STATUS, "--interval", "0.5"], stdin=sub_fd, stdout=sub_fd, stderr=sub_fd, env=env, start_new_session=True
    )
    try:
        first = read_until(main_fd, b"q or Ctrl-C quits", 30)
        assert b"q or Ctrl-C quits" in first, first[-2000:]
        os.write(main_fd, b"x")  # any other key: the view goes on
        read_for(main_fd, 0.8)
        assert proc.poll() is None
        os.write(main_fd, b"q")
        rc = proc.wait(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 0
    assert termios.tcgetattr(sub_fd) == before  # cbreak mode undone: echo and line editing are back


def test_live_build_progress_gets_a_rate_and_an_eta(
    tmp_path: Path, pty_pair: tuple[int, int], ctrl_c_reaches_children: None
) -> None:
    """The "is it hung?" row over time: objects finishing give a rate and an ETA, then the module is done."""
    require_tool("nvcc")
    require_tool("ninja")
    main_fd, sub_fd = pty_pair
    module_dir = flashinfer_module(tmp_path)
    env = status_env(tmp_path, TERM="xterm-256color", COLUMNS="120", LINES="60")
    # The viewer starts first, so it sees the count go 0 -> 1 -> 2 and can time it.
    viewer = subprocess.Popen(
        [*STATUS, "--interval", "0.5"], stdin=sub_fd, stdout=sub_fd, stderr=sub_fd, env=env, start_new_session=True
    )
    chunks = []
    try:
        chunks.append(read_for(main_fd, 1.5))
        with staged_engine(
            children=(), extra=["--spawn-cwd", str(module_dir)], command=["ninja", "-j2"], env={**env, "MAX_JOBS": "2"}
        ):
            deadline = time.monotonic() + 180
            while not (module_dir / "rmsnorm.so").exists():
                assert time.monotonic() < deadline, "the build did not finish"
                chunks.append(read_for(main_fd, 0.5))
            chunks.append(read_for(main_fd, 2.0))
        os.kill(viewer.pid, signal.SIGINT)
        rc = viewer.wait(10)
    finally:
        if viewer.poll() is None:
            viewer.kill()
            viewer.wait()
    text = b"".join(chunks).decode(errors="replace")
    assert rc == 0
    assert " 0/2 objects · 0/1 modules" in text
    assert " 1/2 objects · 0/1 modules · " in text
    # Once the first object lands the row has a pace and a time left, not just a count.
    assert re.search(r" 1/2 objects · 0/1 modules · \d+\.\d objects/min · ETA \d", text), text[-3000:]
    assert " 2/2 objects · 1/1 modules · done" in text


def test_gpu_preflight_does_not_hold_up_the_cycle_and_its_verdict_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """status starts NVML's preflight child at once and waits for it at the GPU read, the cycle's last; a preflight
    child that hangs (a real one, blocked as a hung dlopen would leave it) still keeps NVML off, and is reaped."""
    from sparkwatch.cli.status import PreflightedGpu
    from sparkwatch.telemetry.sources import nvml_preflight

    monkeypatch.setattr(nvml_preflight, "_CHILD", "import time\ntime.sleep(60)\n")
    monkeypatch.setattr(nvml_preflight, "PREFLIGHT_TIMEOUT_S", 1.0)
    gpu = PreflightedGpu(Path("/proc"))
    child = gpu._preflight.proc
    assert child is not None
    try:
        assert child.poll() is None  # built without waiting for the verdict
        report = gpu.collect()
        assert not report.up
        assert (
            report.error
            == f"NVML off: {nvml_preflight.LIBRARY} did not load and initialise within 1 s (hung library or driver?)"
        )
        assert child.returncode is not None  # killed and reaped
    finally:
        gpu.close()
        if child.poll() is None:
            child.kill()
            child.wait()
