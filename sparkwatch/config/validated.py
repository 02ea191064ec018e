"""The last settings the schema validated for a read-only command, kept so that the next command with the same inputs
needs no pydantic.

A config file (or a SPARKWATCH_* variable) makes every command validate it, and pydantic with the schema costs about
0.16 s of a command's start on a 2-core VM (`events --config FILE` 290 ms against `events` 130:
bench/RESULTS-startup.md); `launch --plan` for an engine across two nodes, which needs the `peers` key, missed its
500 ms for it (bench/RESULTS-launch-nodes.md). The validated values are kept as the wire carries them
(schema.settings_to_wire) in `$XDG_RUNTIME_DIR/sparkwatch/validated.json`, private to the user, under a key of
everything validation read: this sparkwatch's version and schema files, the config file's path and bytes, every
SPARKWATCH_* variable, the flags, the defaults that follow the environment (the state dir under XDG_STATE_HOME, the
cache dirs); and the files the settings name that validation opened (the TLS files) must be as they were. Any change
misses, and the schema validates again. A hit is rebuilt without pydantic (config.standins.WireSettings, as the
telemetry process runs).

Never kept: settings holding a secret (a webhook's secret, a token in a URL), and what the daemon and check-config
load (they always validate, the checks against this machine included: MemTotal, readable TLS files, a listen host
that resolves). A missing runtime dir, or a file that is not ours or not this shape, is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

FILE_NAME = "validated.json"
MAX_BYTES = 1 << 20
_SCHEMA_FILES = ("schema.py", "defaults.py")


def cache_path(env: Mapping[str, str]) -> Path | None:
    base = env.get("XDG_RUNTIME_DIR")
    return Path(base) / "sparkwatch" / FILE_NAME if base else None


def key(config: Path | None, env: Mapping[str, str], flags: Mapping[str, Any]) -> str | None:
    """The digest of everything validation reads; None when the config file cannot be read (validation says why)."""
    from sparkwatch import __version__  # noqa: PLC0415

    here = Path(__file__).parent
    parts: list[object] = [__version__]
    try:
        for name in _SCHEMA_FILES:
            st = os.stat(here / name)
            parts.append([name, st.st_mtime_ns, st.st_size])
        if config is not None:
            from sparkwatch.common.durable import read_regular  # noqa: PLC0415

            parts += [str(config), hashlib.sha256(read_regular(config, MAX_BYTES, follow_symlinks=True)).hexdigest()]
    except OSError:
        return None
    parts.append(sorted((k, v) for k, v in env.items() if k.upper().startswith("SPARKWATCH_")))
    parts.append(sorted((k, str(v)) for k, v in flags.items()))
    # the defaults that follow the environment (XDG_STATE_HOME, HOME, FLASHINFER_WORKSPACE_BASE, VLLM_CACHE_ROOT)
    from sparkwatch.config.defaults import FACTORIES  # noqa: PLC0415

    parts.append(sorted((name, str(factory())) for name, factory in FACTORIES.items()))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def load(env: Mapping[str, str], digest: str) -> dict[str, Any] | None:
    """The wire values kept under `digest`, or None."""
    path = cache_path(env)
    if path is None:
        return None
    from sparkwatch.common.durable import read_regular  # noqa: PLC0415

    try:
        doc = json.loads(read_regular(path, MAX_BYTES, owned=True))
    except (OSError, ValueError):
        return None
    wire = doc.get("wire") if isinstance(doc, dict) and doc.get("key") == digest else None
    if not isinstance(wire, dict) or doc.get("files") != _files(wire):
        return None
    return wire


def _files(wire: Mapping[str, Any]) -> dict[str, list[int] | None]:
    """The files the settings name (`*_file` keys: validation opened them), each as stat shows it now."""
    out: dict[str, list[int] | None] = {}
    for name, value in sorted(wire.items()):
        if name.endswith("_file") and isinstance(value, str):
            try:
                st = os.stat(value)
            except OSError:
                out[value] = None
                continue
            out[value] = [st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns]
    return out


def store(env: Mapping[str, str], digest: str, wire: Mapping[str, Any]) -> None:
    """Keep `wire` under `digest`; a runtime dir that cannot take it is left as it is."""
    path = cache_path(env)
    if path is None:
        return
    from sparkwatch.common.durable import private_dir, write_atomic  # noqa: PLC0415

    try:
        private_dir(path.parent)
        doc = {"key": digest, "wire": wire, "files": _files(wire)}
        write_atomic(path, json.dumps(doc, separators=(",", ":")).encode())
    except OSError:
        return
