"""meminfo and /proc parsing, on fixtures and on the real /proc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader, parse_meminfo
from sparkwatch.common.sources.procs import ProcParseError, ProcScanner, parse_cmdline, parse_stat
from tests.conftest import Spawner

FIXTURES = Path(__file__).parent / "fixtures" / "proc"


def test_gb10_idle_meminfo() -> None:
    mem = parse_meminfo((FIXTURES / "meminfo.gb10-idle").read_bytes())
    assert mem.total_bytes == 127600748 * 1024
    assert mem.available_bytes == 118566368 * 1024
    assert mem.used_bytes == (127600748 - 118566368) * 1024
    assert mem.swap_total_bytes == 0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (b"MemTotal: 100 kB\nMemFree: 50 kB\n", "missing available_bytes"),
        (b"", "missing"),
        (b"MemTotal: 100 kB\nMemFree: 50 kB\nMemAvailable: lots kB\n", "garbled MemAvailable"),
        (b"MemTotal: 100 kB\nMemFree: 50 kB\nMemAvailable: 200 kB\n", "exceeds MemTotal"),
        (b"MemTotal: 100 MB\nMemFree: 50 kB\nMemAvailable: 20 kB\n", "garbled MemTotal"),
        (b"\x00\xff\xfe garbage", "missing"),
    ],
)
def test_bad_meminfo_is_an_error_not_a_number(text: bytes, match: str) -> None:
    with pytest.raises(MeminfoError, match=match):
        parse_meminfo(text)


def test_reader_rereads_through_one_fd(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_bytes((FIXTURES / "meminfo.gb10-idle").read_bytes())
    with MeminfoReader(tmp_path) as reader:
        first = reader.read()
        # Rewrite in place (same inode): the kept-open fd sees the new text, as it does for procfs.
        text = (tmp_path / "meminfo").read_text().replace("118566368", "4839424")
        with open(tmp_path / "meminfo", "r+") as fh:
            fh.write(text)
            fh.truncate()
        assert reader.read().available_bytes == 4839424 * 1024 != first.available_bytes


def test_real_meminfo() -> None:
    with MeminfoReader() as reader:
        mem = reader.read()
    assert 0 < mem.available_bytes <= mem.total_bytes


def test_stat_with_hostile_comm() -> None:
    # comm may contain spaces and ')': earlyoom's test case `foo) Z `.
    stat = b"4242 (foo) Z ) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 777 1000000 250 184467 0"
    comm, state, ppid, _flags, start, rss = parse_stat(4242, stat)
    assert (comm, state, ppid, start, rss) == ("foo) Z ", "S", 1, 777, 250)
    with pytest.raises(ProcParseError):
        parse_stat(1, b"1 (x) S 1 2")
    with pytest.raises(ProcParseError):
        parse_stat(1, b"garbage")


def test_cmdline() -> None:
    assert parse_cmdline(b"python3\x00-m\x00vllm.entrypoints.openai.api_server\x00") == (
        "python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
    )
    assert parse_cmdline(b"") == ()
    assert parse_cmdline(b"VLLM::EngineCore   ") == ("VLLM::EngineCore   ",)


def test_scan_real_proc_finds_this_process() -> None:
    result = ProcScanner().scan()
    me = next(p for p in result.procs if p.pid == os.getpid())
    assert me.ppid == os.getppid()
    assert me.uid == os.geteuid()
    assert me.rss_bytes > 0
    assert any(p.is_kernel_thread for p in result.procs) or not Path("/proc/2").exists()


def test_scan_survives_vanishing_and_garbled_entries(tmp_path: Path) -> None:
    good = tmp_path / "100"
    good.mkdir()
    (good / "stat").write_bytes(b"100 (llama-server) S 1 100 100 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0 10 0 0")
    (good / "cmdline").write_bytes(b"llama-server\x00-m\x00x.gguf\x00")
    (tmp_path / "200").mkdir()  # vanished between listdir and read: no stat file
    bad = tmp_path / "300"
    bad.mkdir()
    (bad / "stat").write_bytes(b"300 no parens here")
    (bad / "cmdline").write_bytes(b"")
    (tmp_path / "self").mkdir()
    result = ProcScanner(tmp_path).scan()
    assert [p.pid for p in result.procs] == [100]
    assert result.procs[0].argv == ("llama-server", "-m", "x.gguf")
    assert result.vanished == 1 and result.errors == 1


# A process that execs a program of its own name: the same pid, start time and comm, a new image and argv. What a
# `python offline_infer.py` is between pytest's fork and its exec, and what any python3 -> python3 or bash -> bash is.
REEXEC = """
import os, sys
if sys.argv[1] == "first":
    print("ready", flush=True)
    sys.stdin.readline()
    os.execv(sys.executable, [sys.executable, "-c", sys.argv[2], "second", sys.argv[2]])
print("exec'd", flush=True)
sys.stdin.readline()
"""


def test_an_exec_under_the_same_name_is_read_again(spawner: Spawner) -> None:
    child = spawner.popen(
        [sys.executable, "-c", REEXEC, "first", REEXEC], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert child.stdin is not None and child.stdout is not None
    assert child.stdout.readline() == b"ready\n"
    scanner = ProcScanner()
    before = scanner.read_proc(child.pid)
    assert before is not None and before.argv[3] == "first"
    child.stdin.write(b"\n")
    child.stdin.flush()
    assert child.stdout.readline() == b"exec'd\n"
    after = scanner.read_proc(child.pid)
    assert after is not None and (after.pid, after.start_ticks, after.comm) == (
        child.pid,
        before.start_ticks,
        before.comm,
    )
    assert after.argv[3] == "second", "the argv of the image before exec was kept"


def _stat(pid: int, comm: str, arg_start: int, arg_end: int) -> bytes:
    """A stat line of a 6.x kernel (52 fields): start time 5, RSS 10 pages, the argv span in fields 48-49."""
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "0"] + ["0"] * 12 + ["5", "0", "10"] + ["0"] * 30
    fields[45], fields[46] = str(arg_start), str(arg_end)
    return f"{pid} ({comm}) {' '.join(fields)}".encode()


def test_the_argv_cache_holds_per_image_and_title(tmp_path: Path) -> None:
    """The exec window as the kernel shows it (begin_new_exec has set comm; create_elf_tables has not yet set
    arg_start/arg_end, so cmdline reads empty), then the image settled, then a title, then a same-named exec."""
    proc = tmp_path / "100"
    proc.mkdir()
    scanner = ProcScanner(tmp_path)

    def show(comm: str, span: tuple[int, int], cmdline: bytes) -> tuple[str, ...]:
        (proc / "stat").write_bytes(_stat(100, comm, *span))
        (proc / "cmdline").write_bytes(cmdline)
        seen = scanner.read_proc(100)
        assert seen is not None
        return seen.argv

    assert show("tail", (0, 0), b"") == ()  # in the exec window: not cached
    assert show("tail", (4000, 4020), b"tail\x00-f\x00vllm.log\x00") == ("tail", "-f", "vllm.log")
    # the same image and title: the cached argv (cmdline is not read again)
    assert show("tail", (4000, 4020), b"changed\x00") == ("tail", "-f", "vllm.log")
    assert show("VLLM::EngineCor", (4000, 4020), b"VLLM::EngineCore\x00") == ("VLLM::EngineCore",)  # a new title
    assert show("VLLM::EngineCor", (9000, 9030), b"VLLM::EngineCore\x00-x\x00") == ("VLLM::EngineCore", "-x")


def test_a_stat_without_the_argv_span_falls_back_to_comm(tmp_path: Path) -> None:
    """An older kernel's stat (44 fields, as in the fixture above): comm alone tells an image from the next."""
    proc = tmp_path / "100"
    proc.mkdir()
    (proc / "stat").write_bytes(b"100 (llama-server) S 1 100 100 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0 10 0 0")
    (proc / "cmdline").write_bytes(b"llama-server\x00")
    scanner = ProcScanner(tmp_path)
    assert (first := scanner.read_proc(100)) is not None and first.argv == ("llama-server",)
    (proc / "cmdline").write_bytes(b"other\x00")
    assert (again := scanner.read_proc(100)) is not None and again.argv == ("llama-server",)
