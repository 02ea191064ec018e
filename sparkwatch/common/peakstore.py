"""The learned peaks file, `<state_dir>/peaks.json` (core.launch.peaks decides what goes in it): bounded, atomic,
strict. `learn` folds a finished run in; `forget` is `sparkwatch launch --forget KEY` / `--forget-all`."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

from sparkwatch.common.durable import private_dir, read_regular, write_atomic
from sparkwatch.common.wiretypes import WireError, from_json, to_json
from sparkwatch.core.launch import peaks
from sparkwatch.core.launch.peaks import PeakRecord, trim

PEAKS_FILE = "peaks.json"
PEAKS_MAX_BYTES = 1 << 20


def peaks_path(state_dir: Path) -> Path:
    return state_dir / PEAKS_FILE


def load(state_dir: Path) -> dict[str, PeakRecord]:
    """Every record; an absent, unreadable or foreign file is no records (a plan then uses its estimate)."""
    try:
        raw = json.loads(read_regular(peaks_path(state_dir), PEAKS_MAX_BYTES))
        records: dict[str, PeakRecord] = from_json(dict[str, PeakRecord], raw.get("peaks", {}), "peaks")
    except (OSError, ValueError, WireError, AttributeError, RecursionError):  # nested beyond reason: no records
        return {}
    return records


def learn(
    state_dir: Path,
    key: str,
    peak_bytes: int,
    *,
    phases: Mapping[str, int],
    ready_s: float | None,
    estimate_bytes: int | None,
) -> None:
    """One more run of `key` folded into its record (core.launch.peaks.fold) and saved. Raises OSError."""
    records = load(state_dir)
    records[key] = peaks.fold(
        records.get(key), peak_bytes, phases=phases, ready_s=ready_s, estimate_bytes=estimate_bytes, at=time.time()
    )
    save(state_dir, records)


def forget(state_dir: Path, key: str | None) -> bool:
    """Remove the record of `key` (None: every record). False when there was none to remove (nothing written)."""
    records = load(state_dir)
    kept = peaks.forget(records, key)
    if len(kept) == len(records):
        return False
    save(state_dir, kept)
    return True


def save(state_dir: Path, records: dict[str, PeakRecord]) -> None:
    private_dir(state_dir)
    data = json.dumps({"version": 1, "peaks": to_json(trim(records))}, separators=(",", ":")).encode()
    write_atomic(peaks_path(state_dir), data)
