"""The defaults snapshot (config/defaults.py) is the schema's, not a second one: its generated block is what
`schema.defaults_snapshot()` writes now, and `DefaultSettings()` equals `Settings()` key by key, in environments that
move the defaults the environment decides. `load_settings` hands it back only when there is nothing to validate."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparkwatch.config import defaults, schema
from sparkwatch.config.defaults import FACTORIES, SNAPSHOT_BEGIN, SNAPSHOT_END
from sparkwatch.config.schema import Settings
from sparkwatch.config.settings import ConfigError, load_settings
from sparkwatch.config.standins import DefaultSettings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.upper().startswith("SPARKWATCH_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def test_generated_block_is_what_the_schema_writes_now(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKWATCH_FLOOR", "9GiB")  # the environment never leaks into the snapshot
    text = Path(str(defaults.__file__)).read_text()
    block = text.partition("\n" + SNAPSHOT_BEGIN + "\n")[2].partition("\n" + SNAPSHOT_END + "\n")[0] + "\n"
    assert block == schema.defaults_snapshot(), "run: python -m sparkwatch.config.schema"


def test_factories_are_the_schemas_default_factories() -> None:
    own = {name for name, info in Settings.model_fields.items() if info.default_factory in set(FACTORIES.values())}
    assert own == set(FACTORIES)
    for name, factory in FACTORIES.items():
        assert Settings.model_fields[name].default_factory is factory
    assert set(defaults.STATIC) | set(FACTORIES) == set(Settings.model_fields)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"HOME": "/home/x", "XDG_STATE_HOME": "", "FLASHINFER_WORKSPACE_BASE": "", "VLLM_CACHE_ROOT": ""},
        {"XDG_STATE_HOME": "/s", "FLASHINFER_WORKSPACE_BASE": "/fi", "VLLM_CACHE_ROOT": "/vc"},
    ],
)
def test_default_settings_equal_the_schemas(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    built = Settings.model_validate({})
    snap = DefaultSettings()
    for name in Settings.model_fields:
        assert getattr(snap, name) == getattr(built, name), name
        assert type(getattr(snap, name)) is type(getattr(built, name)), name
    assert snap.events_path == built.events_path and snap.outbox_dir == built.outbox_dir
    assert snap.public_dict() == built.public_dict()  # answered by a real Settings, built on first use
    assert snap.secrets() == [] and snap.warnings() == built.warnings()


def test_defaults_are_frozen_and_their_lists_their_own() -> None:
    snap = DefaultSettings()
    with pytest.raises(AttributeError):
        snap.floor = 1
    snap.kill_order.append("x")
    assert DefaultSettings().kill_order == Settings.model_validate({}).kill_order


def kind(settings: object) -> type:
    """load_settings says Settings; what it hands back is DefaultSettings when there was nothing to validate."""
    return type(settings)


def test_load_settings_validates_whenever_there_is_something_to_validate(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert kind(load_settings()) is DefaultSettings
    assert kind(load_settings(overrides={"root": None})) is DefaultSettings  # a flag not given
    assert kind(load_settings(check_memory=True)) is Settings  # run, check-config, reload
    assert kind(load_settings(overrides={"root": tmp_path})) is Settings
    with pytest.raises(ConfigError, match="root"):
        load_settings(overrides={"root": 5})
    config = tmp_path / "c.toml"
    config.write_text('floor = "9GiB"\n')
    assert load_settings(config).floor == 9 << 30
    monkeypatch.setenv("SPARKWATCH_TEST_ANYTHING", "1")  # the test suite's own variables are not settings
    assert kind(load_settings()) is DefaultSettings
    monkeypatch.setenv("sparkwatch_floor", "10GiB")  # pydantic-settings matches names case-insensitively
    assert load_settings().floor == 10 << 30
