"""Will this engine fit? The footprint estimate of `sparkwatch launch`, as named terms, and the fit decision.

Pure: the caller passes what the engine's command line says (core.engines.enginecli), what its checkpoint's file sizes
and config.json say (ModelFacts, read by common.sources.checkpoint), the pool now (MemoryView) and the engines already
running (Reservation: what the kernel says of each tree and what its launch declared; `reserve` decides what it may
still take). docs/launch.md gives every term with its source.

The terms, and the phase each one belongs to (the peak is the largest phase, not the sum of all):
- weights: the checkpoint's file sizes (safetensors shards, a GGUF file), split over tensor-parallel ranks;
- kv_cache: vLLM fills what `gpu_memory_utilization × total` leaves (vllm/v1/worker/gpu_worker.py
  determine_available_memory), or takes `--kv-cache-memory-bytes`; SGLang keeps `mem_fraction_static × free at start`
  for weights and KV (sglang/srt/mem_cache/kv_cache_configurator.py); llama.cpp allocates `n_ctx` tokens
  (src/llama-kv-cache.cpp), 2 × layers × kv_heads × head_dim × dtype bytes a token;
- activation_peak: the profiling run's live tensors (max_num_batched_tokens of MLP and hidden activations, and the
  sampler's fp32 logits for max_num_seqs);
- cuda_graphs: 0 with --enforce-eager / --disable-cuda-graph, else a fixed figure from observed captures;
- jit_workers: MAX_JOBS compiler jobs at flashinfer's 8 GiB a job (flashinfer PR #3899). The JIT burst runs in the
  profiling run, before the KV cache exists (flashinfer issue #3634), so the peak is
  weights + overhead + activation + max(kv_cache + cuda_graphs, jit_workers);
- runtime_overhead: CUDA context and the engine's host processes.

A fix that changes the command (a lower utilization, context or MAX_JOBS; a higher one where the engine would refuse
its setting as too small) is planned again with it applied before it is suggested (plan_launch, for this node and for
each node of an engine that spans nodes, core.launch.nodeplan): the arithmetic alone suggested values that still
missed, and could loop. A plan that misses always says why and what would fit (miss_reasons, fix_line).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from sparkwatch.core.engines.enginecli import EngineCommand, EngineKind, flag_float, flag_int, flag_set, recognise
from sparkwatch.core.units import GiB, MiB, format_size

# --- engine defaults the estimate relies on (docs/launch.md cites each)
# vllm/config/cache.py CacheConfig: Field(default=0.92) in 0.33.0; `gpu_memory_utilization: float = 0.9` in 0.11.0.
VLLM_UTIL_DEFAULT = 0.92
VLLM_UTIL_DEFAULT_OLD = 0.9
# vllm/engine/arg_utils.py get_batch_defaults: GB10 (cc 12.1) stays on the small tier: 2048 batched tokens for
# `vllm serve`, 256 sequences.
VLLM_BATCHED_TOKENS_DEFAULT = 2048
VLLM_MAX_SEQS_DEFAULT = 256
# Graph captures seen in real logs: 0.11-0.96 GiB for vLLM (gpu_model_runner.py "Graph capturing finished in %.0f
# secs, took %.2f GiB"), 0.09-1.93 GB for SGLang ("Capture cuda graph end. ... mem usage=%.2f GB"). 1 GiB covers
# single-GPU dense models at default capture sizes.
CUDA_GRAPHS_BYTES = 1 * GiB
# The CUDA context and what the engine's processes hold on the host: NVML showed 741,326,848 B for a PyTorch process
# before its first tensor on a GB10 (vllm-project/vllm#55828); a vLLM engine's RSS was 1.8 GiB (vllm#54200).
OVERHEAD_PYTHON_ENGINE_BYTES = 2560 * MiB
# llama.cpp: one native process, its CUDA context and compute buffers ("compute buffer size = %8.2f MiB").
OVERHEAD_LLAMA_BYTES = 1 * GiB
ACTIVATION_MIN_BYTES = 512 * MiB
# flashinfer PR #3899 (open; not in flashinfer 0.7.4): FLASHINFER_JIT_JOB_MEMORY_GB=8 per job and
# FLASHINFER_JIT_MEMORY_HEADROOM_GB=16, num_workers = max(1, min(cpus, (MemAvailable - 16 GiB) // 8 GiB)).
JIT_JOB_BYTES = 8 * GiB
JIT_HEADROOM_BYTES = 16 * GiB
# SGLang's default mem_fraction_static (sglang/srt/arg_groups/memory_hook.py handle_gpu_memory_settings): reserved
# MiB = 512 + max(chunked_prefill_size, 2048) * 1.5 + tp/8 * 1024 + decode max_bs * 2, at least 10 GiB above 60 GiB.
SGLANG_CHUNKED_PREFILL_DEFAULT = 8192  # for a GPU of 90-160 GiB (GB10's ~121.6 GiB)
SGLANG_GRAPH_MAX_BS = 256
# llama.cpp pads the KV cache to 256 cells (src/llama-context.cpp).
LLAMA_KV_PAD = 256
LLAMA_CTX_FALLBACK = 4096  # `--fit`'s floor for an unset context (common/fit.cpp fit_params_min_ctx)

# A fragmented pool: less than this share of MemFree lies in free blocks of 2 MiB or more (/proc/buddyinfo), with at
# least FRAGMENT_MIN_BYTES in smaller blocks. Owners report NV_ERR_NO_MEMORY on a GB10 whose buddyinfo shows no free
# blocks of 4 MiB or more while ~118 GiB is "available" (FujitsuPolycom/sparkring#173). A box that merely has aged
# (this project's 2-core VM after days: 23 % of MemFree in blocks of 2 MiB or more) is not that: the kernel compacts
# on demand. 10 % singles out the near-empty high orders of the report.
FRAGMENT_RATIO = 0.10
FRAGMENT_MIN_BYTES = 1 * GiB

DEFAULT_MARGIN_BYTES = 1 * GiB
# `--budget auto`: the plan's need plus this share of it (at least the margin).
AUTO_BUDGET_SLACK = 0.10


class FreeSource(StrEnum):
    """Which figure an engine's own start-up check compares against (vLLM's request_memory)."""

    MEM_AVAILABLE = "MemAvailable"  # vLLM with the UMA branch: psutil.virtual_memory().available
    MEM_FREE = "MemFree"  # cudaMemGetInfo on a GB10: the kernel's MemFree (unsloth#10704)
    NONE = "none"  # the engine has no such check (SGLang and llama.cpp size themselves from what is free)


class FixAction(StrEnum):
    DROP_CACHES = "drop_caches"
    COMPACT = "compact"
    WAIT = "wait"
    LOWER_FLAG = "lower_flag"
    BUDGET = "budget"
    SMALLER_MODEL = "smaller_model"
    FREE_MEMORY = "free_memory"  # no setting of the engine fits this pool: only more memory does


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the checkpoint's file sizes and config say. Every size comes from stat, never from reading weights."""

    source: str  # the directory or file that was sized ("" when nothing was found)
    weights_bytes: int = 0
    files: int = 0
    format: str = "none"  # safetensors | gguf | pytorch | none
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    mla_dim: int | None = None  # kv_lora_rank + qk_rope_head_dim (DeepSeek MLA: one latent "head", no factor 2)
    dtype_bytes: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    max_len: int | None = None
    error: str | None = None  # why facts are missing


@dataclass(frozen=True, slots=True)
class MemoryView:
    total_bytes: int
    available_bytes: int
    free_bytes: int
    cached_bytes: int
    floor_bytes: int
    margin_bytes: int = DEFAULT_MARGIN_BYTES
    contiguous_free_bytes: int | None = None  # free in blocks of at least 2 MiB (/proc/buddyinfo); None: unknown
    cpus: int = 1


# How long a declared engine counts as booting after its root started, by the kernel's start time (its declaration's
# phase is its owner's word, so a "still booting" forged or left behind lapses here). launch's own boots took 412 s
# for a 32B model with its first flashinfer JIT (docs/launch.md); a cold 120 GB checkpoint from disk and every JIT
# module built fresh stays well under 30 minutes.
BOOT_MAX_S = 1800.0


@dataclass(frozen=True, slots=True)
class Reservation:
    """An engine already running, as the plan holds it. What it may still take (`reserved_bytes`, the rule in
    `reserve`) needs no trust in the declaration beyond what the declaring user can only lower: every input that
    grants a reservation is the kernel's (the tree's RSS, its root's age, whether the rules see an engine in it),
    or bounds it by the launch's own plan (its estimate, its budget)."""

    kind: str
    root_pid: int
    name: str
    footprint_bytes: int  # what its tree holds now: RSS from /proc, never the declaration's measured peak
    budget_bytes: int | None = None
    booting: bool = False  # its declaration says so (phase before ready)
    estimate_bytes: int | None = None  # the plan's estimate it was launched with (None: undeclared, or none given)
    phase: str = ""  # the declared boot phase, for the plan line
    age_s: float | None = None  # since its root started (the kernel's start time); None: unknown
    engine: bool = False  # the engine rules see an engine in its tree (no declaration's word taken for it)
    other_uid: int | None = None  # the declarer, when another user (None: the user planning)
    launched: bool = False  # its root's parent is the launch that declared it (the kernel's ppid)

    @property
    def reserved_bytes(self) -> int:
        return reserve(self)[0]

    @property
    def why(self) -> str:
        return reserve(self)[1]


def reserve(r: Reservation) -> tuple[int, str]:
    """What a running engine may still take from the pool a new launch plans against, and the rule's words.

    A declaration reserves only for a tree still booting: its declaration says it is not ready yet, its root is
    younger than BOOT_MAX_S, and its tree is an engine (by the engine rules; the planning user's own declaration
    also by its word while its launch runs it: an engine the rules do not name is still theirs to plan around). It
    reserves what its engine could still take by the plan it was launched with: the estimate (or the budget, when
    lower: the guard kills beyond it) less what its tree holds now; never the raw budget, never more than the
    estimate. So an idle process of any user, declared with any budget, reserves nothing; a ready engine holds what
    it holds (already out of MemAvailable); and a booting one reserves at most the estimate its own launch computed."""
    if r.estimate_bytes is None:
        return 0, "no plan's estimate declared" if r.budget_bytes is not None else "not declared"
    if not r.booting:
        return 0, "ready: what it holds is already out of MemAvailable"
    if not r.engine and (r.other_uid is not None or not r.launched):
        return 0, "its tree is no engine"
    if r.age_s is None or r.age_s >= BOOT_MAX_S:
        age = "of unknown age" if r.age_s is None else f"{r.age_s:.0f} s old"
        return 0, f"said to boot, but {age}: past the {BOOT_MAX_S:.0f} s a boot may take"
    bound = r.estimate_bytes if r.budget_bytes is None else min(r.estimate_bytes, r.budget_bytes)
    which = "its plan's estimate" if bound == r.estimate_bytes else "its budget (under its plan's estimate)"
    held = max(r.footprint_bytes, 0)
    text = (
        f"booting ({r.phase or 'starting'}, {r.age_s:.0f} s of at most {BOOT_MAX_S:.0f} s): {which} "
        f"{format_size(bound)} less the {format_size(held)} its tree holds"
    )
    return max(bound - held, 0), text


@dataclass(frozen=True, slots=True)
class Learned:
    """What the last runs with the same key measured (core.launch.peaks)."""

    peak_bytes: int
    estimate_bytes: int
    runs: int
    ready_s: float | None = None


@dataclass(frozen=True, slots=True)
class Term:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True, slots=True)
class EngineCheck:
    """The engine's own start-up check: it refuses to start when `source` reads under `required_bytes`."""

    source: FreeSource
    required_bytes: int
    value_bytes: int
    why: str

    @property
    def ok(self) -> bool:
        return self.source == FreeSource.NONE or self.value_bytes >= self.required_bytes


@dataclass(frozen=True, slots=True)
class Fix:
    action: FixAction
    text: str
    automatic: bool = False  # needs no guessing: `--fix` may apply it (drop caches, compact)
    # What a LOWER_FLAG fix changes, so that it can be applied and planned again (plan_launch does, before it
    # suggests it): engine flags appended to the command, and the MAX_JOBS to run with.
    flags: tuple[tuple[str, str], ...] = ()
    max_jobs: int | None = None


@dataclass(frozen=True, slots=True)
class Estimate:
    kind: EngineKind
    model: str | None
    terms: tuple[Term, ...]
    needs_bytes: int
    check: EngineCheck | None = None
    notes: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # the engine itself would refuse these settings (KV cache under one sequence, …)
    problem_fixes: tuple[str, ...] = ()  # a flag that cures a problem ("--max-model-len 26624")
    jobs: int = 1  # the MAX_JOBS the jit_workers term assumes (core.launch.launchenv sets it when the user did not)
    tune: str = ""  # the flag that sizes it, for the fix line
    tune_value: float | None = None  # its value now (vLLM's utilization, SGLang's fraction)
    kv_per_token_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    estimate: Estimate
    view: MemoryView
    reservations: tuple[Reservation, ...]
    needs_bytes: int  # the estimate, or the measured peak for the same key
    available_bytes: int  # MemAvailable - floor - margin - what running engines may still take
    fits: bool
    short_bytes: int  # by how much it misses (0 when it fits)
    fragmented: bool
    fixes: tuple[Fix, ...]
    learned: Learned | None = None
    budget_bytes: int | None = None

    @property
    def terms(self) -> tuple[Term, ...]:
        return self.estimate.terms


# --- KV cache


def kv_bytes_per_token(facts: ModelFacts, kv_dtype_bytes: float | None = None, tp: int = 1) -> int | None:
    """2 × layers × kv_heads × head_dim × dtype bytes (vllm/v1/kv_cache_interface.py AttentionSpec.page_size_bytes;
    per rank H_kv = max(1, H_kv // tp)); MLA: layers × (kv_lora_rank + qk_rope_head_dim) × dtype bytes. None when
    the config does not say."""
    b = kv_dtype_bytes if kv_dtype_bytes is not None else facts.dtype_bytes
    if facts.layers is None or b is None:
        return None
    if facts.mla_dim is not None:
        return math.ceil(facts.layers * facts.mla_dim * b)
    if facts.kv_heads is None or facts.head_dim is None:
        return None
    heads = max(1, facts.kv_heads // max(tp, 1))
    return math.ceil(2 * facts.layers * heads * facts.head_dim * b)


# vllm/utils/torch_utils.py STR_DTYPE_TO_TORCH_DTYPE: fp8* -> uint8 (1 byte); ggml block formats: q8_0 = 34 B per
# 32 values, q4_0 = 18 B per 32, q5_0 = 22, q5_1 = 24, q4_1 = 20, iq4_nl = 18.
_KV_DTYPE_BYTES = {
    "fp8": 1.0, "fp8_e4m3": 1.0, "fp8_e5m2": 1.0, "fp8_inc": 1.0, "fp8_ds_mla": 1.0, "mxfp8": 1.0,
    "nvfp4": 0.5, "fp4_e2m1": 0.5, "fp4_mx_block16": 0.5,
    "bfloat16": 2.0, "bf16": 2.0, "float16": 2.0, "f16": 2.0, "half": 2.0, "float32": 4.0, "f32": 4.0, "float": 4.0,
    "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32,
}  # fmt: skip


def kv_dtype_bytes(name: str | None) -> float | None:
    """Bytes per KV value for a --kv-cache-dtype / --cache-type-k name; None for `auto` (the model's dtype)."""
    if name is None or name in ("", "auto"):
        return None
    return _KV_DTYPE_BYTES.get(name.lower())


def _dtype_bytes(facts: ModelFacts, dtype_flag: str | None) -> int | None:
    """The dtype vLLM runs: `auto` = the checkpoint's (FP16 for FP32 checkpoints, vllm/config/model.py)."""
    if dtype_flag in ("float32", "float"):
        return 4
    if dtype_flag in ("half", "float16", "bfloat16"):
        return 2
    if facts.dtype_bytes is None:
        return None
    return min(facts.dtype_bytes, 2) if facts.dtype_bytes >= 2 else facts.dtype_bytes


# --- estimates per engine


def _activation(facts: ModelFacts, tokens: int, seqs: int, dtype_bytes: int) -> int:
    """The profiling run's peak of live tensors: gate/up and hidden activations of `tokens` tokens and fp32 logits
    for `seqs` sequences. sparkwatch's own estimate (docs/launch.md): it does not model MoE workspaces, which sit
    outside vLLM's accounting (MARLIN reached ~118 GB at 0.7, vllm-project/vllm#43969)."""
    hidden = facts.hidden_size or 0
    inter = facts.intermediate_size or 4 * hidden
    act = tokens * (2 * inter + 4 * hidden) * dtype_bytes
    logits = seqs * (facts.vocab_size or 0) * 4
    return max(act + logits, ACTIVATION_MIN_BYTES)


def jit_jobs(available_bytes: int, cpus: int, headroom_bytes: int = JIT_HEADROOM_BYTES) -> int:
    """flashinfer PR #3899's memory-aware default: max(1, min(cpus, (MemAvailable - 16 GiB) // 8 GiB))."""
    budget = max(0, (available_bytes - headroom_bytes) // JIT_JOB_BYTES)
    return max(1, min(cpus, budget))


def launch_jobs(view: MemoryView, engine_bytes: int, reserved_bytes: int = 0) -> int:
    """MAX_JOBS for an engine about to start: flashinfer's formula over the memory that will be available when its
    JIT runs (MemAvailable now less what the engine holds by then: weights, activations, overhead, and less what
    engines still booting may still take: `reserve`), with the floor and margin as headroom where they exceed
    flashinfer's 16 GiB. flashinfer measures at JIT time; launch sets the variable before the weights load, so it
    subtracts them itself. The plan's jit_workers term and the MAX_JOBS launch sets are this one count
    (core.launch.launchenv)."""
    headroom = max(JIT_HEADROOM_BYTES, view.floor_bytes + view.margin_bytes)
    return jit_jobs(view.available_bytes - reserved_bytes - engine_bytes, view.cpus, headroom)


def _jit_note(jobs: int, mine: bool, when: str) -> str:
    whose = "launch sets it" if mine else "yours"
    return f"MAX_JOBS={jobs} ({whose}) × {format_size(JIT_JOB_BYTES)} a compile job, {when}"


def _peak(weights: int, kv: int, act: int, *, graphs: int, jit: int, overhead: int) -> int:
    return weights + overhead + act + max(kv + graphs, jit)


def _vllm(
    cmd: EngineCommand,
    facts: ModelFacts,
    view: MemoryView,
    jobs: int | None,
    version: tuple[int, ...] | None,
    *,
    reserved: int = 0,
) -> Estimate:
    old = version is not None and version < (0, 12)
    util = flag_float(cmd, "gpu_memory_utilization")
    if util is None:
        util = VLLM_UTIL_DEFAULT_OLD if old else VLLM_UTIL_DEFAULT
    if not 0 < util <= 1:
        raise ValueError(f"gpu-memory-utilization: {util:g} is not in (0, 1]")
    tp = flag_int(cmd, "tensor_parallel_size") or 1
    requested = math.ceil(view.total_bytes * util)
    weights = facts.weights_bytes // max(tp, 1)
    dtype = _dtype_bytes(facts, cmd.flag("dtype")) or 2
    tokens = flag_int(cmd, "max_num_batched_tokens") or VLLM_BATCHED_TOKENS_DEFAULT
    seqs = min(flag_int(cmd, "max_num_seqs") or VLLM_MAX_SEQS_DEFAULT, tokens)
    act = _activation(facts, tokens, seqs, dtype)
    graphs = 0 if flag_set(cmd, "enforce_eager") else CUDA_GRAPHS_BYTES
    overhead = OVERHEAD_PYTHON_ENGINE_BYTES
    mine = jobs is None
    jobs = launch_jobs(view, weights + act + overhead, reserved) if jobs is None else jobs
    jit = jobs * JIT_JOB_BYTES
    explicit_kv = flag_int(cmd, "kv_cache_memory_bytes")
    non_kv = weights + act + graphs + overhead
    notes: list[str] = []
    problems: list[str] = []
    problem_fixes: list[str] = []
    if explicit_kv is not None:
        kv = explicit_kv
        kv_note = "--kv-cache-memory-bytes (profiling skipped)"
        tune = "kv-cache-memory-bytes"
    else:
        kv = max(requested - non_kv, 0)
        kv_note = f"what {util:g} × {format_size(view.total_bytes)} leaves"
        tune = "gpu-memory-utilization"
        if requested < non_kv:
            problems.append(
                f"weights and activations ({format_size(non_kv)}) exceed gpu_memory_utilization {util:g} × total "
                f"({format_size(requested)}): vLLM would fail to load the model"
            )
    per_token = kv_bytes_per_token(facts, kv_dtype_bytes(cmd.flag("kv_cache_dtype")) or dtype, tp)
    max_len = flag_int(cmd, "max_model_len") or facts.max_len
    if per_token is not None and max_len is not None and kv < per_token * max_len and not problems:
        fit_len = kv // per_token if per_token else 0
        problems.append(
            f"the KV cache ({format_size(kv)}) holds {fit_len} tokens, less than one sequence of max_model_len "
            f"{max_len} ({format_size(per_token * max_len)}): vLLM refuses to start"
        )
        if fit_len >= 256:
            problem_fixes.append(f"--max-model-len {fit_len // 256 * 256}")
    terms = (
        Term("weights", weights, _weights_note(facts, tp)),
        Term("kv_cache", kv, kv_note if per_token is None else f"{kv_note}; {format_size(per_token)} a token"),
        Term("activation_peak", act, f"profiling run: {tokens} batched tokens, {seqs} sequences"),
        Term("cuda_graphs", graphs, "--enforce-eager" if not graphs else "typical capture"),
        Term("jit_workers", jit, _jit_note(jobs, mine, "during profiling, before KV")),
        Term("runtime_overhead", overhead, "CUDA context and host processes"),
    )
    needs = _peak(weights, kv, act, graphs=graphs, jit=jit, overhead=overhead)
    if version is None:
        source, why = FreeSource.MEM_AVAILABLE, "vLLM ≥ 0.24 on a UMA GPU reads MemAvailable (version unknown)"
        notes.append(
            f"vLLM before the UMA fix compares MemFree ({format_size(view.free_bytes)}) instead: pass "
            "--engine-reads MemFree for such a version"
        )
    elif old:
        source, why = FreeSource.MEM_FREE, f"vLLM {_v(version)} reads cudaMemGetInfo: MemFree on a GB10"
    else:
        source, why = FreeSource.MEM_AVAILABLE, f"vLLM {_v(version)} reads MemAvailable on a UMA GPU"
    check = EngineCheck(source, requested, _read(view, source), why)
    return Estimate(
        kind=EngineKind.VLLM, model=cmd.model, terms=terms, needs_bytes=needs, check=check, notes=tuple(notes),
        problems=tuple(problems), problem_fixes=tuple(problem_fixes), jobs=jobs, tune=tune, tune_value=util,
        kv_per_token_bytes=per_token,
    )  # fmt: skip


def _v(version: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in version)


def _read(view: MemoryView, source: FreeSource) -> int:
    if source == FreeSource.MEM_FREE:
        return view.free_bytes
    return view.available_bytes


def sglang_default_fraction(total_bytes: int, chunked: int, tp: int, max_bs: int = SGLANG_GRAPH_MAX_BS) -> float:
    """handle_gpu_memory_settings' default mem_fraction_static (sglang/srt/arg_groups/memory_hook.py)."""
    reserved_mib = 512 + max(chunked, 2048) * 1.5 + tp / 8 * 1024 + max_bs * 2
    if total_bytes > 60 * GiB:
        reserved_mib = max(reserved_mib, 10 * 1024)
    gpu_mib = total_bytes / MiB
    return round((gpu_mib - reserved_mib) / gpu_mib, 3)


def _sglang(cmd: EngineCommand, facts: ModelFacts, view: MemoryView, jobs: int | None, reserved: int = 0) -> Estimate:
    tp = flag_int(cmd, "tensor_parallel_size") or 1
    chunked = flag_int(cmd, "chunked_prefill_size") or SGLANG_CHUNKED_PREFILL_DEFAULT
    frac = flag_float(cmd, "mem_fraction_static")
    frac_note = "--mem-fraction-static"
    if frac is None:
        frac = sglang_default_fraction(view.total_bytes, chunked, tp)
        frac_note = "SGLang's default for this size"
    if not 0 < frac < 1:
        raise ValueError(f"mem-fraction-static: {frac:g} is not in (0, 1)")
    static = math.floor(view.available_bytes * frac)  # pre_model_load_memory = free at start (MemAvailable on UMA)
    weights = facts.weights_bytes // max(tp, 1)
    dtype = _dtype_bytes(facts, cmd.flag("dtype")) or 2
    act = max(int(512 * MiB + chunked * 1.5 * MiB), _activation(facts, chunked, 1, dtype))
    graphs = 0 if flag_set(cmd, "enforce_eager") else max(SGLANG_GRAPH_MAX_BS * 2 * MiB, CUDA_GRAPHS_BYTES)
    overhead = OVERHEAD_PYTHON_ENGINE_BYTES
    mine = jobs is None
    jobs = launch_jobs(view, weights + act + overhead, reserved) if jobs is None else jobs
    jit = jobs * JIT_JOB_BYTES
    kv = max(static - weights, 0)
    problems = []
    if weights >= static:
        problems.append(
            f"weights ({format_size(weights)}) fill mem_fraction_static {frac:g} × free ({format_size(static)}): "
            "SGLang stops with 'Loaded weights leave no GPU memory for the KV cache'"
        )
    terms = (
        Term("weights", weights, _weights_note(facts, tp)),
        Term("kv_cache", kv, f"{frac_note} {frac:g} × MemAvailable, less the weights"),
        Term("activation_peak", act, f"chunked prefill {chunked} tokens"),
        Term("cuda_graphs", graphs, "--disable-cuda-graph" if not graphs else f"decode max_bs {SGLANG_GRAPH_MAX_BS}"),
        Term("jit_workers", jit, _jit_note(jobs, mine, "before the KV pool")),
        Term("runtime_overhead", overhead, "CUDA context and host processes"),
    )
    needs = _peak(weights, kv, act, graphs=graphs, jit=jit, overhead=overhead)
    check = EngineCheck(FreeSource.NONE, 0, view.available_bytes, "SGLang sizes its pool from what is free")
    per_token = kv_bytes_per_token(facts, kv_dtype_bytes(cmd.flag("kv_cache_dtype")) or dtype, tp)
    return Estimate(
        kind=EngineKind.SGLANG, model=cmd.model, terms=terms, needs_bytes=needs, check=check,
        problems=tuple(problems), jobs=jobs, tune="mem-fraction-static", tune_value=frac,
        kv_per_token_bytes=per_token,
    )  # fmt: skip


def _llama(cmd: EngineCommand, facts: ModelFacts, view: MemoryView) -> Estimate:
    weights = facts.weights_bytes
    notes: list[str] = []
    ctx = flag_int(cmd, "ctx_size")
    if ctx is None or ctx == 0:
        ctx = facts.max_len
        if ctx is None:
            ctx = LLAMA_CTX_FALLBACK
            notes.append(f"context unknown: assumed {LLAMA_CTX_FALLBACK} tokens; pass -c")
        elif (cmd.flag("fit") or "on") != "off":
            notes.append("llama.cpp --fit (default on) may lower an unset context to fit free memory")
    ctx = -(-ctx // LLAMA_KV_PAD) * LLAMA_KV_PAD
    k_bytes = kv_dtype_bytes(cmd.flag("cache_type_k") or "f16") or 2.0
    v_bytes = kv_dtype_bytes(cmd.flag("cache_type_v") or "f16") or 2.0
    per_token = kv_bytes_per_token(facts, (k_bytes + v_bytes) / 2)
    if per_token is None:
        kv = 0
        notes.append("KV cache unknown: the model's header names no layers or heads")
    else:
        kv = per_token * ctx
    overhead = OVERHEAD_LLAMA_BYTES
    terms = (
        Term("weights", weights, _weights_note(facts, 1)),
        Term("kv_cache", kv, f"{ctx} tokens (-c), shared by the slots" if per_token else "unknown"),
        Term("activation_peak", 0, "in the compute buffers (runtime_overhead)"),
        Term("cuda_graphs", 0, "llama.cpp captures no ahead-of-time graphs"),
        Term("jit_workers", 0, "no JIT"),
        Term("runtime_overhead", overhead, "CUDA context and compute buffers"),
    )
    needs = weights + kv + overhead
    check = EngineCheck(FreeSource.NONE, 0, view.available_bytes, "llama.cpp reads MemAvailable on UMA (--fit)")
    return Estimate(
        kind=EngineKind.LLAMA_CPP, model=cmd.model, terms=terms, needs_bytes=needs, check=check, notes=tuple(notes),
        tune="ctx-size", tune_value=ctx, kv_per_token_bytes=per_token,
    )  # fmt: skip


def _weights_note(facts: ModelFacts, tp: int) -> str:
    if facts.error:
        return facts.error
    where = f"{facts.files} {facts.format} file{'s' if facts.files != 1 else ''}"
    return where + (f", split over {tp} ranks" if tp > 1 else "")


def estimate(
    cmd: EngineCommand,
    facts: ModelFacts,
    view: MemoryView,
    *,
    budget_bytes: int | None = None,
    jobs: int | None = None,
    engine_version: tuple[int, ...] | None = None,
    engine_reads: FreeSource | None = None,
    reserved_bytes: int = 0,
    extra: Sequence[Term] = (),
) -> Estimate:
    """The footprint estimate of `cmd`. `jobs`: the MAX_JOBS its compilers will run with (default: flashinfer's
    cap, launch_jobs, over MemAvailable less `reserved_bytes`, what engines still booting may still take: `reserve`).
    `engine_reads` overrides which figure vLLM's start-up check reads. `extra`: terms held in every phase besides
    the engine's own (a node's share of an engine spanning nodes: core.launch.nodeplan). Raises ValueError for a
    flag value the engine itself would refuse, naming the flag."""
    reserved = reserved_bytes
    if cmd.kind == EngineKind.VLLM:
        est = _vllm(cmd, facts, view, jobs, engine_version, reserved=reserved)
    elif cmd.kind == EngineKind.SGLANG:
        est = _sglang(cmd, facts, view, jobs, reserved)
    elif cmd.kind == EngineKind.LLAMA_CPP:
        est = _llama(cmd, facts, view)
    else:
        if budget_bytes is None:
            raise ValueError(f"{cmd.subcommand or 'this command'} is not an engine sparkwatch can size: pass --budget")
        est = Estimate(
            kind=EngineKind.OTHER,
            model=None,
            terms=(Term("budget", budget_bytes, "--budget"),),
            needs_bytes=budget_bytes,
            jobs=launch_jobs(view, budget_bytes, reserved) if jobs is None else jobs,
            tune="budget",
        )
    if cmd.kind == EngineKind.LLAMA_CPP:
        est = replace(est, jobs=launch_jobs(view, est.needs_bytes, reserved) if jobs is None else jobs)
    if engine_reads is not None and est.check is not None and est.check.source != FreeSource.NONE:
        check = EngineCheck(
            engine_reads, est.check.required_bytes, _read(view, engine_reads), f"--engine-reads {engine_reads}"
        )
        est = replace(est, check=check)
    if extra:
        est = replace(est, terms=(*est.terms, *extra), needs_bytes=est.needs_bytes + sum(t.bytes for t in extra))
    return est


# --- the fit


def is_fragmented(view: MemoryView) -> bool:
    """Less than FRAGMENT_RATIO of MemFree in free blocks of 2 MiB or more, by at least FRAGMENT_MIN_BYTES."""
    if view.contiguous_free_bytes is None:
        return False
    scattered = view.free_bytes - view.contiguous_free_bytes
    return scattered >= FRAGMENT_MIN_BYTES and view.contiguous_free_bytes < FRAGMENT_RATIO * view.free_bytes


def auto_budget(needs_bytes: int, margin_bytes: int) -> int:
    return needs_bytes + max(margin_bytes, math.ceil(needs_bytes * AUTO_BUDGET_SLACK))


def decide(
    est: Estimate,
    view: MemoryView,
    reservations: Sequence[Reservation] = (),
    learned: Learned | None = None,
    budget_bytes: int | None = None,
) -> Plan:
    """Hold the estimate (or the measured peak for the same key) against the pool, the engine's own check, the free
    high-order blocks and what running engines may still take."""
    needs = learned.peak_bytes if learned is not None else est.needs_bytes
    reserved = sum(r.reserved_bytes for r in reservations)
    room = view.available_bytes - view.floor_bytes - view.margin_bytes - reserved
    pool_short = max(needs - room, 0)
    check = est.check
    check_short = 0 if check is None or check.ok else check.required_bytes - check.value_bytes
    fragmented = is_fragmented(view)
    fits = pool_short == 0 and check_short == 0 and not fragmented and not est.problems
    short = max(pool_short, check_short)
    fixes = _fixes(
        est,
        view=view,
        reservations=reservations,
        needs=needs,
        room=room,
        pool_short=pool_short,
        check_short=check_short,
        fragmented=fragmented,
    )
    return Plan(
        estimate=est,
        view=view,
        reservations=tuple(reservations),
        needs_bytes=needs,
        available_bytes=room,
        fits=fits,
        short_bytes=short,
        fragmented=fragmented,
        fixes=fixes,
        learned=learned,
        budget_bytes=budget_bytes,
    )


def _fixes(
    est: Estimate,
    *,
    view: MemoryView,
    reservations: Sequence[Reservation],
    needs: int,
    room: int,
    pool_short: int,
    check_short: int,
    fragmented: bool,
) -> tuple[Fix, ...]:
    out: list[Fix] = [Fix(FixAction.LOWER_FLAG, text) for text in est.problem_fixes]
    check = est.check
    memfree = check_short and check is not None and check.source == FreeSource.MEM_FREE
    if memfree and check is not None and view.free_bytes + view.cached_bytes >= check.required_bytes:
        out.append(
            Fix(
                FixAction.DROP_CACHES,
                f"drop the page cache ({format_size(view.cached_bytes)}): sync; echo 1 > /proc/sys/vm/drop_caches",
                automatic=True,
            )
        )
    if fragmented:
        out.append(Fix(FixAction.COMPACT, "compact memory: echo 1 > /proc/sys/vm/compact_memory", automatic=True))
    if pool_short or (check_short and not out):
        short = max(pool_short, check_short)
        for r in sorted(reservations, key=lambda r: -(r.footprint_bytes + r.reserved_bytes)):
            held = r.footprint_bytes + r.reserved_bytes
            if held >= short:
                verb = "to finish booting or exit" if r.booting else "to exit"
                out.append(Fix(FixAction.WAIT, f"wait for {r.name} (pid {r.root_pid}, {format_size(held)}) {verb}"))
                break
        lower = _lower_flag(est, view, room, short)
        if lower is not None:
            out.append(lower)
    return tuple(out)


def _lower_flag(est: Estimate, view: MemoryView, room: int, short: int) -> Fix | None:
    """The value of the engine's sizing flag that would fit by arithmetic, or None when lowering it cannot help. Not
    planned again: `decide` alone has no command to apply it to; plan_launch (what launch runs) replaces it with a
    fix that was."""
    terms = {t.name: t.bytes for t in est.terms}
    kv = terms.get("kv_cache", 0)
    jit = terms.get("jit_workers", 0)
    if jit > kv + terms.get("cuda_graphs", 0) and est.jobs > 1:
        # The compiler burst decides the peak: fewer jobs (the user's MAX_JOBS, or ours) is the fix.
        rest = est.needs_bytes - jit
        jobs = max(1, (room - rest) // JIT_JOB_BYTES)
        if jobs < est.jobs:
            return Fix(
                FixAction.LOWER_FLAG, f"MAX_JOBS={jobs} (each compile job takes up to {format_size(JIT_JOB_BYTES)})"
            )
    if est.kind == EngineKind.VLLM and est.tune == "gpu-memory-utilization" and est.check is not None:
        # The footprint is util × total while the KV cache fills the rest: the util that fits both the pool and
        # vLLM's own check.
        budget = min(room, est.check.value_bytes)
        target = math.floor(budget / view.total_bytes * 100) / 100
        non_kv = est.needs_bytes - kv
        if target <= 0 or target * view.total_bytes <= non_kv:
            return Fix(FixAction.SMALLER_MODEL, "the model does not fit at any utilization: use a quantized model")
        return Fix(FixAction.LOWER_FLAG, f"--gpu-memory-utilization {target:.2f}")
    if est.kind == EngineKind.VLLM and est.check is not None and not est.check.ok:
        # --kv-cache-memory-bytes skips profiling, but vLLM's start-up check still wants utilization × total free
        # (vllm/v1/worker/utils.py request_memory runs unconditionally): lower the utilization to what is there.
        target = math.floor(est.check.value_bytes / view.total_bytes * 100) / 100
        if target > 0:
            return Fix(FixAction.LOWER_FLAG, f"--gpu-memory-utilization {target:.2f} (its start-up check)")
    if est.kind == EngineKind.VLLM:
        new_kv = kv - short
        if new_kv <= 0:
            return Fix(FixAction.SMALLER_MODEL, "the model does not fit even without a KV cache")
        return Fix(FixAction.LOWER_FLAG, f"--kv-cache-memory-bytes {new_kv >> 20}M")
    if est.kind == EngineKind.SGLANG:
        frac = est.tune_value
        if frac is None or view.available_bytes <= 0:
            return None
        target = math.floor((frac - short / view.available_bytes) * 100) / 100
        weights = next((t.bytes for t in est.terms if t.name == "weights"), 0)
        if target * view.available_bytes <= weights:
            return Fix(FixAction.SMALLER_MODEL, "the model does not fit at any --mem-fraction-static")
        return Fix(FixAction.LOWER_FLAG, f"--mem-fraction-static {target:.2f}")
    if est.kind == EngineKind.LLAMA_CPP:
        per = est.kv_per_token_bytes
        if per is None or kv <= short:
            return Fix(FixAction.SMALLER_MODEL, "the model does not fit: use a smaller quantization")
        ctx = (kv - short) // per // LLAMA_KV_PAD * LLAMA_KV_PAD
        if ctx <= 0:
            return Fix(FixAction.SMALLER_MODEL, "the model does not fit: use a smaller quantization")
        return Fix(FixAction.LOWER_FLAG, f"-c {ctx}")
    return Fix(FixAction.BUDGET, "free memory, or lower --budget")


# --- fixes that fit: planned again with the fix applied before they are suggested

Learn = Callable[[EngineCommand], "Learned | None"]
Replan = Callable[[EngineCommand, "int | None"], Plan]
Flags = tuple[tuple[str, str], ...]
Setting = Callable[[int], tuple[str, str]]  # a value of the engine's sizing flag (k hundredths, MiB, 256 tokens)
_PERCENT = 100


def plan_launch(
    cmd: EngineCommand,
    facts: ModelFacts,
    view: MemoryView,
    reservations: Sequence[Reservation] = (),
    *,
    learned_for: Learn | None = None,
    budget: int | str | None = None,
    jobs: int | None = None,
    engine_version: tuple[int, ...] | None = None,
    engine_reads: FreeSource | None = None,
    extra: Sequence[Term] = (),
) -> Plan:
    """`sparkwatch launch`'s plan: estimate and decide, and when it does not fit, the flag fix found by planning the
    command again with each candidate applied, so that a suggested fix fits (the old arithmetic suggested
    `--gpu-memory-utilization 0.59` where 0.59 still missed, and "use a quantized model" where only the JIT term
    did not fit). `budget`: bytes, "auto" (the need plus AUTO_BUDGET_SLACK) or None; `jobs`: the user's MAX_JOBS
    (None: launch sets launch_jobs' count); `learned_for`: the measured peak of a command's key (core.launch.peaks)."""
    reserved = sum(r.reserved_bytes for r in reservations)
    explicit = budget if isinstance(budget, int) else None

    def replan(command: EngineCommand, run_jobs: int | None) -> Plan:
        est = estimate(
            command, facts, view, budget_bytes=explicit, jobs=run_jobs, engine_version=engine_version,
            engine_reads=engine_reads, reserved_bytes=reserved, extra=extra,
        )  # fmt: skip
        learned = learned_for(command) if learned_for is not None else None
        needs = learned.peak_bytes if learned is not None else est.needs_bytes
        limit = auto_budget(needs, view.margin_bytes) if budget == "auto" else explicit
        return decide(est, view, reservations, learned, limit)

    plan = replan(cmd, jobs)
    if plan.fits or not (plan.estimate.problems or any(f.action in _FLAG_ACTIONS for f in plan.fixes)):
        return plan
    kept = [f for f in plan.fixes if f.action not in _FLAG_ACTIONS]
    return replace(plan, fixes=(*kept, _fitting_fix(plan, cmd, replan, jobs)))


_FLAG_ACTIONS = frozenset({FixAction.LOWER_FLAG, FixAction.SMALLER_MODEL})


def _passes(plan: Plan) -> bool:
    """Fits, fragmentation aside (compacting is a fix of its own, no flag cures it)."""
    return plan.short_bytes == 0 and not plan.estimate.problems


def _with_flags(cmd: EngineCommand, flags: Sequence[tuple[str, str]]) -> EngineCommand:
    """`cmd` with `flags` appended: each engine's parser takes the last value of a flag given twice."""
    return recognise((*cmd.argv, *(part for pair in flags for part in pair)))


def _smallest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The smallest k in [lo, hi] with ok(k), where ok holds from some k upward; None when ok(hi) does not hold."""
    if hi < lo or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest k in [lo, hi] with ok(k), where ok holds up to some k and not above it (the need grows with every
    sizing flag); None when ok(lo) does not hold."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _fitting_fix(plan: Plan, cmd: EngineCommand, replan: Replan, jobs: int | None) -> Fix:
    """The first fix that passes when planned again: the engine's sizing flag at the largest value that fits, with
    the MAX_JOBS it runs with now, then with fewer compile jobs (the JIT burst decides the peak in a small pool);
    else what would have to change (more memory, or a smaller model)."""
    est = plan.estimate
    options: list[int | None] = [jobs]
    jit = next((t.bytes for t in est.terms if t.name == "jit_workers"), 0)
    if jit and est.jobs > 1:
        rest = est.needs_bytes - jit
        guess = max(1, (plan.available_bytes - rest) // JIT_JOB_BYTES)
        options += sorted({min(guess, est.jobs - 1), 1}, reverse=True)
    for run_jobs in options:
        found = _flag_search(cmd, est, replan, run_jobs, try_as_is=run_jobs != jobs,
                             total_mib=plan.view.total_bytes >> 20)  # fmt: skip
        if found is not None:
            flags, _fixed = found
            return _fix_text(flags, run_jobs if run_jobs != jobs else None)
    return _no_fit(plan, cmd, replan, jit)


def _flag_search(
    cmd: EngineCommand, est: Estimate, replan: Replan, run_jobs: int | None, *, try_as_is: bool, total_mib: int
) -> tuple[Flags, Plan] | None:
    def plan_with(flags: Flags) -> Plan:
        return replan(_with_flags(cmd, flags), run_jobs)

    def complete(flags: Flags) -> tuple[Flags, Plan] | None:
        """`flags` when they pass; else with the flag that cures the engine's own refusal (KV under one sequence:
        --max-model-len), when that passes."""
        fixed = plan_with(flags)
        if _passes(fixed):
            return flags, fixed
        if fixed.short_bytes == 0 and fixed.estimate.problem_fixes:
            extra = tuple(_pair(text) for text in fixed.estimate.problem_fixes)
            again = plan_with(flags + extra)
            if _passes(again):
                return flags + extra, again
        return None

    def sized(setting: Setting, lo: int, below: int, top: int, base: Flags = ()) -> tuple[Flags, Plan] | None:
        """The engine's sizing flag: where the engine would refuse its setting as too small (weights and
        activations over utilization × total, a KV cache under one sequence, weights that fill the fraction) and no
        other flag cures it, the least value up to `top` at which it starts, if the pool holds that; else the
        largest value up to `below` (the setting now: a fix lowers it) that the pool holds."""

        def at(k: int) -> Plan:
            return plan_with((*base, setting(k)))

        if est.problems and not est.problem_fixes:
            k = _smallest(lo, top, lambda k: not at(k).estimate.problems)
            return None if k is None or at(k).short_bytes else complete((*base, setting(k)))
        k = _largest(lo, below, lambda k: at(k).short_bytes == 0)
        return None if k is None else complete((*base, setting(k)))

    now = 0 if est.tune_value is None else math.ceil(est.tune_value * _PERCENT) - 1  # hundredths below the setting
    if try_as_is or est.problem_fixes:
        found = complete(())
        if found is not None:
            return found
    if est.kind == EngineKind.VLLM and est.tune == "gpu-memory-utilization":
        return sized(_util, 1, now, _PERCENT)
    if est.kind == EngineKind.VLLM and est.tune == "kv-cache-memory-bytes":
        # vLLM's start-up check still wants utilization × total free (vllm/v1/worker/utils.py request_memory runs
        # with --kv-cache-memory-bytes too): the utilization that passes it, then the KV bytes that fit the pool.
        base: Flags = ()
        if est.check is not None and not est.check.ok:
            k = _largest(1, _PERCENT, lambda k: _check_ok(plan_with((_util(k),))))
            if k is None:
                return None
            base = (_util(k),)
        kv_mib = next((t.bytes for t in est.terms if t.name == "kv_cache"), 0) >> 20
        return sized(_kv, 0, kv_mib, total_mib, base)
    if est.kind == EngineKind.SGLANG:
        return sized(_frac, 1, now, _PERCENT - 1)  # (0, 1), as SGLang takes it
    if est.kind == EngineKind.LLAMA_CPP and est.tune_value is not None:
        top = int(est.tune_value) // LLAMA_KV_PAD - 1
        return sized(_ctx, 1, top, top)
    return None


def _util(k: int) -> tuple[str, str]:
    return ("--gpu-memory-utilization", f"{k / _PERCENT:.2f}")


def _frac(k: int) -> tuple[str, str]:
    return ("--mem-fraction-static", f"{k / _PERCENT:.2f}")


def _kv(mib: int) -> tuple[str, str]:
    return ("--kv-cache-memory-bytes", f"{mib}M")  # vLLM's human_readable_int: M is MiB


def _ctx(k: int) -> tuple[str, str]:
    return ("-c", str(k * LLAMA_KV_PAD))


def _pair(text: str) -> tuple[str, str]:
    flag, _sep, value = text.partition(" ")
    return flag, value


def _check_ok(plan: Plan) -> bool:
    return plan.estimate.check is None or plan.estimate.check.ok


def _fix_text(flags: Sequence[tuple[str, str]], max_jobs: int | None) -> Fix:
    parts = [f"MAX_JOBS={max_jobs}"] if max_jobs is not None else []
    parts += [f"{flag} {value}" for flag, value in flags]
    text = " ".join(parts)
    if max_jobs is not None:
        text += f" (each compile job takes up to {format_size(JIT_JOB_BYTES)})"
    return Fix(FixAction.LOWER_FLAG, text, flags=tuple(flags), max_jobs=max_jobs)


def _no_fit(plan: Plan, cmd: EngineCommand, replan: Replan, jit: int) -> Fix:
    """No setting fits: a smaller model when the weights alone exceed what is free, else how much more memory the
    engine needs at its smallest setting (with MAX_JOBS=1: in a small pool the 8 GiB of one compile job decides, and
    a 1 GiB model was told to use a quantized model)."""
    est = plan.estimate
    weights = next((t.bytes for t in est.terms if t.name == "weights"), 0)
    free = max(plan.available_bytes, 0)
    if weights > free:
        return Fix(
            FixAction.SMALLER_MODEL,
            f"the weights alone take {format_size(weights)}, {format_size(free)} free: use a quantized or smaller "
            "model",
        )
    if est.problems and not est.problem_fixes:
        return _no_start(plan, cmd, replan, jit)
    smallest = {
        EngineKind.VLLM: (_util(1),) if est.tune == "gpu-memory-utilization" else (_kv(0),),
        EngineKind.SGLANG: (_frac(1),),
        EngineKind.LLAMA_CPP: (_ctx(1),),
    }.get(est.kind, ())
    least = replan(_with_flags(cmd, smallest), 1 if jit else None)
    short = max(least.needs_bytes - least.available_bytes, 0) or plan.short_bytes
    why = f", one compile job of up to {format_size(JIT_JOB_BYTES)} included" if jit else ""
    return Fix(
        FixAction.FREE_MEMORY,
        f"free {format_size(short)}: no setting fits, at its smallest it needs {format_size(least.needs_bytes)}{why}",
    )


def _no_start(plan: Plan, cmd: EngineCommand, replan: Replan, jit: int) -> Fix:
    """The engine would refuse its setting as too small, and the pool holds no setting at which it starts (say a
    learned peak fits the pool while the estimate's setting is one vLLM would refuse): the least setting at which it
    starts, and how much more memory that needs; a smaller model when it starts at none."""
    est = plan.estimate
    setting = {
        EngineKind.VLLM: (_util, 1, _PERCENT) if est.tune == "gpu-memory-utilization" else
        (_kv, 0, plan.view.total_bytes >> 20),
        EngineKind.SGLANG: (_frac, 1, _PERCENT - 1),
    }.get(est.kind)  # fmt: skip
    jobs = 1 if jit else None
    if setting is not None:
        pair, bottom, top = setting

        def at(k: int) -> Plan:
            return replan(_with_flags(cmd, (pair(k),)), jobs)

        k = _smallest(bottom, top, lambda k: not at(k).estimate.problems)
        if k is not None:
            least = at(k)
            if least.short_bytes == 0:
                return _fix_text((pair(k),), jobs)
            flag, value = pair(k)
            return Fix(
                FixAction.FREE_MEMORY,
                f"free {format_size(least.short_bytes)}: {est.kind} starts from {flag} {value}, which needs "
                f"{format_size(least.needs_bytes)}" + (f", one compile job of up to {format_size(JIT_JOB_BYTES)} "
                                                       "included" if jit else ""),
            )  # fmt: skip
    return Fix(FixAction.SMALLER_MODEL, f"no setting cures it ({est.problems[0]}): use a smaller or quantized model")


def miss_reasons(plan: Plan, *, figures: bool = True) -> list[str]:
    """Why `plan` does not fit, each in words, the engine's own refusal first: it would refuse the settings, its
    start-up check would fail, the pool is short (`figures`: with the need and what is free), memory is fragmented.
    The headline of the plan and the gate's line both say these, never a bare "short by 0 B"."""
    est = plan.estimate
    out = list(est.problems[:1])
    check = est.check
    if check is not None and not check.ok:
        out.append(
            f"its own start-up check wants {format_size(check.required_bytes)} of {check.source}, "
            f"{format_size(check.value_bytes)} there"
        )
    pool_short = plan.needs_bytes - plan.available_bytes
    if pool_short > 0 and figures:
        basis = "measured peak" if plan.learned is not None else "needs"
        out.append(
            f"{basis} {format_size(plan.needs_bytes)}, {format_size(max(plan.available_bytes, 0))} free above the "
            f"floor and margin: short by {format_size(pool_short)}"
        )
    elif pool_short > 0:
        out.append(f"short by {format_size(pool_short)}")
    if plan.fragmented and plan.view.contiguous_free_bytes is not None:
        out.append(
            f"memory is fragmented ({format_size(plan.view.contiguous_free_bytes)} of "
            f"{format_size(plan.view.free_bytes)} free is in blocks of 2 MiB or more)"
        )
    return out


def budget_warning(plan: Plan) -> str | None:
    """A budget under what the plan says the engine takes (its measured peak, else the estimate): the guard kills
    the tree once it passes the budget, so such an engine is killed on its way up, most likely during its boot. None
    when the budget holds the need (or there is no budget, or the command's need is the budget itself)."""
    budget = plan.budget_bytes
    if budget is None or budget >= plan.needs_bytes or plan.estimate.kind == EngineKind.OTHER:
        return None
    basis = "measured peak" if plan.learned is not None else "estimate"
    return (
        f"the budget {format_size(budget)} is under the plan's {basis} {format_size(plan.needs_bytes)}: the guard "
        f"kills the engine once its tree passes {format_size(budget)}, most likely during its boot "
        "(--budget auto: the need plus 10 %)"
    )


def fix_text(plan: Plan) -> str:
    """The fixes of a plan that does not fit, in one phrase."""
    return "; ".join(f.text for f in plan.fixes) or "free memory"


def fix_line(plan: Plan) -> str:
    """The one line the gate prints: why it misses, by how much, and the fix."""
    est = plan.estimate
    what = f"{est.kind}" + (f" {est.model}" if est.model else "")
    return f"sparkwatch: {what} does not fit: {'; '.join(miss_reasons(plan))}; fix: {fix_text(plan)}"
