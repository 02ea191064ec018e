"""`sparkwatch postmortem`: the verdict, its evidence, and the last minute of the flight recorder as a timeline.

Plain lines (it is read after the fact, often piped into a bug report): times in local time, sizes as people read
them, one timeline row every TIMELINE_STEP_S so a minute fits a screen.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sparkwatch.core.postmortem.flight import FlightSample
from sparkwatch.core.postmortem.verdict import Verdict
from sparkwatch.core.redact import safe_text
from sparkwatch.core.units import format_size

TIMELINE_STEP_S = 5.0


def _when(t: float | None) -> str:
    return "?" if t is None else datetime.fromtimestamp(t).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def _which_boot(verdict: Verdict) -> str:
    """The previous boot by its id and its end, each said in words when unknown: nothing of that boot was found (no
    journal, recorder sample or event of it), never a bare `?`."""
    boot = "previous boot" if verdict.boot_id is None else f"previous boot {verdict.boot_id}"
    if verdict.ended_at is not None:
        return f"{boot} ended {_when(verdict.ended_at)}"
    if verdict.boot_id is not None:
        return f"{boot}, its end unknown"
    return "previous boot (its id and its end unknown: no journal, flight recorder sample or event of it)"


def _rate(bytes_per_s: float) -> str:
    sign = "+" if bytes_per_s >= 0 else "-"
    return f"{sign}{format_size(abs(bytes_per_s))}/s"


def timeline(samples: Sequence[FlightSample], step_s: float = TIMELINE_STEP_S) -> list[str]:
    """One row every `step_s` (and the last sample), PSI as stall time since the previous row."""
    rows: list[FlightSample] = []
    for sample in samples:
        if not rows or sample.t - rows[-1].t >= step_s:
            rows.append(sample)
    if samples and rows[-1] is not samples[-1]:
        rows.append(samples[-1])
    out = []
    prev: FlightSample | None = None
    for s in rows:
        cells = [
            datetime.fromtimestamp(s.t).strftime("%H:%M:%S"),
            f"avail {format_size(s.available_bytes):>9}",
            f"free {format_size(s.free_bytes):>9}",
            f"cache {format_size(s.cached_bytes):>9}",
            f"shmem {format_size(s.shmem_bytes):>9}",
            f"fill {_rate(s.fill_rate_bytes_per_s):>12}",
        ]
        if s.free_2mib_bytes is not None:
            cells.append(f"2MiB-blocks {format_size(s.free_2mib_bytes):>9}")
        if s.psi_some_us is not None and prev is not None and prev.psi_some_us is not None:
            cells.append(f"stall {(s.psi_some_us - prev.psi_some_us) / 1000:.0f} ms")
        if s.gpu_bytes is not None:
            cells.append(f"gpu {format_size(s.gpu_bytes)}")
        if s.trees:
            biggest = s.trees[0]
            size = "" if biggest.footprint_bytes is None else f" {format_size(biggest.footprint_bytes)}"
            cells.append(f"{len(s.trees)} engine(s), biggest {biggest.kind} {biggest.root_pid}{size}")
        if s.launched:
            cells.append("launched " + ", ".join(f"{e.name} {e.phase}" for e in s.launched))
        if s.near_floor:
            cells.append("NEAR FLOOR")
        if s.stopping:
            cells.append("sparkwatch stopped")
        out.append("  " + "  ".join(cells))
        if s.psi_some_us is not None:
            prev = s
    return out


def postmortem_lines(verdict: Verdict, samples: Sequence[FlightSample]) -> list[str]:
    lines = [
        f"{_which_boot(verdict)}: {verdict.boot_class}",
        f"  {safe_text(verdict.summary)}",
    ]
    if verdict.evidence:
        lines.append("evidence:")
        lines += [f"  {safe_text(line)}" for line in verdict.evidence]
    if samples:
        gap = verdict.sample_to_journal_end_s
        when = (
            "" if gap is None else f", its last {abs(gap):.0f} s {'before' if gap >= 0 else 'after'} the journal's end"
        )
        lines.append(f"the last minute (flight recorder, {len(samples)} samples{when}):")
        lines += timeline(samples)
    else:
        lines.append("the last minute: no flight recorder samples of that boot")
    if verdict.trend is not None:
        lines.append(f"trend: {verdict.trend.words}")
    if verdict.engines:
        lines.append("engines at the end:")
        for e in verdict.engines:
            size = "" if e.footprint_bytes is None else f" {format_size(e.footprint_bytes)}"
            phase = "" if e.phase is None else f" [{e.phase}]"
            lines.append(f"  {e.kind} pid {e.pid}{size}{phase}")
    if verdict.pstore:
        lines.append(f"pstore: {', '.join(verdict.pstore)}")
    lines += [f"note: {safe_text(note)}" for note in verdict.notes]
    if verdict.boot_class not in ("clean", "unknown"):
        lines.append('what to send upstream: docs/troubleshooting.md, "the box wedged anyway"')
    return lines
