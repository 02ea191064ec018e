"""Logging: a real journal socket gets PRIORITY from the level; stderr lines keep the greppable form."""

from __future__ import annotations

import io
import logging
import socket
from pathlib import Path

from sparkwatch.common import logs
from sparkwatch.common.systemd import decode_native


def test_journal_handler_sets_priority_and_keeps_the_kill_line(tmp_path: Path) -> None:
    path = tmp_path / "journal.socket"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind(str(path))
        rx.settimeout(5)
        handler = logs.JournalHandler("guard", socket_path=path)
        logger = logging.getLogger("sparkwatch.test-journal")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            logger.error("sparkwatch: KILL vllm tree root=1234 (9 processes): MemAvailable 4726 MiB")
            logger.warning("mlockall not permitted")
            logger.info("running: floor 8192 MiB")
            got = [dict(decode_native(rx.recv(65536))) for _ in range(3)]
        finally:
            logger.removeHandler(handler)
            handler.close()
    assert got[0]["MESSAGE"] == "sparkwatch: KILL vllm tree root=1234 (9 processes): MemAvailable 4726 MiB"
    assert [g["PRIORITY"] for g in got] == ["3", "4", "6"]
    assert all(g["SYSLOG_IDENTIFIER"] == "sparkwatch" and g["SPARKWATCH_PROCESS"] == "guard" for g in got)
    assert handler.send_errors_total == 0


def test_journal_handler_falls_back_to_stderr_and_counts(tmp_path: Path) -> None:
    err = io.StringIO()
    handler = logs.JournalHandler(
        "telemetry", socket_path=tmp_path / "absent.socket", fallback=logs.StderrHandler(err, journal=True)
    )
    logger = logging.getLogger("sparkwatch.test-fallback")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.error("telemetry cycle failed: boom")
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert err.getvalue() == "<3>sparkwatch: telemetry cycle failed: boom\n"
    assert handler.send_errors_total == 1


def test_plain_stderr_without_a_journal() -> None:
    err = io.StringIO()
    handler = logs.setup("guard", env={}, stream=err)
    try:
        assert isinstance(handler, logs.StderrHandler)
        logs.get("daemon").info("running: floor %d MiB", 8192)
        logs.get("guard").error("ERROR could not record kill event: disk full")
    finally:
        logs.setup("guard", env={})  # back to the process's own stderr for the tests that follow
    assert err.getvalue().splitlines() == [
        "sparkwatch: running: floor 8192 MiB",
        "sparkwatch: ERROR could not record kill event: disk full",
    ]
