"""Settings: defaults < TOML file < SPARKWATCH_* environment < command-line flags.

Every mistake becomes a `ConfigError` whose one-line message names the key and what was expected; the CLI prints it
and exits 2. Defaults are safe with no file at all.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AnyHttpUrl,
    BeforeValidator,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from sparkwatch.core.engines import compile_engine_patterns, compile_protect_patterns
from sparkwatch.core.policy import DEFAULT_KILL_ORDER, compile_never_kill, parse_kill_order, parse_kill_priority
from sparkwatch.core.redact import redact_url
from sparkwatch.units import GiB, format_size, parse_size

ENV_PREFIX = "SPARKWATCH_"
DEFAULT_PORT = 9847  # sparkwatch's metrics port; free in the Prometheus default-port allocation list.


def _size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError("expected a size such as 8GiB or 512MiB")
    return parse_size(value)


# A byte count written like "8GiB"; serialized back the same way so check-config prints what people write.
ByteSize = Annotated[int, BeforeValidator(_size), PlainSerializer(format_size, return_type=str), Field(ge=0)]


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "sparkwatch"


def default_config_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "sparkwatch" / "config.toml"


def default_jit_cache_dirs() -> list[Path]:
    # flashinfer puts its JIT cache under ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/<version>/<arch>/.
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or str(Path.home())
    return [Path(base) / ".cache" / "flashinfer"]


def default_vllm_cache_dirs() -> list[Path]:
    # vLLM keeps torch.compile artifacts under ${VLLM_CACHE_ROOT:-$HOME/.cache/vllm}/torch_compile_cache/.
    base = os.environ.get("VLLM_CACHE_ROOT") or str(Path.home() / ".cache" / "vllm")
    return [Path(base) / "torch_compile_cache"]


class ConfigError(Exception):
    """A configuration mistake, already phrased for a human in one line."""


class Settings(BaseSettings):
    """Every key is documented in README.md; the names are a contract (DESIGN.md)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True)

    # --- the guard
    floor: ByteSize = Field(8 * GiB, description="kill engine trees when MemAvailable is at or under this")
    warn_headroom: ByteSize = Field(4 * GiB, description="alert when MemAvailable is within this of the floor")
    kill_budget_s: float = Field(
        0.25, gt=0, le=10, description="fire early when the smoothed fill rate would reach the floor within this"
    )
    debounce_samples: int = Field(2, ge=1, le=20, description="consecutive samples a trigger must hold")
    poll_min_s: float = Field(0.05, gt=0, le=1)
    poll_max_s: float = Field(1.0, gt=0, le=5)
    rearm_headroom: ByteSize = Field(1 * GiB, description="memory must come back this far above the floor to re-arm")
    dry_run: bool = False
    mlock: bool = True
    ancestor_pid: int = Field(
        0, ge=0, description="only engines descending from this PID are candidates (0: all); confines the guard"
    )
    engine_patterns: list[str] = Field(default_factory=list, description="extra engines, as 'kind=regex'")
    protect_patterns: list[str] = Field(default_factory=list, description="extra protected names, as regexes")
    kill_order: list[str] = Field(
        default_factory=lambda: list(DEFAULT_KILL_ORDER),
        description="criteria ranking the engine trees, first decides: priority, growth, youngest, largest",
    )
    kill_priority: list[str] = Field(
        default_factory=list, description="'priority=regex': trees matching die earlier (higher) or later (negative)"
    )
    never_kill: list[str] = Field(default_factory=list, description="regexes: matching engine trees are never killed")
    kill_settle_s: float = Field(
        1.0, gt=0, le=10, description="after a victim is reaped, wait this long for memory before the next tree"
    )

    # --- telemetry and its outputs
    telemetry_interval_s: float = Field(1.0, gt=0, le=60)
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    jit_cache_dirs: list[Path] = Field(default_factory=default_jit_cache_dirs)
    vllm_cache_dirs: list[Path] = Field(
        default_factory=default_vllm_cache_dirs, description="vLLM torch.compile caches watched like jit_cache_dirs"
    )
    compile_jobs_alert: int = Field(8, ge=1, description="a compiler burst wider than this many nvcc/cicc jobs alerts")
    jit_stall_s: float = Field(300.0, gt=0, description="engine asleep, no compiler, no cache growth this long")

    # --- records and alerts
    state_dir: Path = Field(default_factory=default_state_dir)
    webhook_url: AnyHttpUrl | None = None
    webhook_secret: SecretStr | None = None
    webhook_timeout_s: float = Field(10.0, gt=0, le=120, description="one delivery attempt gives up after this")
    webhook_backoff_min_s: float = Field(1.0, gt=0, le=3600, description="first retry delay; doubles per failure")
    webhook_backoff_max_s: float = Field(
        300.0, gt=0, le=86400, description="retry delay cap: a receiver down for hours is retried every 5 min"
    )
    driver_check_interval_s: float = Field(
        60.0, gt=0, le=3600, description="driver drift check period (a udev event on nvidia runs it at once)"
    )

    # --- where the system is read from (tests point these at fixture trees)
    proc_root: Path = Path("/proc")
    root: Path = Path("/")

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        _host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected host:port, for example 127.0.0.1:9847")
        return value

    @field_validator("engine_patterns")
    @classmethod
    def _check_engine_patterns(cls, value: list[str]) -> list[str]:
        compile_engine_patterns(value)  # raises ValueError with the offending pattern
        return value

    @field_validator("protect_patterns")
    @classmethod
    def _check_protect_patterns(cls, value: list[str]) -> list[str]:
        compile_protect_patterns(value)
        return value

    @field_validator("kill_order")
    @classmethod
    def _check_kill_order(cls, value: list[str]) -> list[str]:
        parse_kill_order(value)
        return value

    @field_validator("kill_priority")
    @classmethod
    def _check_kill_priority(cls, value: list[str]) -> list[str]:
        parse_kill_priority(value)
        return value

    @field_validator("never_kill")
    @classmethod
    def _check_never_kill(cls, value: list[str]) -> list[str]:
        compile_never_kill(value)
        return value

    @model_validator(mode="after")
    def _check_consistency(self) -> Settings:
        if self.poll_min_s > self.poll_max_s:
            raise ValueError("poll_min_s must not exceed poll_max_s")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file needs tls_cert_file and tls_key_file")
        return self

    @property
    def listen_host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def events_path(self) -> Path:
        return self.state_dir / "events.jsonl"

    @property
    def outbox_dir(self) -> Path:
        return self.state_dir / "outbox"

    def public_dict(self) -> dict[str, Any]:
        """The effective settings, secrets masked, as check-config prints them."""
        data = self.model_dump(mode="json")
        if self.webhook_secret is not None:
            data["webhook_secret"] = "********"
        if self.webhook_url is not None:
            data["webhook_url"] = redact_url(str(self.webhook_url)) + "/…"
        return data


class _MappingSource(PydanticBaseSettingsSource):
    """The TOML file's table as a settings source (pydantic-settings' own TOML source takes a fixed path)."""

    def __init__(self, settings_cls: type[BaseSettings], data: Mapping[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = dict(data)

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except PermissionError as exc:
        raise ConfigError(f"config file {path} is not readable") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    # Allow an optional [sparkwatch] table so the file can live beside other tools' settings.
    if set(data) == {"sparkwatch"} and isinstance(data["sparkwatch"], dict):
        data = data["sparkwatch"]
    return data


# Names under this prefix belong to the test suite (SPARKWATCH_TEST_REQUIRE_TOOLS), not to the daemon.
TEST_ENV_PREFIX = ENV_PREFIX + "TEST_"


def _check_env_keys(env: Mapping[str, str]) -> None:
    known = set(Settings.model_fields)
    for name in env:
        if name.startswith(ENV_PREFIX) and not name.startswith(TEST_ENV_PREFIX):
            key = name[len(ENV_PREFIX) :].lower()
            if key not in known:
                raise ConfigError(f"{name}: unknown setting{_did_you_mean(key, known)}")


def _did_you_mean(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _describe(exc: ValidationError, toml_keys: set[str]) -> str:
    err = exc.errors()[0]
    key = ".".join(str(part) for part in err["loc"]) or "config"
    known = set(Settings.model_fields)
    if err["type"] == "extra_forbidden":
        return f"{key}: unknown setting{_did_you_mean(key, known)}"
    message = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if key.startswith("webhook") or isinstance(value, dict) else f" (got {value!r})"
    origin = ""
    if key in known:
        env_name = ENV_PREFIX + key.upper()
        if env_name in os.environ:
            origin = f" [from {env_name}]"
        elif key in toml_keys:
            origin = " [from config file]"
    more = f"; and {len(exc.errors()) - 1} more" if len(exc.errors()) > 1 else ""
    return f"{key}: {message}{shown}{origin}{more}"


def load_settings(config_file: Path | None = None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Load settings from every layer. `config_file=None` reads the default file only if it exists."""
    path = config_file
    if path is None:
        candidate = Path(os.environ.get(ENV_PREFIX + "CONFIG", "")) if os.environ.get(ENV_PREFIX + "CONFIG") else None
        path = candidate or (default_config_file() if default_config_file().is_file() else None)
    toml_data = _read_toml(path) if path is not None else {}
    env = {k: v for k, v in os.environ.items() if k != ENV_PREFIX + "CONFIG"}
    _check_env_keys(env)

    class _Layered(Settings):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return (init_settings, env_settings, _MappingSource(settings_cls, toml_data))

    try:
        loaded = _Layered(**{k: v for k, v in (overrides or {}).items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(_describe(exc, set(toml_data))) from None
    except ValueError as exc:  # env values that are not valid JSON for list fields, for example
        raise ConfigError(str(exc).splitlines()[0]) from None
    # Hand back a plain Settings so callers and reprs never see the layering class.
    return Settings.model_construct(**{name: getattr(loaded, name) for name in Settings.model_fields})
