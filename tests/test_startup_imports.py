"""What a command loads before it answers, held in a real child process (`sys.modules` at exit), not timed: speed
lives in bench/startup_bench.py. `sparkwatch --version` loads no pydantic, rich or command module; a command's
`--help` loads that command's module only; with nothing to validate (no config file, no SPARKWATCH_* variable, no
flag) the read-only commands load no pydantic, and `events`, which prints plain lines, no rich either."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent

# Runs `sparkwatch ARGV…` in this interpreter and prints the modules it had loaded when it returned (or exited).
PROBE = """
import json, sys
from sparkwatch.entry import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
print("\\nMODULES " + json.dumps(sorted(sys.modules)))
sys.exit(code or 0)
"""

HEAVY = ("pydantic", "pydantic_core", "pydantic_settings", "rich")


def loaded(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[set[str], str]:
    home = tmp_path / "home"
    (home / "state" / "sparkwatch").mkdir(parents=True, exist_ok=True)
    (home / "config").mkdir(exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("SPARKWATCH_")}
    base.update(XDG_CONFIG_HOME=str(home / "config"), XDG_STATE_HOME=str(home / "state"), TERM="dumb")
    res = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        env={**base, **(env or {})},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out, _, mods = res.stdout.rpartition("\nMODULES ")
    assert mods, res.stdout + res.stderr
    return set(json.loads(mods)), out + res.stderr


def heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


def command_modules(modules: set[str]) -> set[str]:
    return {name for name, mod in COMMANDS.items() if f"sparkwatch.cli.{mod}" in modules}


def test_version_loads_no_command_and_nothing_heavy(tmp_path: Path) -> None:
    modules, out = loaded(tmp_path, "--version")
    assert out.startswith("sparkwatch ")
    assert heavy(modules) == []
    assert command_modules(modules) == set()
    assert "sparkwatch.config.schema" not in modules and "sparkwatch.core.model" not in modules


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_of_one_command_loads_that_command_only(tmp_path: Path, command: str) -> None:
    modules, out = loaded(tmp_path, command, "--help")
    assert f"usage: sparkwatch {command}" in out
    assert heavy(modules) == []
    assert command_modules(modules) == {command}


def test_bare_help_lists_every_command(tmp_path: Path) -> None:
    modules, out = loaded(tmp_path, "--help")
    assert all(name in out for name in COMMANDS)
    assert command_modules(modules) == set(COMMANDS)
    assert heavy(modules) == []


def test_events_with_nothing_to_validate_loads_no_pydantic_and_no_rich(tmp_path: Path) -> None:
    modules, out = loaded(tmp_path, "events")
    assert "no events in" in out
    assert heavy(modules) == []


@pytest.mark.parametrize(
    "argv", [("engines", "--window", "0"), ("status", "--once"), ("launch", "--plan", "--", "vllm", "serve", "MODEL")]
)
def test_read_only_commands_with_nothing_to_validate_load_no_pydantic(tmp_path: Path, argv: tuple[str, ...]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    modules, _ = loaded(tmp_path, *(str(model) if a == "MODEL" else a for a in argv))
    assert [m for m in heavy(modules) if not m.startswith("rich")] == []


@pytest.mark.parametrize(
    ("how", "extra", "env"),
    [
        ("a config file", ("--config", "CONFIG"), {}),
        ("a SPARKWATCH_ variable", (), {"SPARKWATCH_FLOOR": "9GiB"}),
        ("a lower-case one (pydantic-settings reads it too)", (), {"sparkwatch_floor": "9GiB"}),
        ("a flag", ("--state-dir", "STATE"), {}),
    ],
)
def test_events_validates_when_there_is_something_to_validate(
    tmp_path: Path, how: str, extra: tuple[str, ...], env: dict[str, str]
) -> None:
    config = tmp_path / "config.toml"
    config.write_text('floor = "9GiB"\n')
    argv = [{"CONFIG": str(config), "STATE": str(tmp_path)}.get(a, a) for a in extra]
    modules, _ = loaded(tmp_path, "events", *argv, env=env)
    assert "pydantic" in modules and "sparkwatch.config.schema" in modules, how


# Runs `python -m sparkwatch.telemetry` as the guard's supervisor does, on a channel whose other end is already closed
# (telemetry gives up at once: no usable config), and says what was loaded when the NVML load check's child started
# and whether that child was reaped before the process returned.
TELEMETRY_PROBE = """
import json, runpy, socket, subprocess, sys
spawned = []
real_popen = subprocess.Popen
class Popen(real_popen):
    def __init__(self, args, *a, **k):
        super().__init__(args, *a, **k)
        if "-c" in args:  # the preflight child
            spawned.append((self, sorted(sys.modules)))
subprocess.Popen = Popen
ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
ours.close()
sys.argv = ["sparkwatch-telemetry", "--channel-fd", str(theirs.fileno())]
try:
    runpy.run_module("sparkwatch.telemetry", run_name="__main__")
except SystemExit as exc:
    code = exc.code
(child, modules), = spawned
print("\\nPROBE " + json.dumps({"code": code, "modules": modules, "reaped": child.returncode is not None}))
"""


def test_telemetry_starts_the_nvml_check_before_its_imports_and_reaps_it(tmp_path: Path) -> None:
    """The telemetry process's NVML load check (a child process) starts before pydantic, prometheus_client, the
    settings and the model are imported, so the child runs beside those imports; a process that stops before it
    needs the answer (here: the guard's end of the channel is closed) still reaps the child."""
    res = subprocess.run(
        [sys.executable, "-c", TELEMETRY_PROBE],
        env={k: v for k, v in os.environ.items() if not k.upper().startswith("SPARKWATCH_")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    _, _, probe = res.stdout.rpartition("\nPROBE ")
    assert probe, res.stdout + res.stderr
    got = json.loads(probe)
    assert got["code"] == 2  # "no usable config from the guard"
    early = set(got["modules"])
    assert heavy(early) == []
    assert not early & {"prometheus_client", "sparkwatch.telemetry.telemetryprocess", "sparkwatch.core.model"}
    assert got["reaped"]


def test_a_config_validated_once_is_not_validated_again_until_it_changes(tmp_path: Path) -> None:
    """The second read-only command with the same config loads no pydantic (config.validated) and reads the same
    values; a change of the file, of a SPARKWATCH_* variable or of a flag validates again, and so does a config
    with a secret, every time (a secret is never written down)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    config = tmp_path / "config.toml"
    config.write_text('floor = "9GiB"\nrearm_headroom = "3GiB"\n')
    env = {"XDG_RUNTIME_DIR": str(run)}

    def events(*extra: str, more: dict[str, str] | None = None) -> bool:
        modules, out = loaded(tmp_path, "events", "--config", str(config), *extra, env={**env, **(more or {})})
        assert "Traceback" not in out and "config error" not in out, out
        return "pydantic" in modules

    assert events()  # validated, and kept
    assert not events()  # the same inputs: kept values, no pydantic
    cache = run / "sparkwatch" / "validated.json"
    assert (cache.stat().st_mode & 0o777, run.joinpath("sparkwatch").stat().st_mode & 0o777) == (0o600, 0o700)
    assert json.loads(cache.read_text())["wire"]["floor"] == 9 << 30
    assert events(more={"SPARKWATCH_WARN_HEADROOM": "6GiB"})  # another variable
    assert not events(more={"SPARKWATCH_WARN_HEADROOM": "6GiB"})
    config.write_text('floor = "10GiB"\n')
    assert events()  # the file changed
    assert json.loads(cache.read_text())["wire"]["floor"] == 10 << 30
    assert events("--state-dir", str(tmp_path / "s"))  # a flag
    config.write_text('floor = "10GiB"\nwebhook_url = "https://hooks.example.com/T0/B0/s3cr3t"\n')
    assert events() and events()  # a secret: validated every time
    assert "s3cr3t" not in cache.read_text()


def test_a_kept_validation_is_not_trusted_when_a_file_it_opened_changed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("not checked for content here\n")
    key.write_text("nor this\n")
    config = tmp_path / "config.toml"
    config.write_text(f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\nlisten = "127.0.0.1:9464"\n')
    env = {"XDG_RUNTIME_DIR": str(run)}
    first, out = loaded(tmp_path, "events", "--config", str(config), env=env)
    if "pydantic" not in first or "Traceback" in out or "config error" in out:
        pytest.skip(f"this box refuses the TLS files themselves: {out[-200:]}")
    assert "pydantic" not in loaded(tmp_path, "events", "--config", str(config), env=env)[0]
    key.unlink()
    modules, out = loaded(tmp_path, "events", "--config", str(config), env=env)
    assert "pydantic" in modules and "tls_key_file" in out, out  # validated again, and refused by name


def test_a_kept_validation_follows_the_defaults_that_follow_the_environment(tmp_path: Path) -> None:
    """The state dir's default follows XDG_STATE_HOME: another one is another key, never the kept state dir."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    config = tmp_path / "config.toml"
    config.write_text('floor = "9GiB"\n')
    for home in ("one", "two"):
        env = {"XDG_RUNTIME_DIR": str(run), "XDG_STATE_HOME": str(tmp_path / home)}
        modules, out = loaded(tmp_path, "events", "--config", str(config), env=env)
        assert "pydantic" in modules, (home, out)  # validated: another state dir than the kept one
        kept = json.loads((run / "sparkwatch" / "validated.json").read_text())["wire"]["state_dir"]
        assert kept == str(tmp_path / home / "sparkwatch")
