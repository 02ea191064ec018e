"""Configuration layers and errors, in-process and through the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.config.settings import ConfigError, load_settings
from sparkwatch.core.units import GiB, MiB, format_size, parse_size


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(__import__("os").environ):
        if key.startswith("SPARKWATCH_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def test_sizes() -> None:
    assert parse_size("8GiB") == 8 * GiB
    assert parse_size("512MiB") == 512 * MiB
    assert parse_size("8G") == 8 * GiB
    assert parse_size("1.5GiB") == int(1.5 * GiB)
    assert parse_size("8Gi") == parse_size("8 gib") == 8 * GiB
    assert parse_size("4096B") == 4096
    assert parse_size("0") == parse_size("0.0") == parse_size("0GiB") == 0  # nothing is nothing in every unit
    for bad in ("eight", "8 XB", "-1GiB", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(8 * GiB) == "8.0 GiB"
    assert format_size(4726 * MiB) == "4.6 GiB"
    assert format_size(512) == "512 B"


def test_defaults_are_safe_without_a_file() -> None:
    s = load_settings()
    assert s.floor == 8 * GiB
    assert s.listen == "127.0.0.1:9847"
    assert not s.dry_run


def test_layers_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('floor = "6GiB"\nwarn_headroom = "2GiB"\nlisten = "0.0.0.0:9900"\n')
    s = load_settings(cfg)
    assert (s.floor, s.warn_headroom, s.listen) == (6 * GiB, 2 * GiB, "0.0.0.0:9900")
    monkeypatch.setenv("SPARKWATCH_FLOOR", "10GiB")
    assert load_settings(cfg).floor == 10 * GiB
    assert load_settings(cfg, {"floor": "12GiB"}).floor == 12 * GiB
    monkeypatch.setenv("SPARKWATCH_ENGINE_PATTERNS", '["mine=my-server$"]')
    assert load_settings(cfg).engine_patterns == ["mine=my-server$"]


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('flor = "8GiB"\n', "flor: unknown setting (did you mean 'floor'?)"),
        ('floor = "eight"\n', "floor: 'eight' is not a size"),
        ("floor = true\n", "floor: expected a size"),
        ('listen = "localhost"\n', "listen: expected host:port"),
        ('webhook_url = "not a url"\n', "webhook_url:"),
        ('engine_patterns = ["x"]\n', "engine_patterns: 'x' should be written as kind=regex"),
        ("poll_min_s = 0.5\npoll_max_s = 0.2\n", "poll_min_s must not exceed poll_max_s"),
        ("floor = [\n", "not valid TOML"),
    ],
)
def test_mistakes_name_the_key(tmp_path: Path, toml: str, message: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_env_typo_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKWATCH_FLOR", "8GiB")
    with pytest.raises(ConfigError, match="SPARKWATCH_FLOR: unknown setting"):
        load_settings()


def test_secret_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKWATCH_WEBHOOK_URL", "https://hooks.slack.com/services/T000/B000/XXXXSECRET")
    monkeypatch.setenv("SPARKWATCH_WEBHOOK_SECRET", "hunter2")
    shown = str(load_settings().public_dict())
    assert "XXXXSECRET" not in shown and "hunter2" not in shown
    assert "hooks.slack.com" in shown


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_check_config_cli_exit_codes(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('floor = "6GiB"\n')
    ok = cli("check-config", "--config", str(good))
    assert ok.returncode == 0, ok.stderr
    assert "6.0 GiB" in ok.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('floor = "6 bananas"\n')
    res = cli("check-config", "--config", str(bad))
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1 and "floor:" in res.stderr and "Traceback" not in res.stderr
    res = cli("run", "--config", str(bad))
    assert res.returncode == 2 and "floor:" in res.stderr
    missing = cli("check-config", "--config", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


# Every size key a person can write: a bare number is refused for each, whatever layer it comes from (0 alone is
# taken: it is the same in every unit).
SIZE_KEYS = ("floor", "warn_headroom", "rearm_headroom", "events_max_bytes")


@pytest.mark.parametrize("key", SIZE_KEYS)
@pytest.mark.parametrize("raw", ["8", '"8"', '"1"', "1", "8589934592"])
def test_a_size_without_a_unit_is_refused_naming_the_key(key: str, raw: str, tmp_path: Path) -> None:
    """`floor = 8` used to run a guard with an 8-byte floor, which never fires, and check-config said ok."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"{key} = {raw}\n")
    number = raw.strip('"')
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert str(err.value) == (
        f"{key}: {number} has no unit; write {number}GiB or {number}MiB (or {number}B for bytes) [from config file]"
    )


@pytest.mark.parametrize("key", SIZE_KEYS)
def test_a_size_without_a_unit_is_refused_from_env_and_flags(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(f"SPARKWATCH_{key.upper()}", "8")
    with pytest.raises(ConfigError, match=rf"^{key}: 8 has no unit; write 8GiB .*\[from SPARKWATCH_{key.upper()}\]$"):
        load_settings()
    monkeypatch.delenv(f"SPARKWATCH_{key.upper()}")
    with pytest.raises(ConfigError, match=rf"^{key}: 8 has no unit"):
        load_settings(None, {key: "8"})  # a command-line flag (run --floor 8)
    with pytest.raises(ConfigError, match=rf"^{key}: 4096 has no unit"):
        load_settings(None, {key: 4096})


@pytest.mark.parametrize(
    ("written", "binary", "decimal_bytes"),
    [("8 GB", "8GiB", 8 * 10**9), ("8GB", "8GiB", 8 * 10**9), ("8MB", "8MiB", 8 * 10**6), ("8kB", "8KiB", 8000)],
)
def test_decimal_units_are_refused_never_read_as_binary(written: str, binary: str, decimal_bytes: int) -> None:
    """ "8 GB" was read as 8 GiB without a word. Refused, with both ways to say it."""
    with pytest.raises(ConfigError) as err:
        load_settings(None, {"events_max_bytes": written})
    message = str(err.value)
    assert message.startswith(f"events_max_bytes: {written!r}: ") and "ambiguous" in message
    assert f"write {binary} for binary, or {decimal_bytes}B" in message and "\n" not in message


def test_the_documented_forms_are_kept() -> None:
    for written, expected in (("8GiB", 8 * GiB), ("8G", 8 * GiB), ("512MiB", 512 * MiB), ("1.5GiB", int(1.5 * GiB))):
        assert load_settings(None, {"warn_headroom": written}).warn_headroom == expected
    assert load_settings(None, {"events_max_bytes": f"{1 << 20}B"}).events_max_bytes == 1 << 20


@pytest.mark.parametrize("floor", ["1MiB", "1023MiB", "0B", f"{GiB - 1}B"])
def test_a_floor_under_1_gib_is_refused(floor: str) -> None:
    with pytest.raises(ConfigError, match=r"^floor: .* is under 1\.0 GiB: no kill could beat a start-up spike"):
        load_settings(None, {"floor": floor})
    assert load_settings(None, {"floor": "1GiB"}).floor == GiB


def test_the_wire_form_keeps_byte_counts() -> None:
    """Between sparkwatch's own processes sizes are byte counts (settings_to_wire): the refusal is for people."""
    from sparkwatch.config.settings import settings_from_wire, settings_to_wire

    settings = load_settings(None, {"floor": "6GiB", "events_max_bytes": "1MiB"})
    wire = settings_to_wire(settings)
    assert wire["floor"] == 6 * GiB and isinstance(wire["floor"], int)
    again = settings_from_wire(wire)
    assert (again.floor, again.events_max_bytes, again.warn_headroom) == (6 * GiB, MiB, 4 * GiB)


def test_check_config_refuses_a_bare_floor(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("floor = 8\n")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SPARKWATCH_")}
    res = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "check-config", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert res.returncode == 2 and res.stdout == ""
    assert (
        res.stderr == "sparkwatch: config error: floor: 8 has no unit; write 8GiB or 8MiB (or 8B for bytes) "
        "[from config file]\n"
    )
