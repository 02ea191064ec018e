"""Settings: defaults < TOML file < SPARKWATCH_* environment < command-line flags, loaded by `load_settings`, the one
loader; `schema.Settings` (pydantic) is the one schema and validation owner.

Every mistake becomes a `ConfigError` whose one-line message names the key and what was expected; the CLI prints it
and exits 2. Defaults are safe with no file at all. With no file, no SPARKWATCH_* variable and no flag there is
nothing to validate: the read-only commands then get the schema's defaults from its generated snapshot
(`standins.DefaultSettings`) and never import pydantic, which was 0.2 s of their 0.5 s start-up on a 2-core VM
(bench/RESULTS-startup.md). This module imports no pydantic; `Settings`, `settings_to_wire` and `settings_from_wire`
are the schema module's, imported from here on first use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sparkwatch.config.defaults import (
    default_config_file,
    default_jit_cache_dirs,
    default_state_dir,
    default_vllm_cache_dirs,
)
from sparkwatch.config.errors import ENV_PREFIX, TEST_ENV_PREFIX, ConfigError
from sparkwatch.config.standins import DefaultSettings
from sparkwatch.core.units import format_size

if TYPE_CHECKING:
    from sparkwatch.config.schema import Settings, settings_from_wire, settings_to_wire

__all__ = [
    "ConfigError",
    "Settings",
    "check_memory_bounds",
    "default_config_file",
    "default_jit_cache_dirs",
    "default_state_dir",
    "default_vllm_cache_dirs",
    "load_settings",
    "read_memtotal_bytes",
    "settings_from_wire",
    "settings_to_wire",
    "wire_settings",
]

CONFIG_FILE_MAX_BYTES = 1 << 20  # a config file is a few hundred bytes; a bigger one is not a config file

_SCHEMA_NAMES = frozenset({"Settings", "settings_to_wire", "settings_from_wire"})


def __getattr__(name: str) -> Any:
    """`from sparkwatch.config.settings import Settings` imports the schema (and pydantic) then, not before."""
    if name in _SCHEMA_NAMES:
        from sparkwatch.config import schema  # noqa: PLC0415 - on first use, on purpose

        return getattr(schema, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _read_toml(path: Path) -> dict[str, Any]:
    import tomllib  # noqa: PLC0415 - only with a file to read

    from sparkwatch.common.durable import StateFileError, read_regular  # noqa: PLC0415

    try:
        # Never blocks: a FIFO, a device or a directory given as the config is refused at once (durable's rule).
        raw = read_regular(path, CONFIG_FILE_MAX_BYTES + 1, follow_symlinks=True)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"config file {path} is not readable") from None
    except StateFileError as exc:
        raise ConfigError(f"config file {path} {exc.strerror}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    if len(raw) > CONFIG_FILE_MAX_BYTES:
        raise ConfigError(f"config file {path} is larger than {CONFIG_FILE_MAX_BYTES >> 20} MiB")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 (byte {exc.start}); TOML files must be") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is nested too deeply") from None
    # Allow an optional [sparkwatch] table so the file can live beside other tools' settings.
    if set(data) == {"sparkwatch"} and isinstance(data["sparkwatch"], dict):
        data = data["sparkwatch"]
    return data


def _sets_a_key(name: str) -> bool:
    """An environment variable the schema would read or refuse (pydantic-settings matches names case-insensitively)."""
    upper = name.upper()
    return upper.startswith(ENV_PREFIX) and not upper.startswith(TEST_ENV_PREFIX) and upper != ENV_PREFIX + "CONFIG"


def wire_settings(wire: Mapping[str, Any]) -> Settings:
    """The telemetry process's settings: the guard's validated values (`settings_to_wire`) as they are, without
    pydantic (config.standins.WireSettings). Raises ConfigError when the keys are not this schema's (a guard of
    another version)."""
    from sparkwatch.config.defaults import FACTORIES, STATIC  # noqa: PLC0415
    from sparkwatch.config.standins import WireSettings  # noqa: PLC0415
    from sparkwatch.core.redact import remember_secrets  # noqa: PLC0415

    known = set(STATIC) | set(FACTORIES)
    unknown, missing = sorted(set(wire) - known), sorted(known - set(wire))
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a key of this version's settings")
    if missing:
        raise ConfigError(f"{missing[0]}: missing from the guard's settings")
    settings = cast("Settings", WireSettings(wire))
    remember_secrets(settings.secrets())  # this process's redaction knows them before it logs a line
    return settings


def config_file_in_use(config_file: Path | None = None) -> Path | None:
    """The config file the settings are read from: --config, else $SPARKWATCH_CONFIG, else the default file if it
    exists (None: no file, the defaults only)."""
    if config_file is not None:
        return config_file
    candidate = Path(os.environ.get(ENV_PREFIX + "CONFIG", "")) if os.environ.get(ENV_PREFIX + "CONFIG") else None
    # lexists, not is_file: a FIFO or directory at the default path is refused, not silently skipped.
    return candidate or (default_config_file() if os.path.lexists(default_config_file()) else None)


def load_settings(
    config_file: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    check_memory: bool = False,
    require_meminfo: bool = False,
) -> Settings:
    """Load settings from every layer. `config_file=None` reads the default file only if it exists.

    With `check_memory` (check-config, run, reload) sizes are checked against MemTotal of <proc_root>/meminfo when it
    is readable, and with `require_meminfo` an unreadable meminfo is an error too. The read-only commands skip it:
    `doctor` must be able to report a floor above MemTotal rather than refuse to run.
    """
    path = config_file_in_use(config_file)
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    if (
        path is None
        and not flags
        and not check_memory
        and not require_meminfo
        and not any(map(_sets_a_key, os.environ))
    ):
        # Nothing to validate: the schema's own defaults (its generated snapshot; no secrets among them). The daemon
        # and check-config (check_memory) always go through the schema.
        return cast("Settings", DefaultSettings())
    digest = None
    if not check_memory and not require_meminfo:  # a read-only command: the last validation may stand (validated)
        from sparkwatch.config import validated  # noqa: PLC0415

        digest = validated.key(path, os.environ, flags)
        wire = validated.load(os.environ, digest) if digest is not None else None
        if wire is not None:
            try:
                return wire_settings(wire)
            except ConfigError:
                pass  # another version's keys: validate again
    toml_data = _read_toml(path) if path is not None else {}
    from sparkwatch.config.schema import settings_to_wire, validate  # noqa: PLC0415 - pydantic, only to check
    from sparkwatch.core.redact import remember_secrets  # noqa: PLC0415

    settings = validate(toml_data, flags)
    if check_memory or require_meminfo:
        check_memory_bounds(settings, require_meminfo=require_meminfo)
    remember_secrets(settings.secrets())
    if digest is not None and not settings.secrets():  # a secret is never written down here
        validated.store(os.environ, digest, settings_to_wire(settings))
    return settings


def read_memtotal_bytes(proc_root: Path) -> int:
    """MemTotal from <proc_root>/meminfo. Raises ConfigError (naming proc_root) when it cannot be read."""
    from sparkwatch.common.sources.meminfo import MeminfoError, parse_meminfo  # noqa: PLC0415 - config imports no sources

    path = proc_root / "meminfo"
    try:
        with open(path, "rb") as fh:
            data = fh.read(65536)
        return parse_meminfo(data).total_bytes
    except OSError as exc:
        raise ConfigError(f"proc_root: cannot read {path}: {exc.strerror or exc}") from None
    except MeminfoError as exc:
        raise ConfigError(f"proc_root: {path}: {exc}") from None


def check_memory_bounds(settings: Settings, *, require_meminfo: bool = False) -> None:
    """The sizes against this machine's MemTotal: a floor at or above it would kill every engine at start.

    Without a readable meminfo the check is skipped unless `require_meminfo` (the daemon cannot run without one).
    """
    try:
        total = read_memtotal_bytes(settings.proc_root)
    except ConfigError:
        if require_meminfo:
            raise
        return
    shown = format_size(total)
    if settings.floor >= total:
        raise ConfigError(
            f"floor: {format_size(settings.floor)} is at or above MemTotal ({shown}): every engine would be killed "
            "at start"
        )
    if settings.floor + settings.rearm_headroom >= total:
        raise ConfigError(
            f"rearm_headroom: floor + rearm_headroom ({format_size(settings.floor + settings.rearm_headroom)}) is at "
            f"or above MemTotal ({shown}): the guard would never re-arm after a kill"
        )
