"""The one start/stop/reload sequence both processes use for their parts (sparkwatch/common/lifecycle.py)."""

from __future__ import annotations

import logging

import pytest

from sparkwatch.common.lifecycle import Component as Part
from sparkwatch.common.lifecycle import apply_all as apply_parts
from sparkwatch.common.lifecycle import start_all as start_parts
from sparkwatch.common.lifecycle import stop_all as stop_parts


class Recorder:
    def __init__(self, name: str, journal: list[str], *, fail_start: bool = False, fail_stop: bool = False) -> None:
        self.name, self.journal, self.fail_start, self.fail_stop = name, journal, fail_start, fail_stop

    def start(self) -> None:
        if self.fail_start:
            raise OSError(f"{self.name} cannot start")
        self.journal.append(f"start {self.name}")

    def stop(self) -> None:
        self.journal.append(f"stop {self.name}")
        if self.fail_stop:
            raise RuntimeError(f"{self.name} cannot stop")


def parts(journal: list[str], **flags: dict[str, bool]) -> list[Part[int]]:
    return [Part(name, Recorder(name, journal, **flags.get(name, {}))) for name in ("a", "b", "c")]


def test_a_part_that_fails_to_start_is_left_out_and_the_rest_start(caplog: pytest.LogCaptureFixture) -> None:
    journal: list[str] = []
    with caplog.at_level(logging.ERROR):
        started = start_parts(parts(journal, b={"fail_start": True}))
    assert [p.name for p in started] == ["a", "c"]
    assert journal == ["start a", "start c"]
    assert "b did not start: b cannot start; running without it" in caplog.text


def test_an_essential_part_that_fails_stops_what_started_and_raises() -> None:
    journal: list[str] = []
    with pytest.raises(OSError, match="c cannot start"):
        start_parts(parts(journal, c={"fail_start": True}), essential={"c"})
    assert journal == ["start a", "start b", "stop b", "stop a"]


def test_stop_is_in_reverse_and_one_failure_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    journal: list[str] = []
    started = start_parts(parts(journal, b={"fail_stop": True}))
    with caplog.at_level(logging.ERROR):
        stop_parts(started)
    assert journal[3:] == ["stop c", "stop b", "stop a"]
    assert "stopping b: b cannot stop" in caplog.text


def test_apply_collects_keys_per_part_skips_and_reports_failures() -> None:
    def boom(_settings: int) -> object:
        raise ValueError("bad value")

    noop = Recorder("x", [])
    plan: list[Part[int]] = [
        Part("live", noop, frozenset({"floor"}), apply_settings=lambda s: None),
        Part("chooses", noop, frozenset({"a", "b"}), apply_settings=lambda s: {"a"} if s > 1 else set()),
        Part("fails", noop, frozenset({"z"}), apply_settings=boom),
        Part("remote", noop, frozenset({"r"}), apply_settings=lambda s: {"r"}),
        Part("static", noop),
    ]
    applied, errors = apply_parts(plan, 2, skip={"remote"})
    assert applied == {"live": {"floor"}, "chooses": {"a"}, "static": frozenset()}
    assert errors == ["fails could not apply the new config: bad value"]
