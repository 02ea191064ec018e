"""Config that works or fails: sizes against MemTotal, listen addresses, TLS files, an empty secret, bad files."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkwatch.config.settings import ConfigError, load_settings
from sparkwatch.core.units import GiB
from tests.daemon import sparkwatch_run


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("SPARKWATCH_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def memtotal_bytes() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", *args], capture_output=True, text=True, env=full, timeout=timeout
    )


def assert_one_line_exit_2(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    assert res.stderr.count("\n") == 1, res.stderr
    for needle in needles:
        assert needle in res.stderr, res.stderr


def test_floor_at_or_above_memtotal_is_refused_by_check_config_and_run(tmp_path: Path) -> None:
    total_gib = memtotal_bytes() // GiB
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'floor = "{total_gib + 1}GiB"\n')
    assert_one_line_exit_2(cli("check-config", "--config", str(cfg)), "floor:", "MemTotal")
    assert_one_line_exit_2(
        cli("run", "--config", str(cfg), env={"SPARKWATCH_STATE_DIR": str(tmp_path / "s")}), "floor:", "MemTotal"
    )
    with pytest.raises(ConfigError, match="rearm_headroom:"):
        load_settings(None, {"floor": f"{memtotal_bytes() - GiB // 2}B", "rearm_headroom": "1GiB"}, check_memory=True)
    with pytest.raises(ConfigError, match=r"floor: .*less than or equal"):
        load_settings(None, {"floor": "9000TiB"})
    with pytest.raises(ConfigError, match="floor:"):
        load_settings(None, {"floor": "1e400GiB"})


def test_reload_keeps_the_running_floor_when_the_new_one_is_above_memtotal(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('floor = "1GiB"\n')
    with sparkwatch_run(tmp_path, "--config", str(cfg), env={"SPARKWATCH_MLOCK": "false"}) as d:
        cfg.write_text(f'floor = "{memtotal_bytes() // GiB + 4}GiB"\n')
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any("reload:" in line for line in d.stderr_lines):
            time.sleep(0.05)
        reload_lines = [line for line in d.stderr_lines if "reload:" in line]
        assert reload_lines and "floor:" in reload_lines[0] and "keeping the running config" in reload_lines[0]
        assert d.proc.poll() is None


def test_missing_meminfo_in_run_is_one_line_exit_2(tmp_path: Path) -> None:
    empty_proc = tmp_path / "proc"
    empty_proc.mkdir()
    res = cli("run", "--proc-root", str(empty_proc), env={"SPARKWATCH_STATE_DIR": str(tmp_path / "s")})
    assert_one_line_exit_2(res, "meminfo")


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ('listen = ":9847"\n', "listen: the host is missing"),
        ('listen = "no-such-host.invalid:9847"\n', "does not resolve"),
        ('webhook_url = "http://127.0.0.1:9/x"\nwebhook_secret = ""\n', "webhook_secret: is empty"),
        ('tls_cert_file = "/nonexistent/cert.pem"\ntls_key_file = "/nonexistent/key.pem"\n', "tls_cert_file:"),
    ],
)
def test_settings_that_would_not_work_are_refused(tmp_path: Path, toml: str, needle: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError) as err:
        load_settings(cfg)
    assert needle in str(err.value)


def test_tls_file_that_is_unreadable_is_refused(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.mkdir()  # a directory where a file should be: unreadable for root too
    with pytest.raises(ConfigError, match="tls_cert_file:"):
        load_settings(None, {"tls_cert_file": str(cert), "tls_key_file": str(cert)})


def test_plaintext_beyond_loopback_warns(tmp_path: Path) -> None:
    res = cli("check-config", env={"SPARKWATCH_LISTEN": "0.0.0.0:9847", "XDG_CONFIG_HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    assert "WARNING listen: metrics are served as plain HTTP" in res.stderr
    quiet = cli("check-config", env={"SPARKWATCH_LISTEN": "127.0.0.1:9847", "XDG_CONFIG_HOME": str(tmp_path)})
    assert "WARNING" not in quiet.stderr


def test_bad_config_files_are_one_line_exit_2(tmp_path: Path) -> None:
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'# caf\xe9\nfloor = "6GiB"\n')
    assert_one_line_exit_2(cli("check-config", "--config", str(latin1)), "not UTF-8")
    assert_one_line_exit_2(cli("run", "--config", str(latin1)), "not UTF-8")
    assert_one_line_exit_2(cli("check-config", "--config", str(tmp_path)), "is a directory")
    assert_one_line_exit_2(cli("run", "--config", str(tmp_path)), "is a directory")
    nested = tmp_path / "nested.toml"
    nested.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert_one_line_exit_2(cli("check-config", "--config", str(nested)))


@pytest.mark.parametrize(
    ("key", "value", "needle"),
    [
        ("jit_stall_s", float("inf"), "jit_stall_s: Input should be less than or equal to 86400"),  # TOML 1e400
        ("ancestor_pid", int("9" * 400), "ancestor_pid: Input should be less than or equal to 4194304"),
        ("compile_jobs_alert", int("9" * 400), "compile_jobs_alert: Input should be less than or equal to 4096"),
        ("floor", "9" * 400 + "GiB", "floor: 99999999999999999999… (400 digits) is too large to be a size"),
    ],
)
def test_every_number_in_the_config_has_a_range(key: str, value: object, needle: str) -> None:
    """`jit_stall_s = 1e400` was inf, taken (the stall alert never fired); a 400-digit ancestor_pid was taken too.
    The error line shows the value cut, not 400 digits."""
    with pytest.raises(ConfigError) as err:
        load_settings(None, {key: value})
    assert needle in str(err.value) and len(str(err.value)) < 200, str(err.value)


def test_a_400_digit_number_in_a_config_file_is_one_short_line(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"jit_stall_s = 1e400\nancestor_pid = {'9' * 400}\n")
    res = cli("check-config", "--config", str(cfg))
    assert_one_line_exit_2(res, "ancestor_pid:", "[from config file]")
    assert len(res.stderr) < 200, res.stderr
