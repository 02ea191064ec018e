"""The one settings schema (pydantic): every key, its type, default, range and validator, and the wire form between
sparkwatch's own processes. Read through `sparkwatch.config.settings` (`load_settings`, the one loader), which imports
this module only when there is something to validate: pydantic's import is most of a command's start-up
(bench/RESULTS-startup.md). `python -m sparkwatch.config.schema` writes the defaults snapshot in config/defaults.py.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import os
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sparkwatch.common.durable import read_regular
from sparkwatch.common.guardconfig import GuardConfig
from sparkwatch.common.peeraddr import parse_peer
from sparkwatch.common.peerproof import check_key_file
from sparkwatch.common.sharing import group_id
from sparkwatch.config.defaults import (
    FACTORIES,
    SNAPSHOT_BEGIN,
    SNAPSHOT_END,
    Derived,
    default_jit_cache_dirs,
    default_state_dir,
    default_vllm_cache_dirs,
)
from sparkwatch.config.errors import ENV_PREFIX, TEST_ENV_PREFIX, ConfigError
from sparkwatch.core import bounded
from sparkwatch.core.engines.identity import compile_engine_patterns, compile_protect_patterns
from sparkwatch.core.kill.policy import (
    DEFAULT_KILL_ORDER,
    compile_never_kill,
    parse_engine_budgets,
    parse_kill_order,
    parse_kill_priority,
)
from sparkwatch.core.redact import remember_secrets
from sparkwatch.core.units import SIZE_MAX_BYTES, GiB, format_size, parse_size
from sparkwatch.core.urls import redact_url

DEFAULT_PORT = 9847  # sparkwatch's metrics port; free in the Prometheus default-port allocation list.


def _size(value: object) -> int:
    """A size a person wrote (TOML, env, flag) needs a unit: `floor = 8` would be an 8-byte floor that never fires.
    The wire form between sparkwatch's own processes carries byte counts; settings_from_wire writes them "<n>B"."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError("expected a size such as 8GiB or 512MiB")
    if isinstance(value, int):
        raise ValueError(f"{value} has no unit; write {value}GiB or {value}MiB (or {value}B for bytes)")
    return parse_size(value)  # a 400-digit number is a ValueError there, never an OverflowError


# A floor under this cannot protect anything: an engine's start-up spike drains gigabytes a second (29 -> 2.5 GiB in
# 9 s on a Spark), and doctor already warns under 2 GiB; "1MiB" or "8" (bytes) is a guard switched off by mistake.
FLOOR_MIN_BYTES = 1 * GiB
# Every number has a range (core.bounded says why): a pid is at most the kernel's PID_MAX_LIMIT (4,194,304 on 64-bit,
# include/linux/threads.h); a burst of 4096 compilers or a JIT silent for more than a day is a typo, and `jit_stall_s =
# 1e400` was inf, taken: the stall alert never fired.
PID_MAX_LIMIT = 1 << 22
COMPILE_JOBS_MAX = 4096
JIT_STALL_MAX_S = 86400.0  # a config file is a few hundred bytes; a bigger one is not a config file

# A byte count written like "8GiB"; serialized back the same way so check-config prints what people write. The
# defaults are byte counts of our own and are not run through _size (validate_default=False on each size field).
ByteSize = Annotated[
    int,
    BeforeValidator(_size),
    PlainSerializer(format_size, return_type=str),
    Field(ge=0, le=SIZE_MAX_BYTES),
]


# The list keys and the core function that parses each: it raises ValueError naming the bad entry.
_LIST_CHECKS: dict[str, Callable[[list[str]], object]] = {
    "engine_patterns": compile_engine_patterns,
    "protect_patterns": compile_protect_patterns,
    "kill_order": parse_kill_order,
    "kill_priority": parse_kill_priority,
    "never_kill": compile_never_kill,
    "engine_budgets": parse_engine_budgets,
}


class Settings(BaseModel, Derived):
    """Every key is documented in README.md and docs/contract.md; the names are a contract.

    A plain pydantic model: the layering of file, environment and flags (pydantic-settings, 188 modules) is
    `validate`'s alone, in the one process that loads a config; a Settings validated from wire values does without it.
    The telemetry process takes the guard's wire values without pydantic at all (config.standins.WireSettings,
    bench/RESULTS-rss-gpu.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # --- the guard
    floor: ByteSize = Field(
        8 * GiB, validate_default=False, description="kill engine trees when MemAvailable is at or under this"
    )
    warn_headroom: ByteSize = Field(
        4 * GiB, validate_default=False, description="alert when MemAvailable is within this of the floor"
    )
    kill_budget_s: float = Field(
        0.25, gt=0, le=10, description="fire early when the smoothed fill rate would reach the floor within this"
    )
    debounce_samples: int = Field(2, ge=1, le=20, description="consecutive samples a trigger must hold")
    poll_min_s: float = Field(0.05, gt=0, le=1)
    poll_max_s: float = Field(1.0, gt=0, le=5)
    rearm_headroom: ByteSize = Field(
        1 * GiB, validate_default=False, description="memory must come back this far above the floor to re-arm"
    )
    dry_run: bool = False
    mlock: bool = True
    ancestor_pid: int = Field(
        0,
        ge=0,
        le=PID_MAX_LIMIT,
        description="only engines descending from this PID are candidates (0: all); confines the guard",
    )
    engine_patterns: list[str] = Field(default_factory=list, description="extra engines, as 'kind=regex'")
    kernel_log_corroboration: bool = Field(
        True,
        description="a driver allocation failure (NVRM NV_ERR_NO_MEMORY) while MemAvailable is within warn_headroom "
        "of the floor counts as a floor crossing; needs a readable kernel log (system unit or dmesg_restrict=0)",
    )
    kernel_log_path: Path = Field(Path("/dev/kmsg"), description="the kernel log device read for NVRM and Xid lines")
    kernel_log_accept_injected: bool = Field(
        False,
        description="also act on NVRM and Xid lines a root process wrote into the kernel log (the kernel marks them "
        "facility user; the driver's own are facility kernel): only to try an alert route end to end",
    )
    protect_patterns: list[str] = Field(
        default_factory=list, description="extra protected processes, regexes on comm, entry point or executable path"
    )
    guard_gpu_holders: bool = Field(
        False, description="treat a process NVML lists as holding GPU memory, that no rule names, as an engine"
    )
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
    engine_budgets: list[str] = Field(
        default_factory=list,
        description="'SIZE=regex': a memory budget for engine trees whose kind, title or command line match (as "
        "kill_priority); the guard kills a tree over its budget alone",
    )

    # --- telemetry and its outputs
    telemetry_interval_s: float = Field(1.0, gt=0, le=60)
    # --- groups spanning nodes (issue 29; docs/multinode.md)
    group_teardown: bool = Field(
        True, description="when a member of an engine group spanning nodes dies, stop this node's members of it"
    )
    ray_dashboard_url: str = Field(
        "http://127.0.0.1:8265",
        pattern=r"^(https?://\S+)?$",
        description="Ray's dashboard: its state API names the groups (empty: never asked)",
    )
    ray_poll_s: float = Field(2.0, ge=0.2, le=60, description="how often Ray's state API is read while a raylet runs")
    peers: list[str] = Field(
        default_factory=list,
        description="the other nodes' sparkwatch endpoints (host:port, or https://host:port under the TLS settings): "
        "their guard's word on a group member it killed, and peer_lost",
    )
    peer_poll_s: float = Field(2.0, ge=0.5, le=60, description="how often each peer's state is read")
    peer_key_file: Path | None = Field(
        None,
        description="the pair's shared key (`sparkwatch peer-key write PATH`, the same file on each node): a peer's "
        "document moves the guard only when proven by it (or by mTLS); unset: peers are display-only",
    )
    peer_lost_after_s: float = Field(
        30.0,
        ge=1,
        le=3600,
        description="a peer that gives no proven document this long (refused, an HTTP error, a bad proof or silence) "
        "is lost for the groups without Ray it held members in; longer than an agent's restart (docs/multinode.md)",
    )
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None
    jit_cache_dirs: list[Path] = Field(default_factory=default_jit_cache_dirs)
    vllm_cache_dirs: list[Path] = Field(
        default_factory=default_vllm_cache_dirs, description="vLLM torch.compile caches watched like jit_cache_dirs"
    )
    compile_jobs_alert: int = Field(
        8, ge=1, le=COMPILE_JOBS_MAX, description="a compiler burst wider than this many nvcc/cicc jobs alerts"
    )
    jit_stall_s: float = Field(
        300.0, gt=0, le=JIT_STALL_MAX_S, description="engine asleep, no compiler, no cache growth this long"
    )
    # --- the serving probe (telemetry/probewatch.py, core/engines/serving.py; docs/engines.md#the-serving-probe)
    probe_interval_s: float = Field(
        30.0, ge=0, le=3600, description="a one-token completion to each engine's endpoint this often (0: never)"
    )
    probe_retry_s: float = Field(5.0, gt=0, le=3600, description="after a failed probe, the next one comes this soon")
    probe_timeout_s: float = Field(
        10.0, gt=0, le=300, description="one probe (connect, send, answer) gives up after this"
    )
    probe_failures_wedged: int = Field(
        3, ge=1, le=100, description="failed probes in a row, the process alive, that make an engine wedged"
    )
    kill_wedged_after_s: float = Field(
        0.0,
        ge=0,
        le=86400,
        description="the guard kills an engine wedged this long, trigger wedged, once its own progress counters prove "
        "the stall (0: never)",
    )
    # --- engines in containers (docs/containers.md)
    docker_host: str = Field(
        "",
        description="the Docker Engine API's unix socket telemetry reads container names and io.sparkwatch.* labels "
        "from (unix:///path or /path; podman's compatible socket too); empty: DOCKER_HOST when it names a unix socket, "
        "else /var/run/docker.sock",
    )
    container_after_kill: Literal["gate", "stop", "allow"] = Field(
        "gate",
        description="when a restart policy starts a container whose engine the guard killed: gate (pause it until "
        "the pool settled and its peak fits), stop (cancel the restart through the API), allow (let it restart); "
        "a container's io.sparkwatch.after-kill label overrides it",
    )

    # --- records and alerts
    state_dir: Path = Field(default_factory=default_state_dir)
    webhook_url: AnyHttpUrl | None = None
    webhook_secret: SecretStr | None = None
    webhook_timeout_s: float = Field(10.0, gt=0, le=120, description="one delivery attempt gives up after this")
    webhook_backoff_min_s: float = Field(1.0, gt=0, le=3600, description="first retry delay; doubles per failure")
    webhook_backoff_max_s: float = Field(
        300.0, gt=0, le=86400, description="retry delay cap: a receiver down for hours is retried every 5 min"
    )
    events_max_bytes: ByteSize = Field(
        16 << 20,
        validate_default=False,
        description="events.jsonl rotates to events.jsonl.1 past this (one old generation kept)",
    )
    events_group: str | None = Field(
        None, description="a group whose members may read events.jsonl (0640, the state dir 0750); unset: owner only"
    )
    outbox_max_alerts: int = Field(
        1000, ge=1, le=1_000_000, description="undelivered alerts kept; past this the oldest are dropped and counted"
    )
    driver_check_interval_s: float = Field(
        60.0, gt=0, le=3600, description="driver drift check period (a udev event on nvidia runs it at once)"
    )
    recorder_window_s: float = Field(
        600.0,
        ge=0,
        le=3600,
        description="seconds of pool samples (one a second, every guard tick near the floor) the flight recorder keeps "
        "in <state_dir>/recorder.ring for the next boot's postmortem; 0: off",
    )
    postmortem: bool = Field(
        True, description="judge how the previous boot ended once per boot, at start (a previous_boot event)"
    )
    postmortem_journal_dir: Path | None = Field(
        None,
        description="read the previous boot from this journal directory (journalctl --directory) instead of the "
        "system journal: a journal copied from another box, or a test's",
    )

    # --- where the system is read from (tests point these at fixture trees)
    proc_root: Path = Path("/proc")
    root: Path = Path("/")

    @field_validator("floor")
    @classmethod
    def _check_floor(cls, value: int) -> int:
        if value < FLOOR_MIN_BYTES:
            raise ValueError(
                f"{format_size(value)} is under {format_size(FLOOR_MIN_BYTES)}: no kill could beat a start-up spike "
                "from there (doctor warns under 2 GiB); the default is 8GiB"
            )
        return value

    @field_validator("peers")
    @classmethod
    def _check_peers(cls, value: list[str]) -> list[str]:
        for peer in value:
            parse_peer(peer)  # a ValueError names the entry; pydantic names the key
        return value

    @field_validator("peer_key_file")
    @classmethod
    def _check_peer_key(cls, value: Path | None) -> Path | None:
        if value is not None:
            check_key_file(value)  # a PeerKeyError (a ValueError) says why; pydantic names the key
        return value

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected host:port, for example 127.0.0.1:9847")
        host = host.strip("[]")
        if not host:
            raise ValueError("the host is missing: write 127.0.0.1:PORT (this machine) or 0.0.0.0:PORT (every address)")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            try:
                socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as exc:
                raise ValueError(f"host {host!r} does not resolve ({exc})") from None
        return value

    @field_validator("tls_cert_file", "tls_key_file", "tls_client_ca_file")
    @classmethod
    def _check_readable(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        try:
            read_regular(value, 1, follow_symlinks=True)  # a FIFO here would hang the validator, then the exporter
        except OSError as exc:
            raise ValueError(f"{value}: {exc.strerror or exc}") from None
        return value

    @field_validator("docker_host")
    @classmethod
    def _check_docker_host(cls, value: str) -> str:
        path = value.removeprefix("unix://")
        if value and not path.startswith("/"):
            raise ValueError(
                "expected this node's Docker socket, unix:///var/run/docker.sock or a path (a tcp:// host is another "
                "machine's API, or this one's without the socket's permissions: sparkwatch reads only its own node's)"
            )
        return value

    @field_validator("events_group")
    @classmethod
    def _check_group(cls, value: str | None) -> str | None:
        if value is not None:
            group_id(value)  # ValueError names the group
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _check_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("is empty, so alerts would go out unsigned; set a secret or remove the key")
        return value

    @field_validator(*_LIST_CHECKS)
    @classmethod
    def _check_lists(cls, value: list[str], info: ValidationInfo) -> list[str]:
        """Each pattern list parsed by its owner (core.engines.identity, core.kill.policy): a bad entry is named in the
        error."""
        _LIST_CHECKS[str(info.field_name)](value)
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

    def public_dict(self) -> dict[str, Any]:
        """The effective settings, secrets masked, as check-config prints them."""
        data = self.model_dump(mode="json")
        if self.webhook_secret is not None:
            data["webhook_secret"] = "********"
        if self.webhook_url is not None:
            data["webhook_url"] = redact_url(str(self.webhook_url)) + "/…"
        return data


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
    shown = "" if key.startswith("webhook") or isinstance(value, dict) else f" (got {bounded.shown(value)})"
    if isinstance(value, (int, str)) and str(value) and message.startswith((repr(value), str(value))):
        shown = ""  # the message already shows the value ("floor: 8 has no unit; …")
    origin = ""
    if key in known:
        env_name = ENV_PREFIX + key.upper()
        if env_name in os.environ:
            origin = f" [from {env_name}]"
        elif key in toml_keys:
            origin = " [from config file]"
    more = f"; and {len(exc.errors()) - 1} more" if len(exc.errors()) > 1 else ""
    return f"{key}: {message}{shown}{origin}{more}"


def validate(toml_data: Mapping[str, Any], overrides: Mapping[str, Any]) -> Settings:
    """Defaults < the TOML file's table < SPARKWATCH_* environment < `overrides` (the flags), validated as a whole.
    Raises ConfigError naming the key. `settings.load_settings` is the one caller."""
    from pydantic_settings import (  # noqa: PLC0415 - only the process that loads a config pays for it
        BaseSettings,
        PydanticBaseSettingsSource,
        SettingsConfigDict,
    )

    env = {k: v for k, v in os.environ.items() if k != ENV_PREFIX + "CONFIG"}
    _check_env_keys(env)

    class _MappingSource(PydanticBaseSettingsSource):
        """The TOML file's table as a settings source (pydantic-settings' own TOML source takes a fixed path)."""

        def __init__(self, settings_cls: type[BaseSettings], data: Mapping[str, Any]) -> None:
            super().__init__(settings_cls)
            self._data = dict(data)

        def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
            return self._data.get(field_name), field_name, False

        def __call__(self) -> dict[str, Any]:
            return dict(self._data)

    class _Layered(BaseSettings, Settings):
        model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True)

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
        loaded = _Layered(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigError(_describe(exc, set(toml_data))) from None
    except ValueError as exc:  # env values that are not valid JSON for list fields, for example
        raise ConfigError(str(exc).splitlines()[0]) from None
    # Hand back a plain Settings so callers and reprs never see the layering class.
    return Settings.model_construct(**{name: getattr(loaded, name) for name in Settings.model_fields})


def settings_to_wire(settings: Settings) -> dict[str, Any]:
    """The validated values in plain JSON types (sizes in bytes, paths and URLs as strings, the secret revealed) for
    the guard process (`guardconfig.GuardConfig.from_wire`) and the telemetry process (`settings.wire_settings`). Only
    ever sent over a pipe or socketpair between sparkwatch's own processes; never logged."""
    out: dict[str, Any] = {}
    for name in Settings.model_fields:
        out[name] = _wire_value(getattr(settings, name))
    return out


def _wire_value(value: object) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, (list, tuple)):
        return [_wire_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)  # Path, AnyHttpUrl


def guard_config(settings: Settings) -> GuardConfig:
    """Settings -> the guard's GuardConfig: the one conversion, the same wire form `sparkwatch run` hands the guard
    process (tests build the guard through here, as production does)."""
    return GuardConfig.from_wire(settings_to_wire(settings), settings.public_dict())


_SIZE_KEYS = frozenset(
    name
    for name, info in Settings.model_fields.items()
    if any(isinstance(m, BeforeValidator) and m.func is _size for m in info.metadata)
)


def settings_from_wire(wire: Mapping[str, Any]) -> Settings:
    """A Settings from `settings_to_wire`'s output: the same schema, no environment or file read. Raises ConfigError."""
    try:
        # Sizes travel as byte counts; said so here, since a bare number is refused everywhere a person writes one.
        sizes = {k: f"{v}B" for k, v in wire.items() if k in _SIZE_KEYS and type(v) is int}
        settings = Settings.model_validate({**wire, **sizes})
    except ValidationError as exc:
        raise ConfigError(_describe(exc, set())) from None
    remember_secrets(settings.secrets())  # this process's redaction knows them before it logs a line
    return settings


def _literal(value: object) -> str:
    if isinstance(value, Path):
        return f"Path({json.dumps(str(value))})"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # double quotes, as ruff format writes them
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    raise TypeError(f"no literal for {type(value).__name__} in the defaults snapshot")


def defaults_snapshot() -> str:
    """config/defaults.py's generated block: each key's default as the schema builds it from nothing (validated;
    no file, environment or flag), except the keys whose default a function in config/defaults.py computes from the
    environment (FACTORIES), which stay calls."""
    # BaseSettings reads SPARKWATCH_* even in model_validate: the snapshot is of the schema alone.
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.upper().startswith(ENV_PREFIX)}
    try:
        built = Settings.model_validate({})
    finally:
        os.environ.update(saved)
    factories = set(FACTORIES.values())
    lines = ["STATIC: dict[str, object] = {"]
    for name, info in Settings.model_fields.items():
        if info.default_factory not in factories:
            lines.append(f"    {json.dumps(name)}: {_literal(getattr(built, name))},")
    lines.append("}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m sparkwatch.config.schema: rewrite the snapshot in config/defaults.py
    import sparkwatch.config.defaults as _defaults_module

    target = Path(str(_defaults_module.__file__))
    text = target.read_text()
    head, _, rest = text.partition("\n" + SNAPSHOT_BEGIN + "\n")
    _, _, tail = rest.partition("\n" + SNAPSHOT_END + "\n")
    target.write_text(head + "\n" + SNAPSHOT_BEGIN + "\n" + defaults_snapshot() + SNAPSHOT_END + "\n" + tail)
    print(f"wrote {target}", file=sys.stderr)
