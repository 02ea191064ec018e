"""Which engine a command line starts, and the flags that size its memory, read the way the engine's own CLI reads
them. Pure: takes argv, returns an EngineCommand. `sparkwatch launch` plans from it (core.launch.plan).

- vLLM (`vllm serve [MODEL]`, `python -m vllm.entrypoints.openai.api_server --model M`): vLLM's
  FlexibleArgumentParser (vllm/utils/argparse_utils.py) turns underscores in long names into dashes (the part before
  the first '.'), accepts `--key=value`, and argparse's unambiguous prefixes (its own log suggests
  `--kv-cache-memory=N` for `--kv-cache-memory-bytes`). The positional model wins over `--model`
  (vllm/entrypoints/cli/serve.py); without either the model is Qwen/Qwen3-0.6B (vllm/config/model.py).
- SGLang (`python -m sglang.launch_server --model-path M`, `sglang serve M`): python/sglang/srt/server_args.py and
  sglang/srt/arg_groups/fields/*.py (0.5.23), `--model` is an alias of `--model-path`.
- llama.cpp (`llama-server -m F`, `python -m llama_cpp.server --model F`): common/arg.cpp names every spelling
  (`-c`/`--ctx-size`, `-ngl`/`--gpu-layers`/`--n-gpu-layers`, `-ctk`/`--cache-type-k`, …).
Anything else is `other`: it needs `--budget`.

Sizes are parsed as the engines parse them: vLLM's and SGLang's `human_readable_int` take `1k` = 1000 and
`1K` = 1024 (vllm/utils/argparse_utils.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from sparkwatch.core.bounded import shown, whole, within
from sparkwatch.core.engines.identity import entry_point
from sparkwatch.core.units import SIZE_MAX_BYTES

# The clients whose command runs a container (`docker run`, `docker compose up`, `docker-compose up`): launch plans the
# engine inside (core.launch.dockerargv reads their argv), never the client itself.
DOCKER_CLIENT, COMPOSE_V1_CLIENT = "docker", "docker-compose"
CONTAINER_CLIENTS = (DOCKER_CLIENT, COMPOSE_V1_CLIENT)


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMA_CPP = "llama.cpp"
    OTHER = "other"


# vLLM's default model when none is given (vllm/config/model.py: ModelConfig.model).
VLLM_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"

# Long flag -> canonical name, per engine: every spelling the engine accepts for the flags that size memory.
_VLLM_FLAGS: Mapping[str, str] = {
    "--model": "model",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--device-memory-utilization": "gpu_memory_utilization",
    "--kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "--max-model-len": "max_model_len",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "-pp": "pipeline_parallel_size",
    "--nnodes": "nnodes",
    "--node-rank": "node_rank",
    "--headless": "headless",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--enforce-eager": "enforce_eager",
    "--dtype": "dtype",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--quantization": "quantization",
    "-q": "quantization",
    "--download-dir": "download_dir",
    "--revision": "revision",
    "--served-model-name": "served_model_name",
}
_SGLANG_FLAGS: Mapping[str, str] = {
    "--model-path": "model",
    "--model": "model",
    "--mem-fraction-static": "mem_fraction_static",
    "--context-length": "max_model_len",
    "--tp-size": "tensor_parallel_size",
    "--tensor-parallel-size": "tensor_parallel_size",
    "--pp-size": "pipeline_parallel_size",
    "--pipeline-parallel-size": "pipeline_parallel_size",
    "--nnodes": "nnodes",
    "--node-rank": "node_rank",
    "--dtype": "dtype",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--quantization": "quantization",
    "--chunked-prefill-size": "chunked_prefill_size",
    "--max-total-tokens": "max_total_tokens",
    "--disable-cuda-graph": "enforce_eager",
    "--revision": "revision",
}
_LLAMA_FLAGS: Mapping[str, str] = {
    "-m": "model",
    "--model": "model",
    "-c": "ctx_size",
    "--ctx-size": "ctx_size",
    "-ngl": "n_gpu_layers",
    "--gpu-layers": "n_gpu_layers",
    "--n-gpu-layers": "n_gpu_layers",
    "-ctk": "cache_type_k",
    "--cache-type-k": "cache_type_k",
    "-ctv": "cache_type_v",
    "--cache-type-v": "cache_type_v",
    "-np": "parallel",
    "--parallel": "parallel",
    "-fit": "fit",
    "--fit": "fit",
    "--n_ctx": "ctx_size",  # llama-cpp-python's server (llama_cpp/server/settings.py)
    "--n_gpu_layers": "n_gpu_layers",
}
# Flags that take no value (a following word is the next argument, not their value).
_BOOLEAN = frozenset({"enforce_eager", "headless"})
# argparse accepts an unambiguous prefix of a long flag; shorter prefixes than this are not trusted (we know only the
# memory flags, not every flag the engine has, so a short prefix might belong to one we do not know).
_MIN_PREFIX = 8


@dataclass(frozen=True, slots=True)
class EngineCommand:
    kind: EngineKind
    model: str | None  # a path, a Hugging Face repo id, or None (unknown / not an engine)
    flags: Mapping[str, str] = field(default_factory=dict)  # canonical name -> value as written ('' for booleans)
    argv: tuple[str, ...] = ()
    subcommand: str = ""  # "serve", "launch_server", "llama-server", …
    spelled: Mapping[str, str] = field(default_factory=dict)  # canonical name -> the flag as written ("-c")

    def flag(self, name: str) -> str | None:
        return self.flags.get(name)

    def flag_name(self, name: str) -> str:
        """The flag as the command wrote it, for an error line: `-c`, not ctx_size."""
        return self.spelled.get(name) or "--" + name.replace("_", "-")


def _vllm_normalise(arg: str) -> str:
    """vLLM's FlexibleArgumentParser: `--a_b.c_d` -> `--a-b.c_d` (underscores only before the first '.')."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    head, dot, tail = name.partition(".")
    return head.replace("_", "-") + dot + tail + eq + value


def _resolve(flag: str, table: Mapping[str, str]) -> str | None:
    if flag in table:
        return table[flag]
    if flag.startswith("--") and len(flag) >= _MIN_PREFIX:
        hits = {canon for spelled, canon in table.items() if spelled.startswith(flag)}
        if len(hits) == 1:
            return hits.pop()
    return None


def parse_flags(
    args: Sequence[str], table: Mapping[str, str], *, vllm: bool = False, spelled: dict[str, str] | None = None
) -> tuple[dict[str, str], list[str]]:
    """(canonical flags, positionals) from an engine's arguments. Unknown flags are skipped with the word after them
    when it is not itself a flag (its value, most likely). `spelled` receives each known flag as written."""
    flags: dict[str, str] = {}
    spelled = {} if spelled is None else spelled
    positionals: list[str] = []
    i = 0
    while i < len(args):
        arg = _vllm_normalise(args[i]) if vllm else args[i]
        i += 1
        if not arg.startswith("-") or arg == "-":
            positionals.append(arg)
            continue
        if arg == "--":
            positionals.extend(args[i:])
            break
        name, eq, value = arg.partition("=")
        canon = _resolve(name, table)
        if canon is not None:
            spelled[canon] = name
        if canon in _BOOLEAN:
            flags[canon] = value if eq else ""
            continue
        if not eq:
            if i < len(args) and not (args[i].startswith("-") and not _is_number(args[i])):
                value = args[i]
                i += 1
            else:
                value = ""
        if canon is not None:
            flags[canon] = value
    return flags, positionals


def _is_number(text: str) -> bool:
    return bool(re.fullmatch(r"-?\d+(\.\d+)?", text))


_PREFIXES = ("env", "nice", "nohup", "setsid", "stdbuf")


def _strip_wrappers(argv: Sequence[str]) -> tuple[str, ...]:
    """`env A=1 nohup vllm serve m` -> `vllm serve m`; `uv run vllm …` -> `vllm …`."""
    out = list(argv)
    while out:
        base = out[0].rsplit("/", 1)[-1]
        if base in _PREFIXES:
            out.pop(0)
            while out and (("=" in out[0] and not out[0].startswith("-")) or out[0].startswith("-")):
                out.pop(0)
        elif base == "uv" and len(out) > 1 and out[1] == "run":
            out = out[2:]
            while out and out[0].startswith("-"):
                out.pop(0)
        else:
            break
    return tuple(out)


def recognise(argv: Sequence[str]) -> EngineCommand:
    """The engine `argv` starts, with the flags that size its memory."""
    argv = _strip_wrappers(argv)
    entry, rest = entry_point(argv)
    spelled: dict[str, str] = {}
    rest_l = list(rest)
    if entry == "vllm" and rest_l and rest_l[0] == "serve":
        flags, pos = parse_flags(rest_l[1:], _VLLM_FLAGS, vllm=True, spelled=spelled)
        model = pos[0] if pos else flags.get("model") or VLLM_DEFAULT_MODEL
        return EngineCommand(EngineKind.VLLM, model, flags, tuple(argv), "serve", spelled)
    if entry in ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server") or (
        entry == "vllm.entrypoints.cli.main" and rest_l[:1] == ["serve"]
    ):
        args = rest_l[1:] if rest_l[:1] == ["serve"] else rest_l
        flags, pos = parse_flags(args, _VLLM_FLAGS, vllm=True, spelled=spelled)
        model = (pos[0] if pos and rest_l[:1] == ["serve"] else None) or flags.get("model") or VLLM_DEFAULT_MODEL
        return EngineCommand(EngineKind.VLLM, model, flags, tuple(argv), "serve", spelled)
    if entry == "sglang.launch_server" or (entry == "sglang" and rest_l[:1] == ["serve"]):
        args = rest_l[1:] if entry == "sglang" else rest_l
        flags, pos = parse_flags(args, _SGLANG_FLAGS, spelled=spelled)
        sg_model = flags.get("model") or (pos[0] if pos else None)
        return EngineCommand(EngineKind.SGLANG, sg_model, flags, tuple(argv), "serve", spelled)
    if entry in ("llama-server", "llama-cli", "llama_cpp.server"):
        flags, _pos = parse_flags(rest_l, _LLAMA_FLAGS, spelled=spelled)
        return EngineCommand(EngineKind.LLAMA_CPP, flags.get("model"), flags, tuple(argv), entry, spelled)
    return EngineCommand(EngineKind.OTHER, None, {}, tuple(argv), entry)


_NUMBER_CHARS_MAX = 40
_HUMAN_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)\s*$")
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_readable_int(text: str) -> int:
    """vLLM's `human_readable_int` (vllm/utils/argparse_utils.py): `25.6k` = 25600, `1K` = 1024, `2G` = 2**31.
    Decimals are not allowed with binary suffixes. Raises ValueError."""
    match = _HUMAN_RE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a number")
    number, suffix = match.groups()
    if len(number) > _NUMBER_CHARS_MAX:  # never float() 400 digits: inf, and int(inf) raised OverflowError
        raise ValueError(f"{shown(text)} is too large")
    if suffix in _BINARY:
        if "." in number:
            raise ValueError(f"{text!r}: decimals are not allowed with binary suffixes")
        return int(number) * _BINARY[suffix]
    return int(float(number) * _DECIMAL[suffix])


# The range of each integer flag the plan reads (core.bounded says why every number has one). Token counts stop at
# 2**31 - 1: llama.cpp reads -c with std::stoi (common/arg.cpp), an int32.
TOKENS_MAX = 2**31 - 1
TP_MAX = 4096
_INT_RANGES: Mapping[str, tuple[int, int, str]] = {
    "max_model_len": (1, TOKENS_MAX, "tokens"),
    "ctx_size": (0, TOKENS_MAX, "tokens"),  # 0: the model's own (llama.cpp)
    "max_num_seqs": (1, TOKENS_MAX, "sequences"),
    "max_num_batched_tokens": (1, TOKENS_MAX, "tokens"),
    "chunked_prefill_size": (1, TOKENS_MAX, "tokens"),
    "max_total_tokens": (1, TOKENS_MAX, "tokens"),
    "tensor_parallel_size": (1, TP_MAX, "ranks"),
    "pipeline_parallel_size": (1, TP_MAX, "stages"),
    "nnodes": (1, TP_MAX, "nodes"),
    "node_rank": (0, TP_MAX - 1, "node rank"),
    "kv_cache_memory_bytes": (0, SIZE_MAX_BYTES, "bytes"),
}


def flag_float(cmd: EngineCommand, name: str) -> float | None:
    """A float flag's value, None when absent. Raises ValueError naming the flag as written when it is not a finite
    number (`--gpu-memory-utilization 999…` was inf)."""
    text = cmd.flag(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{cmd.flag_name(name)}: {shown(text)} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{cmd.flag_name(name)}: {shown(text)} is not a finite number")
    return value


def flag_int(cmd: EngineCommand, name: str) -> int | None:
    """An integer flag's value as the engine parses it (`32k`, `-1`, `auto` -> None), in its range (_INT_RANGES).
    Raises ValueError naming the flag as written."""
    text = cmd.flag(name)
    if text is None or text in ("auto", "-1", "all"):
        return None
    low, high, unit = _INT_RANGES.get(name, (-TOKENS_MAX, TOKENS_MAX, ""))
    try:
        if text.strip().lstrip("+-").isdigit():
            return whole(text, low, high, unit)
        return within(human_readable_int(text), low, high, unit)
    except ValueError as exc:
        raise ValueError(f"{cmd.flag_name(name)}: {exc}") from None


def flag_set(cmd: EngineCommand, name: str) -> bool:
    value = cmd.flag(name)
    return value is not None and value.lower() not in ("false", "0", "off")
