"""The daemon's signals, in one place: `sparkwatch run` blocks them before it imports anything (sparkwatch.entry), and
the guard process installs its handlers and only then unblocks them (guard.process)."""

from __future__ import annotations

import signal

DAEMON_SIGNALS = frozenset({signal.SIGHUP, signal.SIGTERM, signal.SIGINT})
