"""core.timestamps writes and reads RFC 3339 as datetime does, without loading datetime in the daemons (its module is
0.7 MiB resident in each, bench/RESULTS-rss-gpu.md). datetime itself is the reference here."""

from __future__ import annotations

import random
from datetime import UTC, datetime

import pytest

from sparkwatch.core.timestamps import parse_rfc3339, rfc3339

EDGES = [
    0.0,
    0.0005,
    0.9995,
    0.9999995,
    1_764_806_400.0,
    1_764_806_400.9999996,
    1_764_806_400.0004999,
    -0.5,
    951_782_400.0,
]


def reference(ts: float, timespec: str) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec=timespec).replace("+00:00", "Z")


@pytest.mark.parametrize("seed", range(3))
def test_timestamps_are_written_as_datetime_writes_them(seed: int) -> None:
    rng = random.Random(seed)
    samples = (
        EDGES
        + [rng.uniform(0, 4e9) for _ in range(20_000)]
        + [rng.randrange(0, 4 * 10**9) / 1000 for _ in range(5_000)]
    )
    for ts in samples:
        assert rfc3339(ts) == reference(ts, "milliseconds"), ts
        assert rfc3339(ts, ms=False) == reference(ts, "seconds"), ts


@pytest.mark.parametrize("seed", range(3))
def test_timestamps_are_read_back_as_datetime_reads_them(seed: int) -> None:
    rng = random.Random(seed)
    for ts in EDGES + [rng.uniform(0, 4e9) for _ in range(20_000)]:
        for text in (rfc3339(ts), rfc3339(ts, ms=False), reference(ts, "microseconds")):
            want = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
            assert parse_rfc3339(text) == pytest.approx(want, abs=1e-6), text
    for text in (
        "2026-12-04T15:42:20.5+02:00",
        "2026-12-04T15:42:20-07:30",
        "2024-02-29T00:00:00Z",
        "2000-03-01T00:00:00Z",
    ):
        want = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
        assert parse_rfc3339(text) == pytest.approx(want, abs=1e-6), text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "yesterday",
        "2026-12-04",
        "2026-12-04T15:42:20",
        "2025-02-29T00:00:00Z",
        "2026-13-01T00:00:00Z",
        "2026-04-31T00:00:00Z",
        "2026-12-04T24:00:00Z",
        "2026-12-04T15:60:00Z",
        "2026-12-04T15:42:20Z trailing",
    ],
)
def test_anything_else_reads_as_no_timestamp(text: str) -> None:
    assert parse_rfc3339(text) is None
