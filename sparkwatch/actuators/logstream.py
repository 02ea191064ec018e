"""The daemon's stderr (its log, which the journal keeps) with every line passed through `redact`.

Installed once by `sparkwatch run` as sys.stderr: every component logs with print(..., file=sys.stderr), so no log
line, however it was built (an exception text, a process title, a URL), leaves without redaction and with its own
control characters: a title cannot forge a `sparkwatch: KILL` line with an embedded newline.
"""

from __future__ import annotations

import threading
from typing import TextIO

from sparkwatch.core.redact import redact


class RedactingStream:
    """A text stream that redacts each line and writes it to `inner`; newlines are kept, other controls cut."""

    def __init__(self, inner: TextIO) -> None:
        self.inner = inner
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        cleaned = "\n".join(redact(part) for part in text.split("\n"))
        with self._lock:
            self.inner.write(cleaned)
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def fileno(self) -> int:
        return self.inner.fileno()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)
