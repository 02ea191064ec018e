"""Counts as people read them: "1 process", "2 processes". The one plural rule for every line sparkwatch prints."""

from __future__ import annotations

_IRREGULAR = {"process": "processes", "is": "are", "was": "were"}


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`plural(1, "process")` -> "1 process"; `plural(3, "process")` -> "3 processes"; `plural(2, "job")`: "2 jobs"."""
    if count == 1:
        return f"{count} {noun}"
    head, _, last = noun.rpartition(" ")  # "engine process": only the last word takes the plural
    word = many or _IRREGULAR.get(last) or last + "s"
    return f"{count} {head + ' ' if head else ''}{word}"
