"""Busy is not wedged: an engine's own counters say whether it still makes progress while the serving probe fails.

A failed one-token probe alone cannot tell a wedged engine from a busy one: six concurrent requests to a batch-1
engine kept the probe queued past its timeout, three failures in a row made a healthy engine `engine_wedged`, and
with `kill_wedged_after_s` set the guard SIGKILLed it 9.4 s later (issue 37). So after a failed probe telemetry reads
the engine's own Prometheus counters, on the address the probe dialled (telemetry/probewatch.py), and only a failure
whose counters did not move since the last look counts toward a wedge the guard may kill.

The counters that move while a request runs, by engine (the ones that move only when a request ends are no use: a
long generation would read as a stall until its last token):
- vLLM, `/metrics` (always served): `vllm:generation_tokens_total` and `vllm:prompt_tokens_total`, added each engine
  step (vllm/v1/metrics/loggers.py, counters `vllm:generation_tokens`, `vllm:prompt_tokens`), and
  `vllm:num_requests_running`;
- SGLang, `/metrics` (with `--enable-metrics`): `sglang:realtime_tokens_total` (modes `prefill_compute`,
  `prefill_cache`, `decode`; updated each decode log interval, 40 steps by default) and `sglang:num_running_reqs`.
  Its `sglang:generation_tokens_total` is added when a request finishes (TokenizerMetricsCollector
  .observe_one_finished_request): alone it is not a progress counter, and an SGLang that serves only it has none;
- llama.cpp's llama-server, `/metrics` (with `--metrics`): `llamacpp:n_decode_total`, one a llama_decode() call
  (server_metrics::on_decoded; its `llamacpp:tokens_predicted_total` is added when a slot is released), and
  `llamacpp:requests_processing`.
llama-cpp-python's server serves no `/metrics` (its routes: /v1/completions, /v1/chat/completions, /v1/embeddings,
/v1/models, /extras/*): it has no counters.

Each counter is summed over its label sets (vLLM labels each engine of a data-parallel group, SGLang each rank). The
text is scanned line by line for these names only: a full exposition parser reads the histograms' hundreds of bucket
lines for nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

# family -> the counters that move while a request runs, and the gauge of requests running
PROGRESS_COUNTERS: Mapping[str, tuple[str, ...]] = {
    "vllm": ("vllm:generation_tokens_total", "vllm:prompt_tokens_total"),
    "sglang": ("sglang:realtime_tokens_total",),
    "llama.cpp": ("llamacpp:n_decode_total",),
}
RUNNING_GAUGES: Mapping[str, str] = {
    "vllm": "vllm:num_requests_running",
    "sglang": "sglang:num_running_reqs",
    "llama.cpp": "llamacpp:requests_processing",
}
# What each counter counts, in the kill line's words ("tokens generated stayed at 1234").
COUNTER_WORDS: Mapping[str, str] = {
    "vllm:generation_tokens_total": "tokens generated",
    "vllm:prompt_tokens_total": "prompt tokens",
    "sglang:realtime_tokens_total": "tokens processed",
    "llamacpp:n_decode_total": "decode steps",
}
_FAMILY_OF = {name: family for family, names in PROGRESS_COUNTERS.items() for name in names}
_FAMILY_OF.update({name: family for family, name in RUNNING_GAUGES.items()})
_PREFIXES = tuple(sorted({name.split(":", 1)[0] + ":" for name in _FAMILY_OF}))
# Lines looked at in one exposition: vLLM's is ~1,500 lines (its histograms' buckets); past this it is not an engine's.
LINES_MAX = 200_000


@dataclass(frozen=True, slots=True)
class Counters:
    """One read of an engine's progress counters: its family, each counter's value (summed over its label sets), in
    PROGRESS_COUNTERS' order, and the requests running (None: the gauge was not served)."""

    family: str
    values: tuple[tuple[str, float], ...]
    running: float | None = None

    @property
    def lead(self) -> tuple[str, float]:
        """The counter the kill line names: the first one served."""
        return self.values[0]


class Read(StrEnum):
    COUNTERS = "counters"  # the engine answered with its progress counters
    NONE = "none"  # it answered, without them (404: no /metrics; a /metrics without these names)
    UNREAD = "unread"  # no whole answer (no answer within the timeout, refused, cut short): says nothing


@dataclass(frozen=True, slots=True)
class MetricsRead:
    read: Read
    counters: Counters | None = None
    error: str = ""  # for UNREAD and NONE: why, in words


class Look(StrEnum):
    """A failed probe's look at the counters, against the last look of the same failing run."""

    FIRST = "first"  # counters read, nothing earlier in this run to compare with
    MOVING = "moving"  # a counter changed since the last look: busy, not wedged
    STALLED = "stalled"  # the counters are as they were at the last look: no progress
    NONE = "none"  # the engine serves no progress counters: a wedge cannot be told from busy
    UNREAD = "unread"  # the counters could not be read this time: neither way


def parse_counters(text: str) -> Counters | None:
    """The progress counters of a Prometheus text exposition, or None when it has none of one family's counters.
    Lines of other metrics, comments, and values that are not finite non-negative numbers are skipped."""
    sums: dict[str, float] = {}
    for n, line in enumerate(text.splitlines()):
        if n >= LINES_MAX:
            break
        if not line.startswith(_PREFIXES):
            continue
        name_end = len(line)
        for stop in ("{", " "):
            at = line.find(stop)
            if 0 <= at < name_end:
                name_end = at
        name = line[:name_end]
        if name not in _FAMILY_OF:
            continue
        # The value follows the labels (which may hold spaces inside quotes): the field after the last '}' if any.
        rest = line[line.rfind("}") + 1 :] if line[name_end : name_end + 1] == "{" else line[name_end:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        sums[name] = sums.get(name, 0.0) + value
    for family, names in PROGRESS_COUNTERS.items():
        values = tuple((name, sums[name]) for name in names if name in sums)
        if values:
            return Counters(family, values, sums.get(RUNNING_GAUGES[family]))
    return None


def look(last: Counters | None, got: MetricsRead) -> Look:
    """What a failed probe's read of the counters says, against the last read of the same failing run."""
    if got.read == Read.NONE:
        return Look.NONE
    if got.read == Read.UNREAD or got.counters is None:
        return Look.UNREAD
    now = got.counters
    if last is None or last.family != now.family:
        return Look.FIRST
    before = dict(last.values)
    if any(name not in before or before[name] != value for name, value in now.values):
        return Look.MOVING  # grew (or restarted from 0 with a new engine core): it did something since
    return Look.STALLED


def moved_by(last: Counters | None, now: Counters | None) -> float | None:
    """How far the lead counter moved between two reads (None: not comparable)."""
    if last is None or now is None or last.family != now.family:
        return None
    before = dict(last.values)
    name, value = now.lead
    return value - before[name] if name in before else None


def stall_words(counters: Counters) -> str:
    """`tokens generated stayed at 1234`: the kill line's fact."""
    name, value = counters.lead
    return f"{COUNTER_WORDS.get(name, name)} stayed at {value:.0f}"
