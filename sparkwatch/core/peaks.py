"""Learned peaks: what each launched engine really took, per boot phase, and how long it took to be ready.

Keyed by the engine, the model and the flags that size its memory (`peak_key`), so the next plan for the same
command uses the measured peak instead of the estimate and shows the estimate's error next to it. Pure: the store
(common.peakstore) reads and writes the JSON; this module builds keys and folds a run into the record.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from sparkwatch.core.enginecli import EngineCommand

# The flags that change an engine's footprint (core.enginecli canonical names); a change in any is a new key.
KEY_FLAGS = (
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_model_len",
    "tensor_parallel_size",
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
RUNS_KEPT = 5  # the learned peak is the largest of the last RUNS_KEPT runs
MAX_KEYS = 256  # records kept; the least recently updated go first


def peak_key(cmd: EngineCommand, budget_bytes: int | None = None) -> str:
    """`vllm|Qwen/Qwen3-8B|gpu_memory_utilization=0.8,max_model_len=8192`; `other` commands key on their argv."""
    if cmd.kind == "other":
        return f"other|{' '.join(cmd.argv)[:200]}|budget={budget_bytes}"
    flags = ",".join(f"{k}={cmd.flags[k]}" for k in KEY_FLAGS if k in cmd.flags)
    return f"{cmd.kind}|{cmd.model or ''}|{flags}"


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
        return max(self.recent) if self.recent else 0


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


def trim(records: Mapping[str, PeakRecord]) -> dict[str, PeakRecord]:
    """At most MAX_KEYS records, the most recently updated."""
    ordered = sorted(records.items(), key=lambda kv: kv[1].updated_at, reverse=True)
    return dict(ordered[:MAX_KEYS])


def error_ratio(estimate_bytes: int, measured_bytes: int) -> float | None:
    """(estimate - measured) / measured: +0.25 is a 25 % overestimate."""
    if measured_bytes <= 0:
        return None
    return (estimate_bytes - measured_bytes) / measured_bytes
