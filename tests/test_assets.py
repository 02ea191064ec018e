"""What a `pip install` user gets: the dashboard, provisioning, rules, examples and an example config in the wheel,
written out by `sparkwatch assets write DIR`; and the LICENSE the metadata names.

The wheel test is the real thing: `pip wheel .`, a fresh venv, `pip install` of that wheel (its dependencies come from
the configured index), the command run from that venv, the files compared byte for byte with the repository's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sparkwatch.cli.assets import ASSETS
from sparkwatch.config.settings import Settings

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "sparkwatch" / "data"
EXAMPLE = DATA / "config.example.toml"


def cli(*args: str, env: dict[str, str] | None = None, exe: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [exe, *args] if exe else [sys.executable, "-m", "sparkwatch", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    return env


def test_the_asset_list_is_exactly_the_package_data() -> None:
    on_disk = sorted(str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file())
    assert on_disk == sorted(rel for rel, _ in ASSETS)


def test_the_example_config_names_every_key() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    named = set(re.findall(r"^# ([a-z_]+) = ", text, re.MULTILINE))
    assert named == set(Settings.model_fields), set(Settings.model_fields) ^ named


def test_the_example_configs_defaults_are_the_defaults(tmp_path: Path) -> None:
    """Uncomment every line that gives a default (not the ones marked example): check-config accepts it, and the
    effective settings are those of no config at all."""
    lines = []
    for line in EXAMPLE.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^# ([a-z_]+ = [^#]*)(?:#\s*(.*))?$", line)
        if m and not (m.group(2) or "").startswith("example"):
            lines.append(m.group(1))
    assert len(lines) >= 30
    config = tmp_path / "config.toml"
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    env = clean_env(tmp_path)
    with_file = cli("check-config", "--json", "--config", str(config), env=env)
    assert with_file.returncode == 0, with_file.stderr
    without = cli("check-config", "--json", env=env)
    assert without.returncode == 0, without.stderr
    assert json.loads(with_file.stdout) == json.loads(without.stdout)


def test_write_keeps_an_edited_file_unless_forced(tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    out = tmp_path / "assets"
    first = cli("assets", "write", str(out), env=env)
    assert first.returncode == 0, first.stderr
    assert cli("assets", "write", str(out), env=env).returncode == 0  # the same files again: nothing to keep
    edited = out / "grafana" / "sparkwatch-alerts.yml"
    edited.write_text("# mine\n", encoding="utf-8")
    refused = cli("assets", "write", str(out), env=env)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "sparkwatch-alerts.yml" in refused.stderr and "--force" in refused.stderr
    assert edited.read_text(encoding="utf-8") == "# mine\n"
    assert cli("assets", "write", "--force", str(out), env=env).returncode == 0
    assert edited.read_bytes() == (DATA / "grafana" / "sparkwatch-alerts.yml").read_bytes()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    assert cli("assets", "write", str(not_a_dir), env=env).returncode == 2


def test_the_license_is_the_full_apache_2_text() -> None:
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert len(text.splitlines()) == 202


@pytest.mark.slow
def test_the_wheel_ships_the_assets_and_its_command_writes_them(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "-q", "-w", str(wheels)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("sparkwatch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    for rel, _ in ASSETS:
        assert f"sparkwatch/data/{rel}" in names, rel
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    out = tmp_path / "out"
    env = clean_env(tmp_path)
    env.pop("PYTHONPATH", None)
    res = cli("assets", "write", str(out), env=env, exe=str(venv / "bin" / "sparkwatch"))
    assert res.returncode == 0, res.stderr
    for rel, _ in ASSETS:
        assert (out / rel).read_bytes() == (DATA / rel).read_bytes(), rel
    listed = cli("assets", "list", env=env, exe=str(venv / "bin" / "sparkwatch"))
    assert listed.returncode == 0 and "sparkwatch-node.json" in listed.stdout
    # It ran the installed copy, not this checkout.
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sparkwatch; print(sparkwatch.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert str(venv) in where
