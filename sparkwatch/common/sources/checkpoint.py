"""A model checkpoint's sizes and shape, for `sparkwatch launch`'s plan: file SIZES only (stat), never weights.

What is read:
- the size of every weight file (os.stat follows the Hugging Face cache's snapshot symlinks to their blobs; a sparse
  file counts its apparent size, as the engine would read it whole). With `model.safetensors.index.json` only the
  shards its weight_map names count (vLLM filters the same way: a repo may hold both a consolidated file and shards);
- config.json (bounded), for the KV cache: num_hidden_layers, the KV heads under every alias vLLM accepts, head_dim
  or hidden_size / num_attention_heads, the dtype (`dtype`, then transformers' older `torch_dtype`), the text
  config of a multimodal model first (vllm/transformers_utils/model_arch_config_convertor.py);
- for a GGUF file, the metadata keys at the head of the file (block_count, attention.head_count_kv, key_length, …,
  src/llama-arch.cpp), at most GGUF_HEADER_MAX_BYTES, arrays before them skipped by their lengths, stopping before
  the tokenizer's keys. No tensor is read.

Bounded input: every file is opened without blocking and refused unless it is a regular file (common.durable: a FIFO
named model.gguf hung `launch --plan`), JSON nesting is checked before it is parsed (a config.json nested 100,000
deep raised RecursionError), and every number taken from config.json or a GGUF header has a range (SHAPE_RANGES: a
400-digit num_hidden_layers raised OverflowError). Such a file raises CheckpointError, one line naming the file and
the key: the engine could not load it either. A checkpoint that is simply not there (not downloaded yet) is no error:
the facts say so.

Where a Hugging Face id is found (huggingface_hub constants.py and file_download.py): `--download-dir`, else
$HF_HUB_CACHE, $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub;
inside it models--ORG--NAME/refs/<revision> names the snapshot (snapshots/<sha>/).
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from collections.abc import Mapping
from itertools import accumulate
from pathlib import Path
from typing import Any, BinaryIO

from sparkwatch.common.durable import StateFileError, open_regular, read_regular
from sparkwatch.core.bounded import shown
from sparkwatch.core.engines.enginecli import TOKENS_MAX
from sparkwatch.core.launch.plan import ModelFacts

CONFIG_MAX_BYTES = 4 << 20
INDEX_MAX_BYTES = 32 << 20  # a 1,000-shard index is a few MiB
GGUF_HEADER_MAX_BYTES = 1 << 20
# Real configs nest 3-5 levels (text_config.rope_scaling.…), an index 2: 32 is far past either and far short of the
# json module's recursion (about 1,000 levels, then RecursionError).
JSON_DEPTH_MAX = 32
REF_MAX_BYTES = 256  # refs/main holds a 40-character sha
# The largest value each shape field may take: far past any model (DeepSeek-V3: 61 layers, 7168 hidden, 18432
# intermediate, 129,280 vocab), short of any product that overflows a float in format_size.
_SHAPE_MAX = 1 << 20
SHAPE_RANGES: Mapping[str, int] = {
    "layers": _SHAPE_MAX, "kv_heads": _SHAPE_MAX, "heads": _SHAPE_MAX, "head_dim": _SHAPE_MAX,
    "hidden_size": _SHAPE_MAX, "intermediate_size": _SHAPE_MAX, "mla_lora": _SHAPE_MAX, "mla_rope": _SHAPE_MAX,
    "vocab_size": 1 << 24, "max_len": TOKENS_MAX,
}  # fmt: skip
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


class CheckpointError(ValueError):
    """A checkpoint file that is there but is not what it must be; one line naming the file (and the key)."""


def _regular(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of `path`, following symlinks (the HF cache's snapshots are symlinks to blobs), never
    blocking. FileNotFoundError when absent; CheckpointError for a FIFO, a device, a directory."""
    try:
        return read_regular(path, limit, follow_symlinks=True)
    except StateFileError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}") from None


def snapshot_dir(cache: Path, repo_id: str, revision: str | None = None) -> Path | None:
    """models--ORG--NAME/snapshots/<sha>/ for `revision` (default main: refs/main holds the sha), else the newest."""
    folder = cache / ("models--" + "--".join(repo_id.split("/")))
    snapshots = folder / "snapshots"
    rev = revision or "main"
    try:
        sha = _regular(folder / "refs" / rev, REF_MAX_BYTES).decode("ascii", "replace").strip()
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
    st = os.stat(path)  # follows the snapshot's symlink to the blob
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: is not a regular file (a FIFO or device?)")
    return st.st_size


# A JSON string, escapes included: what the depth count skips (a bracket inside a string is no nesting).
_JSON_STRING_RE = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(data: bytes, limit: int = JSON_DEPTH_MAX) -> int:
    """How deep `data`'s arrays and objects nest, counted without parsing (the json module recurses: 100,000 levels
    raised RecursionError). Counting stops past `limit`; a file with no more brackets than that is never scanned."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return min(data.count(b"[") + data.count(b"{"), limit)
    brackets = _JSON_STRING_RE.sub(b"", data).translate(None, _NOT_BRACKETS)
    deepest = 0
    for depth in accumulate(1 if c in b"[{" else -1 for c in brackets):
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def _read_json(path: Path, limit: int) -> Any:
    """The JSON in `path`. FileNotFoundError when absent; CheckpointError when it is not a regular file, larger than
    `limit`, nested past JSON_DEPTH_MAX or not JSON."""
    data = _regular(path, limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: is larger than {limit >> 20} MiB")
    if json_depth(data) > JSON_DEPTH_MAX:
        raise CheckpointError(f"{path}: nests deeper than {JSON_DEPTH_MAX} levels")
    try:
        return json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError too
        raise CheckpointError(f"{path}: is not JSON ({exc})") from None


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
        if fmt == "safetensors":
            index_path = directory / "model.safetensors.index.json"
            try:
                index = _read_json(index_path, INDEX_MAX_BYTES)
            except FileNotFoundError:
                index = {}
            weight_map = index.get("weight_map", {}) if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index_path}: weight_map: expected an object of tensor names to files")
            wanted = {v for v in weight_map.values() if isinstance(v, str)}
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


def _int(config: Mapping[str, Any], field: str, *keys: str) -> int | None:
    """The first of `keys` holding a positive whole number, at most SHAPE_RANGES[field]. Raises ValueError naming the
    key for a larger one. 0, negatives and non-numbers count as absent (vLLM: head_dim is used "if > 0")."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            high = SHAPE_RANGES[field]
            if value > high:
                raise ValueError(f"{key}: {shown(value)} is out of range: expected 1 to {high}")
            return value
    return None


def facts_from_config(config: Mapping[str, Any]) -> dict[str, int | None]:
    """The KV-cache fields of a config.json, read as vLLM reads them."""
    if not isinstance(config, Mapping):
        raise ValueError("expected a JSON object")
    cfg = text_config(config)
    heads = _int(cfg, "heads", "num_attention_heads", "n_head")
    hidden = _int(cfg, "hidden_size", "hidden_size", "n_embd", "d_model")
    head_dim = _int(cfg, "head_dim", "head_dim", "hidden_size_per_head")
    if head_dim is None and hidden and heads:
        head_dim = hidden // heads
    kv_heads = _int(cfg, "kv_heads", *KV_HEAD_KEYS) or heads
    if cfg.get("multi_query") is True:  # falcon
        kv_heads = 1
    mla = None
    lora, rope = _int(cfg, "mla_lora", "kv_lora_rank"), _int(cfg, "mla_rope", "qk_rope_head_dim")
    if lora is not None and rope is not None:
        mla = lora + rope
    dtype = cfg.get("dtype") or cfg.get("torch_dtype")
    lens = [v for k in MAX_LEN_KEYS if (v := _int(cfg, "max_len", k)) is not None]
    return {
        "layers": _int(cfg, "layers", "num_hidden_layers", "n_layer", "num_layers"),
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "mla_dim": mla,
        "dtype_bytes": _DTYPE_BYTES.get(dtype) if isinstance(dtype, str) else None,
        "hidden_size": hidden,
        "intermediate_size": _int(cfg, "intermediate_size", "intermediate_size", "ffn_hidden_size", "n_inner"),
        "vocab_size": _int(cfg, "vocab_size", "vocab_size"),
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

    def skip(self, n: int) -> None:
        """Past `n` bytes, read in pieces: refused at once when `n` is past the bound, so a length never allocates."""
        if n > self.left:
            raise EOFError("GGUF header larger than the bound")
        while n > 0:
            step = min(n, 1 << 16)
            self.read(step)
            n -= step

    def skip_array(self) -> None:
        """Past one array value (element type, count, elements), by its lengths; an array of arrays is not skipped."""
        etype, count = self.unpack("I"), self.unpack("Q")
        if etype in _GGUF_FIXED:
            self.skip(count * struct.calcsize("<" + _GGUF_FIXED[etype]))
        elif etype == 8:
            if count * 8 > self.left:  # each string has at least its length
                raise EOFError("GGUF header larger than the bound")
            for _ in range(count):
                self.skip(self.unpack("Q"))
        else:
            raise ValueError(f"GGUF array of type {etype} is not read")


def gguf_metadata(path: Path, limit: int = GGUF_HEADER_MAX_BYTES) -> dict[str, int]:
    """The model-shape keys at the head of a GGUF file, reading at most `limit` bytes and no tensor data.

    Arrays before the architecture's keys (SmolLM2's `general.languages arr[str,1]` is key 8, before
    `llama.block_count`) are skipped by their lengths. Stops at the tokenizer's keys (they come after the
    architecture's, as llama.cpp's converters write them), once every wanted key was seen, or at the bound: what was
    read by then is the answer."""
    out: dict[str, int] = {}
    try:
        fd = open_regular(path, follow_symlinks=True)  # a FIFO named model.gguf: refused at once, never read
    except StateFileError as exc:
        raise CheckpointError(f"{path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
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
            try:
                key = r.string()
                if arch and key.startswith("tokenizer."):
                    break
                vtype = r.unpack("I")
                if vtype == 9:
                    r.skip_array()
                    continue
                if vtype == 8:
                    value: Any = r.string()
                elif vtype in _GGUF_FIXED:
                    value = r.unpack(_GGUF_FIXED[vtype])
                else:
                    break
            except EOFError:
                if not out:
                    raise
                break  # the bound, past some keys: those are the answer
            if key == "general.architecture" and isinstance(value, str):
                arch = value
            elif arch and key.startswith(arch + "."):
                name = _GGUF_KEYS.get(key[len(arch) + 1 :])
                if name is not None and isinstance(value, int) and not isinstance(value, bool):
                    if value > SHAPE_RANGES[name]:
                        raise CheckpointError(
                            f"{path}: {key}: {shown(value)} is out of range: expected at most {SHAPE_RANGES[name]}"
                        )
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
    """Sizes and shape of the checkpoint `model` names. A missing checkpoint is no error: the facts then carry `error`
    and the plan says the weights are unknown. Raises CheckpointError for one that is there but unreadable as it
    must be (a FIFO, JSON nested past JSON_DEPTH_MAX, a number out of range), naming the file and key."""
    if not model:
        return ModelFacts(source="", error="no model named")
    path = resolve(model, env, download_dir, revision)
    if path is None:
        return ModelFacts(source=model, error=f"{model}: not a local path and not in the Hugging Face cache")
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError(f"{path}: is neither a file nor a directory (a FIFO or device?)")
        if stat.S_ISREG(mode):
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
        try:
            data = _read_json(config, CONFIG_MAX_BYTES)
        except FileNotFoundError:
            data = None
        if data is not None:
            try:
                shape = facts_from_config(data)
            except ValueError as exc:
                raise CheckpointError(f"{config}: {exc}") from None
        elif fmt == "gguf" and files:
            shape = {**gguf_metadata(files[0])}
            shape.setdefault("dtype_bytes", 2)
    except CheckpointError:
        raise
    except (OSError, ValueError, EOFError, struct.error) as exc:  # not GGUF, or its header past the bound: unknown
        error = f"model shape unknown: {exc}"
    if not files:
        error = f"{path}: no weight files (.safetensors, .gguf, .bin)"
    return ModelFacts(source=str(path), weights_bytes=weights, files=len(files), format=fmt, error=error, **shape)
