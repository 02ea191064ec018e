"""Which boot this is and when it started: <proc_root>/sys/kernel/random/boot_id, and btime in <proc_root>/stat.

The journal names boots by the same id, written as 32 lowercase hex digits without dashes (sd-id128): that is the
form kept here, so a recorder file, the postmortem's state and `journalctl --list-boots` compare as equal strings.
"""

from __future__ import annotations

from pathlib import Path


def normalize_boot_id(text: str) -> str | None:
    """`8f0e…-…` or `8f0e…` as 32 lowercase hex digits; None for anything else."""
    value = text.strip().replace("-", "").lower()
    if len(value) != 32 or any(c not in "0123456789abcdef" for c in value):
        return None
    return value


def read_boot_id(proc_root: Path) -> str | None:
    """This boot's id, or None where the file is missing or garbled (a fixture /proc)."""
    try:
        text = (proc_root / "sys" / "kernel" / "random" / "boot_id").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return normalize_boot_id(text)


def read_boot_time(proc_root: Path) -> float | None:
    """When this boot started (unix seconds, the `btime` line of /proc/stat), or None where unreadable."""
    try:
        with open(proc_root / "stat", "rb") as fh:
            data = fh.read(1 << 20)  # the intr line alone is tens of KiB on a big box
    except OSError:
        return None
    for line in data.splitlines():
        if line.startswith(b"btime "):
            value = line.split()[1]
            return float(value) if value.isdigit() else None
    return None
