"""Stand-ins for a Settings without pydantic: `DefaultSettings` (the schema's defaults, from the snapshot in
config.defaults) and `WireSettings` (the guard's validated values, rebuilt from the wire for the telemetry process).
Each answers its keys and what `Derived` computes; anything else (model_dump, public_dict, ...) builds the real
Settings from the same values on first use, the one place pydantic is imported for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkwatch.config.defaults import FACTORIES, STATIC, Derived

if TYPE_CHECKING:
    from sparkwatch.config.schema import Settings


class DefaultSettings(Derived):
    """`Settings()` as the schema builds it, read from the snapshot: every key, and what Derived computes from them.
    Anything else a Settings has (model_dump, public_dict, …) is answered by a real Settings built from the same
    values on first use, so this stands in for one everywhere but `isinstance`."""

    __slots__ = ("_full", "_values")

    def __init__(self) -> None:
        values = {name: list(v) if isinstance(v, list) else v for name, v in STATIC.items()}
        values.update((name, factory()) for name, factory in FACTORIES.items())
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_full", None)

    def __getattr__(self, name: str) -> Any:
        values: dict[str, object] = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        return getattr(self.settings(), name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"settings are frozen ({name})")

    def settings(self) -> Settings:
        """The real Settings with these values (imports pydantic)."""
        full: Settings | None = object.__getattribute__(self, "_full")
        if full is None:
            from sparkwatch.config.schema import Settings  # noqa: PLC0415 - the point is to import it only here

            full = Settings.model_construct(**object.__getattribute__(self, "_values"))
            object.__setattr__(self, "_full", full)
        return full

    def __repr__(self) -> str:
        return f"DefaultSettings({object.__getattribute__(self, '_values')!r})"


class Secret:
    """A secret as the wire carries it, shown as pydantic's SecretStr shows one: never its value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get_secret_value(self) -> str:
        return self._value

    def __eq__(self, other: object) -> bool:
        getter = getattr(other, "get_secret_value", None)
        return callable(getter) and getter() == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __str__(self) -> str:
        return "**********"


# The keys whose wire form (a string) is not the value a Settings holds: paths, lists of paths, the secret. Every
# other key travels as Settings holds it (sizes as byte counts, the webhook URL as its string). Held to the schema,
# key by key, by tests/test_config_defaults.py.
PATH_KEYS = frozenset(
    {"state_dir", "kernel_log_path", "proc_root", "root", "tls_cert_file", "tls_key_file", "tls_client_ca_file",
     "postmortem_journal_dir", "peer_key_file"}
)  # fmt: skip
PATH_LIST_KEYS = frozenset({"jit_cache_dirs", "vllm_cache_dirs"})


class WireSettings(DefaultSettings):
    """The settings the guard validated, rebuilt from its wire values (`schema.settings_to_wire`) without pydantic:
    what the telemetry process runs on. The guard process validated them once with the schema; pydantic and the
    Settings model are about 16 MiB of an interpreter's RSS (bench/RESULTS-rss-gpu.md), which telemetry, with NVML
    loaded, cannot spare. Like DefaultSettings, anything but a key and what Derived computes builds a real Settings
    on first use."""

    __slots__ = ()

    def __init__(self, wire: Mapping[str, Any]) -> None:
        values: dict[str, object] = {}
        for name, value in wire.items():
            if value is None:
                values[name] = None
            elif name in PATH_KEYS:
                values[name] = Path(value)
            elif name in PATH_LIST_KEYS:
                values[name] = [Path(v) for v in value]
            elif name == "webhook_secret":
                values[name] = Secret(value)
            else:
                values[name] = list(value) if isinstance(value, list) else value
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_full", None)

    def __repr__(self) -> str:
        return f"WireSettings({sorted(object.__getattribute__(self, '_values'))!r})"
