"""A model checkpoint's sizes and shape, for `sparkwatch launch`'s plan: file SIZES only (stat), never weights.

What is read:
- the size of every weight file (os.stat follows the Hugging Face cache's snapshot symlinks to their blobs; a sparse
  file counts its apparent size, as the engine would read it whole). With `model.safetensors.index.json` only the
  shards its weight_map names count (vLLM filters the same way: a repo may hold both a consolidated file and shards);
- config.json (bounded), for the KV cache: num_hidden_layers, the KV heads under every alias vLLM accepts, head_dim
  or hidden_size / num_attention_heads, the dtype (`dtype`, then transformers' older `torch_dtype`), the text
  config of a multimodal model first (vllm/transformers_utils/model_arch_config_convertor.py);
- for a GGUF file, the metadata keys at the head of the file (block_count, attention.head_count_kv, key_length, …,
  src/llama-arch.cpp), at most GGUF_HEADER_MAX_BYTES, stopping before the tokenizer's arrays. No tensor is read.

Where a Hugging Face id is found (huggingface_hub constants.py and file_download.py): `--download-dir`, else
$HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub;
inside it models--ORG--NAME/refs/<revision> names the snapshot (snapshots/<sha>/).
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from sparkwatch.core.plan import ModelFacts

CONFIG_MAX_BYTES = 4 << 20
INDEX_MAX_BYTES = 32 << 20  # a 1,000-shard index is a few MiB
GGUF_HEADER_MAX_BYTES = 1 << 20
_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
_WEIGHT_EXTS = ((".safetensors", "safetensors"), (".gguf", "gguf"), (".bin", "pytorch"), (".pt", "pytorch"))
# config.json aliases for the KV head count, in vLLM's order (vllm/transformers_utils/config.py
# CONFIG_FIELD_ALIASES["total_num_kv_heads"]), then num_attention_heads.
KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num", "num_attention_groups")
MAX_LEN_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_target_positions", "max_sequence_length",
)  # fmt: skip
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8_e4m3fn": 1}


def hub_cache(env: Mapping[str, str]) -> Path:
    """Where huggingface_hub keeps its cache (constants.py: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME)."""
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    legacy = env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(env.get("HF_HUB_CACHE") or legacy)))


def snapshot_dir(cache: Path, repo_id: str, revision: str | None = None) -> Path | None:
    """models--ORG--NAME/snapshots/<sha>/ for `revision` (default main: refs/main holds the sha), else the newest."""
    folder = cache / ("models--" + "--".join(repo_id.split("/")))
    snapshots = folder / "snapshots"
    rev = revision or "main"
    try:
        sha = (folder / "refs" / rev).read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        sha = rev
    if sha and (snapshots / sha).is_dir():
        return snapshots / sha
    try:
        entries = [e for e in os.scandir(snapshots) if e.is_dir()]
    except OSError:
        return None
    if not entries:
        return None
    return Path(max(entries, key=lambda e: e.stat().st_mtime).path)


def resolve(
    model: str, env: Mapping[str, str], download_dir: str | None = None, revision: str | None = None
) -> Path | None:
    """The local directory or file `model` names: a path as given, else its Hugging Face cache snapshot."""
    path = Path(os.path.expanduser(model))
    if path.exists():
        return path
    if model.count("/") == 1 and not model.startswith(("/", ".")):
        cache = Path(download_dir) if download_dir else hub_cache(env)
        return snapshot_dir(cache, model, revision)
    return None


def _size(path: Path) -> int:
    return os.stat(path).st_size  # follows the snapshot's symlink to the blob


def _read_json(path: Path, limit: int) -> Any:
    with open(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path.name} is larger than {limit >> 20} MiB")
    return json.loads(data)


def weight_files(directory: Path) -> tuple[str, list[Path]]:
    """(format, files) of a checkpoint directory: safetensors shards (filtered by the index), else GGUF, else .bin."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return "none", []
    for ext, fmt in _WEIGHT_EXTS:
        files = [directory / n for n in names if n.endswith(ext) and not n.startswith(".")]
        if not files:
            continue
        if fmt == "safetensors" and (directory / "model.safetensors.index.json").is_file():
            try:
                index = _read_json(directory / "model.safetensors.index.json", INDEX_MAX_BYTES)
                wanted = set(index.get("weight_map", {}).values())
            except (OSError, ValueError, AttributeError):
                wanted = set()
            listed = [f for f in files if f.name in wanted]
            files = listed or files
        return fmt, files
    return "none", []


def gguf_shards(path: Path) -> list[Path]:
    """A split GGUF's siblings (`name-00001-of-00003.gguf`), or the file alone."""
    m = _SHARD_RE.match(path.name)
    if not m:
        return [path]
    n = int(m.group("n"))
    return [path.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config: `text_config` (or `llm_config`) merged over the top level."""
    for key in ("text_config", "llm_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, Mapping):
            return {**config, **sub}
    return config


def _int(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def facts_from_config(config: Mapping[str, Any]) -> dict[str, int | None]:
    """The KV-cache fields of a config.json, read as vLLM reads them."""
    cfg = text_config(config)
    heads = _int(cfg, "num_attention_heads", "n_head")
    hidden = _int(cfg, "hidden_size", "n_embd", "d_model")
    head_dim = _int(cfg, "head_dim", "hidden_size_per_head")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    kv_heads = _int(cfg, *KV_HEAD_KEYS) or heads
    if cfg.get("multi_query") is True:  # falcon
        kv_heads = 1
    mla = None
    lora, rope = _int(cfg, "kv_lora_rank"), _int(cfg, "qk_rope_head_dim")
    if lora is not None and rope is not None:
        mla = lora + rope
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    lens = [v for k in MAX_LEN_KEYS if (v := _int(cfg, k)) is not None]
    return {
        "layers": _int(cfg, "num_hidden_layers", "n_layer", "num_layers"),
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "mla_dim": mla,
        "dtype_bytes": _DTYPE_BYTES.get(str(dtype)) if dtype else None,
        "hidden_size": hidden,
        "intermediate_size": _int(cfg, "intermediate_size", "ffn_hidden_size", "n_inner"),
        "vocab_size": _int(cfg, "vocab_size"),
        "max_len": min(lens) if lens else None,
    }


# GGUF value types (ggml/include/gguf.h): fixed sizes by type id; 8 = string, 9 = array.
_GGUF_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_KEYS = {
    "block_count": "layers",
    "attention.head_count_kv": "kv_heads",
    "attention.head_count": "heads",
    "attention.key_length": "head_dim",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "context_length": "max_len",
}


class _Bounded:
    def __init__(self, fh: BinaryIO, limit: int) -> None:
        self.fh, self.left = fh, limit

    def read(self, n: int) -> bytes:
        if n > self.left:
            raise EOFError("GGUF header larger than the bound")
        data = self.fh.read(n)
        if len(data) < n:
            raise EOFError("truncated GGUF header")
        self.left -= n
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack("<" + fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.read(self.unpack("Q")).decode("utf-8", "replace")


def gguf_metadata(path: Path, limit: int = GGUF_HEADER_MAX_BYTES) -> dict[str, int]:
    """The model-shape keys at the head of a GGUF file, reading at most `limit` bytes and no tensor data.

    Stops at the first array (the tokenizer's token lists come after the architecture's keys, as llama.cpp's
    converters write them) or once every wanted key was seen."""
    out: dict[str, int] = {}
    with open(path, "rb") as fh:
        r = _Bounded(fh, limit)
        if r.read(4) != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file")
        version = r.unpack("I")
        if version < 2:
            raise ValueError(f"{path.name}: GGUF version {version} is not supported")
        r.unpack("Q")  # tensor count
        count = r.unpack("Q")
        arch = ""
        for _ in range(count):
            key = r.string()
            vtype = r.unpack("I")
            if vtype == 9:
                break
            if vtype == 8:
                value: Any = r.string()
            elif vtype in _GGUF_FIXED:
                value = r.unpack(_GGUF_FIXED[vtype])
            else:
                break
            if key == "general.architecture" and isinstance(value, str):
                arch = value
            elif arch and key.startswith(arch + "."):
                name = _GGUF_KEYS.get(key[len(arch) + 1 :])
                if name is not None and isinstance(value, int) and not isinstance(value, bool):
                    out[name] = value
            if len(out) == len(_GGUF_KEYS):
                break
    if "head_dim" not in out and out.get("hidden_size") and out.get("heads"):
        out["head_dim"] = out["hidden_size"] // out["heads"]
    if "kv_heads" not in out and "heads" in out:
        out["kv_heads"] = out["heads"]
    out.pop("heads", None)
    return out


def read_facts(
    model: str | None, env: Mapping[str, str], download_dir: str | None = None, revision: str | None = None
) -> ModelFacts:
    """Sizes and shape of the checkpoint `model` names. Never raises for a missing or odd checkpoint: the facts then
    carry `error` and the plan says the weights are unknown."""
    if not model:
        return ModelFacts(source="", error="no model named")
    path = resolve(model, env, download_dir, revision)
    if path is None:
        return ModelFacts(source=model, error=f"{model}: not a local path and not in the Hugging Face cache")
    try:
        if path.is_file():
            files = gguf_shards(path) if path.suffix == ".gguf" else [path]
            fmt = "gguf" if path.suffix == ".gguf" else "pytorch"
            directory = path.parent
        else:
            fmt, files = weight_files(path)
            directory = path
        weights = sum(_size(f) for f in files)
    except OSError as exc:
        return ModelFacts(source=str(path), error=f"{path}: {exc.strerror or exc}")
    shape: dict[str, int | None] = {}
    error = None
    config = directory / "config.json"
    try:
        if config.is_file():
            shape = facts_from_config(_read_json(config, CONFIG_MAX_BYTES))
        elif fmt == "gguf" and files:
            shape = {**gguf_metadata(files[0])}
            shape.setdefault("dtype_bytes", 2)
    except (OSError, ValueError, EOFError, struct.error) as exc:
        error = f"model shape unknown: {exc}"
    if not files:
        error = f"{path}: no weight files (.safetensors, .gguf, .bin)"
    return ModelFacts(source=str(path), weights_bytes=weights, files=len(files), format=fmt, error=error, **shape)
