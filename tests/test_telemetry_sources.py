"""Small source parsers of the telemetry: PSI and environ."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.common.sources.psi import PsiParseError, parse_psi, read_psi
from sparkwatch.telemetry.loop import Telemetry
from sparkwatch.telemetry.sources.procenv import EnvironReader, read_wchan
from tests.helpers.scenario import build_scenario


def test_parse_psi_some_and_full() -> None:
    psi = parse_psi(b"some avg10=1.00 avg60=0.50 avg300=0.10 total=987654\nfull avg10=0 avg60=0 avg300=0 total=12\n")
    assert (psi.some_us, psi.full_us) == (987654, 12)


def test_parse_psi_without_full_line() -> None:
    psi = parse_psi(b"some avg10=0.00 avg60=0.00 avg300=0.00 total=5\n")
    assert (psi.some_us, psi.full_us) == (5, None)


@pytest.mark.parametrize("data", [b"", b"garbage\n", b"some avg10=0.00 total=abc\n"])
def test_parse_psi_garbage(data: bytes) -> None:
    with pytest.raises(PsiParseError):
        parse_psi(data)


def test_real_psi_is_read_or_absent() -> None:
    psi = read_psi(Path("/proc"))
    assert psi is None or psi.some_us >= 0


def test_garbled_psi_fails_only_psi(tmp_path: Path) -> None:
    settings = build_scenario(tmp_path)
    (settings.proc_root / "pressure" / "memory").write_text("what\n")
    snap = Telemetry(settings).collect()
    status = {c.name: c for c in snap.collectors}
    assert not status["psi"].success and status["psi"].error is not None and "some" in status["psi"].error
    assert status["meminfo"].success and snap.mem is not None and snap.compile is not None


def test_environ_reader_on_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SW_TEST_MARKER", "x")  # not in our environ at exec time: environ is the start state
    reader = EnvironReader(Path("/proc"), ["PATH", "SW_TEST_MARKER", "SPARKWATCH_NOT_SET_ANYWHERE"])
    ticks = read_start_ticks("/proc", os.getpid())
    assert ticks is not None
    values = reader.read(os.getpid(), ticks)
    assert values is not None and set(values) == {"PATH"}
    assert reader.read(999_999_999, 1) is None  # no such process: unknown, no exception
    assert read_wchan("/proc", 999_999_999) is None
