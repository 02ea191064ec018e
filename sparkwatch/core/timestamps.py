"""RFC 3339 timestamps in UTC, as the event log writes them and the previous boot's reader parses them back.

Without datetime: its module is 0.7 MiB resident in each daemon process (the guard's all mlocked) for these two lines
(bench/RESULTS-rss-gpu.md). Each is held equal to datetime's own result by tests/test_timestamps.py.
"""

from __future__ import annotations

import math
import re

_RFC3339_RE = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,6}))?(?:([Zz])|([+-])(\d{2}):(\d{2}))"
)
_MONTH_START_DAYS = (0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334)


def rfc3339(ts: float, *, ms: bool = True) -> str:
    """`2026-12-04T15:42:20.123Z` (or to the second, `ms=False`), as `datetime.fromtimestamp(ts, UTC).isoformat()`
    writes it: microseconds rounded half-even, then cut to milliseconds; seconds alone are cut, never rounded."""
    frac, whole = math.modf(ts)
    us = round(frac * 1e6)
    if us >= 1_000_000:
        whole, us = whole + 1, us - 1_000_000
    elif us < 0:
        whole, us = whole - 1, us + 1_000_000
    days, second = divmod(int(whole), 86400)
    year, month, day = _civil(days)
    text = f"{year:04d}-{month:02d}-{day:02d}T{second // 3600:02d}:{second // 60 % 60:02d}:{second % 60:02d}"
    return f"{text}.{us // 1000:03d}Z" if ms else f"{text}Z"


def _civil(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a day counted from 1970-01-01, proleptic Gregorian (H. Hinnant's civil_from_days: core
    takes no clock, so no time.gmtime here)."""
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


def parse_rfc3339(text: str) -> float | None:
    """Seconds since the epoch of `2026-12-04T15:42:20.123Z` or `…+02:00`; None for anything else, a date that does
    not exist included (datetime.fromisoformat's answer for these forms, without datetime)."""
    m = _RFC3339_RE.fullmatch(text)
    if m is None:
        return None
    year, month, day, hour, minute, second = (int(m[i]) for i in range(1, 7))
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    month_days = (31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
    if not (year >= 1 and 1 <= month <= 12 and 1 <= day <= month_days[month - 1]):
        return None
    if hour > 23 or minute > 59 or second > 59:
        return None
    offset_s = 0
    if m[9] is not None:
        off_h, off_m = int(m[10]), int(m[11])
        if off_h > 23 or off_m > 59:
            return None
        offset_s = (off_h * 3600 + off_m * 60) * (1 if m[9] == "+" else -1)
    y = year - 1
    days = y * 365 + y // 4 - y // 100 + y // 400 - 719162  # days from 0001-01-01 to 1970-01-01: 719162
    days += _MONTH_START_DAYS[month - 1] + (1 if leap and month > 2 else 0) + day - 1
    fraction = int(m[7].ljust(6, "0")) / 1e6 if m[7] else 0.0
    return days * 86400 + hour * 3600 + minute * 60 + second - offset_s + fraction
