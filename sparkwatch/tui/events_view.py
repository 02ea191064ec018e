"""`sparkwatch events`: one line per event, local time, kind, summary, columns aligned."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, tzinfo
from typing import Any

from sparkwatch.core.redact import safe_text

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def local_time(ts: object, tz: tzinfo | None = None) -> str:
    """RFC 3339 (`2026-11-29T10:02:03.123Z`) as local wall-clock time; what it was, unchanged, if unparsable."""
    if not isinstance(ts, str):
        return "?"
    try:
        parsed = datetime.fromisoformat(ts)
    except ValueError:
        return ts
    if parsed.tzinfo is None:
        return parsed.strftime(TIME_FORMAT)  # no zone given: show as written rather than guess
    return parsed.astimezone(tz).strftime(TIME_FORMAT)


def _one_line(text: str) -> str:
    return safe_text(" ".join(text.split()))


def event_lines(events: Sequence[Mapping[str, Any]], tz: tzinfo | None = None) -> list[str]:
    """Aligned lines `TIME  KIND  SUMMARY`, oldest first; a summary never spans two lines."""
    rows = [
        (local_time(e.get("ts"), tz), _one_line(str(e.get("kind", "?"))), _one_line(str(e.get("summary", ""))))
        for e in events
    ]
    if not rows:
        return []
    kind_width = max(len("KIND"), *(len(k) for _, k, _ in rows))
    time_width = max(len("TIME"), *(len(t) for t, _, _ in rows))
    out = [f"{'TIME':<{time_width}}  {'KIND':<{kind_width}}  SUMMARY"]
    out.extend(f"{t:<{time_width}}  {k:<{kind_width}}  {s}".rstrip() for t, k, s in rows)
    return out
