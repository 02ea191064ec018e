"""The telemetry process runs on the guard's validated settings as the wire carries them, without pydantic: the
schema validates once, in the process that loads the config (config/schema.validate), and telemetry's settings are
config.standins.WireSettings, held here to the schema key by key. Measured on an H200 host: bench/RESULTS-rss-gpu.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.config.settings import ConfigError, load_settings, settings_to_wire, wire_settings

PROBE = """
import json, sys
from sparkwatch.telemetry.telemetryprocess import wire_settings
settings = wire_settings(json.loads(sys.stdin.read()))
print(json.dumps({"floor": settings.floor, "state_dir": str(settings.events_path),
                  "loaded": sorted(m for m in sys.modules if m.startswith("pydantic"))}))
"""


def plain(value: Any) -> Any:
    """A value as compared here: a secret by its value, a URL by its string, a list item by item."""
    if hasattr(value, "get_secret_value"):
        return ("secret", value.get_secret_value())
    if isinstance(value, list):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, Path)):
        return value
    return str(value)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"webhook_url": "https://hooks.example/T000/B000/XXXX?token=abc", "webhook_secret": "s3cret",
         "engine_budgets": ["6GiB=gpu-runaway"], "kill_priority": ["10=llama-server"], "dry_run": True,
         "jit_cache_dirs": ["/tmp/a", "/tmp/b"]},
    ],
)  # fmt: skip
def test_the_wire_settings_are_the_schemas_values_key_by_key(tmp_path: Path, overrides: dict[str, Any]) -> None:
    settings = load_settings(None, {"state_dir": tmp_path / "state", **overrides})
    wire = settings_to_wire(settings)
    rebuilt = wire_settings(json.loads(json.dumps(wire)))  # through JSON, as the channel carries it
    for name in type(settings).model_fields:
        assert plain(getattr(rebuilt, name)) == plain(getattr(settings, name)), name
    assert rebuilt.secrets() == settings.secrets()
    assert rebuilt.events_path == settings.events_path and rebuilt.listen_port == settings.listen_port
    assert "s3cret" not in repr(rebuilt)


def test_wire_settings_of_another_version_are_refused() -> None:
    with pytest.raises(ConfigError, match="floor_mib: not a key"):
        wire_settings({"floor_mib": 1})
    with pytest.raises(ConfigError, match="ancestor_pid: missing"):
        wire_settings({})


def test_telemetry_takes_the_wire_settings_without_pydantic(tmp_path: Path) -> None:
    settings = load_settings(None, {"floor": "3GiB", "state_dir": tmp_path / "state"})
    res = subprocess.run(
        [sys.executable, "-c", PROBE],
        input=json.dumps(settings_to_wire(settings)), capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    got = json.loads(res.stdout)
    assert got["floor"] == 3 << 30 and got["state_dir"] == str(tmp_path / "state" / "events.jsonl")
    assert got["loaded"] == []


SCRAPE_PROBE = """
import json, sys
from sparkwatch.telemetry.telemetryprocess import make_outbox, wire_settings
from sparkwatch.telemetry.exporter.server import MetricsServer, build_registry
settings = wire_settings(json.loads(sys.stdin.read()))
outbox = make_outbox(settings)
server = MetricsServer(settings, build_registry(settings, lambda: None, outbox=outbox))
tls = server.ssl_context() is not None
for accept in ("", "application/openmetrics-text; version=1.0.0"):
    status, _type, body = server.handle("GET", "/metrics", {"accept": accept})
    assert status == 200 and b"sparkwatch_" in body
heavy = ("ssl", "urllib.request", "http.client", "hashlib", "prometheus_client.exposition", "h11")
print(json.dumps({"tls": tls, "outbox": outbox is not None, "loaded": [m for m in heavy if m in sys.modules]}))
"""


def test_telemetry_without_tls_or_webhook_loads_no_ssl_nor_urllib(tmp_path: Path) -> None:
    """ssl and urllib.request (prometheus_client's exposition module imports both) and libcrypto's hashlib cost
    telemetry about 8 MiB RSS: loaded only where TLS or a webhook is configured; h11 (the peers' and Ray's client,
    telemetry.sources.httpget) only at a first read of them. Scrapes of both formats included."""
    pki = tmp_path / "pki"
    pki.mkdir()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-days", "1",
         "-keyout", str(pki / "key.pem"), "-out", str(pki / "cert.pem")],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    cases: list[tuple[dict[str, Any], list[str]]] = [
        ({}, []),
        ({"webhook_url": "https://hooks.example/T000"}, ["ssl"]),  # http.client and hmac at the first delivery
        ({"tls_cert_file": pki / "cert.pem", "tls_key_file": pki / "key.pem"}, ["ssl"]),
    ]
    for overrides, expected in cases:
        settings = load_settings(None, {"state_dir": tmp_path / "state", **overrides})
        res = subprocess.run(
            [sys.executable, "-c", SCRAPE_PROBE],
            input=json.dumps(settings_to_wire(settings)), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        assert got["outbox"] == ("webhook_url" in overrides) and got["tls"] == ("tls_cert_file" in overrides)
        assert sorted(got["loaded"]) == sorted(expected), overrides
