"""meminfo and /proc parsing, on fixtures and on the real /proc."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader, parse_meminfo
from sparkwatch.common.sources.procs import ProcParseError, ProcScanner, parse_cmdline, parse_stat

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
