"""A process's watch over itself: its resident set, and the cap past which the guard restarts itself.

The guard's RSS is about 20 MiB, all of it locked (mlockall), so whatever it grows by is memory the box cannot
reclaim. A guard over `GUARD_RSS_CAP_BYTES` has a bug (a leak, a peer it trusted too much): it says so and restarts
itself in place (guard.process), which costs about half a second unguarded, instead of holding locked memory that
grows until the unit's MemoryMax kills it at the worst moment.
"""

from __future__ import annotations

import os

# Three times the measured guard (bench/RESULTS-idle.md: under 22 MiB idle, ~25 MiB near the floor with the scout's
# argv cache warm): far above any healthy reading, far below the unit's MemoryMax=160M.
GUARD_RSS_CAP_BYTES = 64 << 20


def rss_bytes(pid: int | None = None) -> int:
    """A process's resident set (VmRSS, from statm), this one's by default; 0 if unreadable."""
    try:
        with open(f"/proc/{pid or os.getpid()}/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
