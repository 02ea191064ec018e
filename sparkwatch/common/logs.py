"""Logging: stdlib `logging` under the "sparkwatch" logger, one handler per process.

- Under systemd (stderr is the journal's stream, $JOURNAL_STREAM matches) `JournalHandler` sends each record with
  journald's native protocol: MESSAGE, PRIORITY (from the level), SYSLOG_IDENTIFIER=sparkwatch, SPARKWATCH_PROCESS
  (guard or telemetry) and CODE_FILE/CODE_LINE/CODE_FUNC, so `journalctl --user -u sparkwatch -p err` works. A send
  that fails goes to stderr instead (prefixed `<N>` so the journal still gets the priority) and is counted.
- Otherwise `StderrHandler`: one plain line per record on stderr.

Every line reads `sparkwatch: <message>`, so `journalctl --user -u sparkwatch | grep KILL` keeps finding
`sparkwatch: KILL vllm tree root=…`.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from sparkwatch.common.systemd import JOURNAL_SOCKET, encode_native, stderr_is_journal
from sparkwatch.core.redact import redact, safe_text

LOGGER_NAME = "sparkwatch"
PREFIX = "sparkwatch: "


def syslog_priority(level: int) -> int:
    if level >= logging.CRITICAL:
        return 2
    if level >= logging.ERROR:
        return 3
    if level >= logging.WARNING:
        return 4
    if level >= logging.INFO:
        return 6
    return 7


def line_of(record: logging.LogRecord) -> str:
    """The one line a record becomes, on stderr and in the journal alike: redacted (tokens in a process title, the
    webhook's URL and secret) and on one line (a title with a newline cannot forge a `sparkwatch: KILL` line)."""
    message = safe_text(redact(record.getMessage()))
    return message if message.startswith(PREFIX) else PREFIX + message


class StderrHandler(logging.Handler):
    """Plain lines on stderr; `<N>` syslog-priority prefixes when stderr is the journal (`journal=True`)."""

    def __init__(self, stream: TextIO | None = None, *, journal: bool = False) -> None:
        super().__init__()
        self.stream = stream
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        stream = self.stream or sys.stderr
        prefix = f"<{syslog_priority(record.levelno)}>" if self.journal else ""
        try:
            stream.write(prefix + line_of(record) + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # stderr gone (journald restarting): the event log still has what matters


class JournalHandler(logging.Handler):
    """Records as native journal entries with PRIORITY. Never blocks for long: a 1 s send timeout."""

    def __init__(self, process: str, socket_path: Path = JOURNAL_SOCKET, fallback: StderrHandler | None = None) -> None:
        super().__init__()
        self.process = process
        self.socket_path = socket_path
        self.fallback = fallback or StderrHandler(journal=True)
        self.send_errors_total = 0
        self._sock: socket.socket | None = None

    def emit(self, record: logging.LogRecord) -> None:
        fields = [
            ("MESSAGE", line_of(record)),
            ("PRIORITY", str(syslog_priority(record.levelno))),
            ("SYSLOG_IDENTIFIER", "sparkwatch"),
            ("SPARKWATCH_PROCESS", self.process),
            ("CODE_FILE", record.pathname),
            ("CODE_LINE", str(record.lineno)),
            ("CODE_FUNC", record.funcName),
        ]
        try:
            self.acquire()
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                    self._sock.settimeout(1.0)
                self._sock.sendto(encode_native(fields), str(self.socket_path))
            finally:
                self.release()
        except OSError:
            self.send_errors_total += 1
            self.fallback.emit(record)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        super().close()


def setup(process: str, env: Mapping[str, str] | None = None, stream: TextIO | None = None) -> logging.Handler:
    """Install this process's one handler on the "sparkwatch" logger and return it (for its counters)."""
    env = dict(os.environ if env is None else env)
    out = stream or sys.stderr
    handler: logging.Handler
    if stderr_is_journal(env, out) and JOURNAL_SOCKET.exists():
        handler = JournalHandler(process, fallback=StderrHandler(stream, journal=True))
    else:
        handler = StderrHandler(stream, journal=stderr_is_journal(env, out))
    logger = logging.getLogger(LOGGER_NAME)
    for old in list(logger.handlers):
        logger.removeHandler(old)
        old.close()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


def send_errors_total(handler: logging.Handler | None) -> int:
    return handler.send_errors_total if isinstance(handler, JournalHandler) else 0


def get(name: str) -> logging.Logger:
    """`sparkwatch.<name>`: every module logs through a child of the one configured logger."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def _install_default() -> None:
    """Until a process calls setup() (library use, tests), INFO and above go to stderr as plain lines."""
    logger = logging.getLogger(LOGGER_NAME)
    if not logger.handlers:
        logger.addHandler(StderrHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False


_install_default()
