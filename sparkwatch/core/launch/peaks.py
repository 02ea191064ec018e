"""Learned peaks: what each launched engine really took, per boot phase, and how long it took to be ready.

Keyed by the engine, the model and the flags that size its memory (`peak_key`). Each record keeps its runs' peaks
beside the estimate. A measured peak replaces the estimate only once two runs agree within AGREE_RATIO
(`learned_bytes`): one run is one sample, and a single odd one (a box busy with something else, a run cut short)
would otherwise size the next plan and `--budget auto` on its own. `sparkwatch launch --forget KEY` and
`--forget-all` remove records (`forget`). Pure: the store (common.peakstore) reads and writes the JSON; this module
builds keys, folds a run into the record and says what a record has learned.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sparkwatch.core.engines.enginecli import EngineCommand
from sparkwatch.core.redact import redact, safe_cmdline

# The flags that change an engine's footprint (core.engines.enginecli canonical names); a change in any is a new key.
KEY_FLAGS = (
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_model_len",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "nnodes",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enforce_eager",
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "mem_fraction_static",
    "chunked_prefill_size",
    "max_total_tokens",
    "ctx_size",
    "n_gpu_layers",
    "cache_type_k",
    "cache_type_v",
    "parallel",
)
RUNS_KEPT = 5  # runs kept per key: the learned peak comes from these
AGREE_RATIO = 0.25  # two runs agree when the larger is at most this share above the smaller
MAX_KEYS = 256  # records kept; the least recently updated go first


def peak_key(cmd: EngineCommand, budget_bytes: int | None = None, role: str | None = None) -> str:
    """`vllm|Qwen/Qwen3-8B|gpu_memory_utilization=0.8,max_model_len=8192`; `other` commands key on their argv.

    The key travels into declarations, `engine_started` events and the plan's output (so that `--forget KEY` can
    name it): it is built from the redacted argv and model, never from a token the command line carries."""
    if cmd.kind == "other":
        return f"other|{safe_cmdline(cmd.argv, 200)}|budget={budget_bytes}"
    flags = ",".join(f"{k}={cmd.flags[k]}" for k in KEY_FLAGS if k in cmd.flags)
    # an engine that spans nodes: each node's peaks are its own file's, and its role's (the head holds more)
    return f"{cmd.kind}|{redact(cmd.model or '')}|{flags}" + (f"|role={role}" if role else "")


@dataclass(frozen=True, slots=True)
class PeakRecord:
    """What the runs with one key measured. `recent`: each run's peak, newest last."""

    recent: tuple[int, ...] = ()
    phases: Mapping[str, int] = field(default_factory=dict)  # phase -> largest footprint seen in it
    ready_s: float | None = None  # the last run that reached ready
    estimate_bytes: int | None = None  # the plan's estimate at the last run
    runs: int = 0
    updated_at: float = 0.0

    @property
    def peak_bytes(self) -> int:
        """The largest peak measured in the kept runs, whether or not another run confirmed it."""
        return max(self.recent) if self.recent else 0

    @property
    def learned_bytes(self) -> int | None:
        """What replaces the estimate: the largest kept peak that another kept run agrees with (the larger of the two
        at most AGREE_RATIO above the smaller); None while no two runs agree (the estimate stands)."""
        return confirmed_peak(self.recent)


def agree(a_bytes: int, b_bytes: int) -> bool:
    return a_bytes > 0 and b_bytes > 0 and abs(a_bytes - b_bytes) <= AGREE_RATIO * min(a_bytes, b_bytes)


def confirmed_peak(runs: tuple[int, ...]) -> int | None:
    """The largest run that some other run agrees with; None when no two do."""
    confirmed = [a for i, a in enumerate(runs) if any(agree(a, b) for j, b in enumerate(runs) if j != i)]
    return max(confirmed) if confirmed else None


def fold(
    record: PeakRecord | None,
    peak_bytes: int,
    *,
    phases: Mapping[str, int],
    ready_s: float | None,
    estimate_bytes: int | None,
    at: float,
) -> PeakRecord:
    """The record after one more run."""
    old = record or PeakRecord()
    merged = dict(old.phases)
    for phase, value in phases.items():
        merged[phase] = max(merged.get(phase, 0), value)
    return replace(
        old,
        recent=(*old.recent, peak_bytes)[-RUNS_KEPT:],
        phases=merged,
        ready_s=ready_s if ready_s is not None else old.ready_s,
        estimate_bytes=estimate_bytes,
        runs=old.runs + 1,
        updated_at=at,
    )


def forget(records: Mapping[str, PeakRecord], key: str | None) -> dict[str, PeakRecord]:
    """The records without `key` (None: without any): the estimate stands again for what was forgotten."""
    return {} if key is None else {k: r for k, r in records.items() if k != key}


def trim(records: Mapping[str, PeakRecord]) -> dict[str, PeakRecord]:
    """At most MAX_KEYS records, the most recently updated."""
    ordered = sorted(records.items(), key=lambda kv: kv[1].updated_at, reverse=True)
    return dict(ordered[:MAX_KEYS])


def error_ratio(estimate_bytes: int, measured_bytes: int) -> float | None:
    """(estimate - measured) / measured: +0.25 is a 25 % overestimate."""
    if measured_bytes <= 0:
        return None
    return (estimate_bytes - measured_bytes) / measured_bytes
