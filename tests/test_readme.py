"""The README's first command, as a new owner types it: it installs sparkwatch and shows what the guard would kill,
and starts no armed killer; and its advice on the pressure tests is what pytest does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")


def two_commands_section() -> str:
    return README.split("## Two commands", 1)[1].split("\n## ", 1)[0]


def first_command() -> str:
    blocks: list[str] = re.findall(r"```sh\n(.*?)```", two_commands_section(), re.DOTALL)
    assert len(blocks) == 2, "the section keeps its two commands"
    return blocks[0].strip()


def test_the_first_command_only_looks_and_dry_run_is_offered() -> None:
    command = first_command()
    assert command.endswith("sparkwatch engines"), command
    assert "sparkwatch run" not in command
    assert "sparkwatch run --dry-run" in two_commands_section()


@pytest.mark.slow
def test_the_first_command_works_as_written(tmp_path: Path) -> None:
    """In a copy of this checkout, exactly as written: a venv, `pip install .`, then `sparkwatch engines`."""
    clone = tmp_path / "sparkwatch"
    ignore = shutil.ignore_patterns(".venv*", ".git", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "build")
    shutil.copytree(REPO, clone, ignore=ignore)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARKWATCH_", "VIRTUAL_ENV", "PYTHONPATH"))}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    res = subprocess.run(
        ["bash", "-c", first_command()], cwd=clone, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    # What `sparkwatch engines` says on any box: the trees and their kill order, or that there are none.
    assert "kill order" in res.stdout or res.stdout.strip() == "no engine processes", res.stdout


def test_deselecting_the_pressure_tests_as_the_readme_says() -> None:
    assert '-m "not pressure"' in README
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not pressure", "tests/test_guard_pressure.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "deselected" in res.stdout and "::" not in res.stdout, res.stdout
    policy = (REPO / "tests" / "test_kill_policy.py").read_text(encoding="utf-8")
    pressure = (REPO / "tests" / "test_guard_pressure.py").read_text(encoding="utf-8")
    found = re.findall(r"floor_or_skip\((\d+) \* GiB\)|want_bytes: int = (\d+) \* GiB", policy)
    wants = {int(a or b) for a, b in found}
    wants |= {int(n) for n in re.findall(r"available < (\d+) \* GiB", pressure)}
    low, high = re.search(r"want\s+(\d+)-(\d+) GiB", README).groups()  # type: ignore[union-attr]
    assert min(wants) == int(low) and max(wants) == int(high), (wants, low, high)


def test_the_troubleshooting_guide_is_linked_and_its_links_resolve() -> None:
    assert "(docs/troubleshooting.md)" in README
    guide = REPO / "docs" / "troubleshooting.md"
    text = guide.read_text(encoding="utf-8")
    for heading in ("## My engine died: why?", "## The box wedged anyway", "## Alongside earlyoom or systemd-oomd?"):
        assert heading in text, heading
    wedge = text[text.index("## The box wedged anyway") : text.index("## Alongside earlyoom")]
    assert "sparkwatch postmortem" in wedge and "coming" not in wedge  # the command that reads the previous boot
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith("http"):
            assert (guide.parent / target).exists(), target
