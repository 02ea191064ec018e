"""The guard process's pydantic-free view of Settings (sparkwatch/common/guardconfig.py) holds the same values."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from sparkwatch.common.guardconfig import GuardConfig
from sparkwatch.config.settings import Settings, load_settings, settings_to_wire


def test_every_guard_field_round_trips_from_a_validated_settings(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        {
            "state_dir": tmp_path,
            "floor": "3GiB",
            "kill_order": ["growth", "youngest"],
            "never_kill": ["^ray::IDLE"],
            "kill_priority": ["5=^my-engine"],
            "dry_run": True,
            "kill_settle_s": 7.5,
        },
    )
    config = GuardConfig.from_wire(settings_to_wire(settings), settings.public_dict())
    for f in fields(GuardConfig):
        if f.name in ("wire", "public"):
            continue
        assert f.name in Settings.model_fields, f"GuardConfig.{f.name} is not a Settings key"
        expected = getattr(settings, f.name)
        got = getattr(config, f.name)
        if isinstance(expected, list):
            expected = tuple(expected)
        assert got == expected and type(got) is type(expected), f"{f.name}: {got!r} != {expected!r}"
    assert config.floor == 3 << 30 and config.never_kill == ("^ray::IDLE",)


def test_a_wire_form_missing_a_key_names_it(tmp_path: Path) -> None:
    wire = settings_to_wire(load_settings(None, {"state_dir": tmp_path}))
    del wire["kill_settle_s"]
    with pytest.raises(ValueError, match="unusable: KeyError: 'kill_settle_s'"):
        GuardConfig.from_wire(wire)
