"""The telemetry process builds its settings from the guard's wire values without pydantic-settings: the layering of
file, environment and flags is the loading process's alone (config/schema.validate). Measured on an H200 host:
bench/RESULTS-rss-gpu.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from sparkwatch.config.settings import load_settings, settings_to_wire

PROBE = """
import json, sys
from sparkwatch.telemetry.process import settings_from_wire
settings = settings_from_wire(json.loads(sys.stdin.read()))
print(json.dumps({"floor": settings.floor, "loaded": sorted(m for m in sys.modules if m.startswith("pydantic"))}))
"""


def test_telemetry_takes_the_wire_settings_without_pydantic_settings(tmp_path: Path) -> None:
    settings = load_settings(None, {"floor": "3GiB", "state_dir": tmp_path / "state", "webhook_url": None})
    wire = settings_to_wire(settings)
    res = subprocess.run(
        [sys.executable, "-c", PROBE], input=json.dumps(wire), capture_output=True, text=True, timeout=60, check=True
    )
    got = json.loads(res.stdout)
    assert got["floor"] == 3 << 30  # the same validated values, through the same schema
    assert "pydantic" in got["loaded"]  # still validated by pydantic
    assert not [m for m in got["loaded"] if m.startswith("pydantic_settings")]
