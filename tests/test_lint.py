"""ruff and mypy (strict) are part of the test suite, so the README's one test command checks them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_is_clean() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "sparkwatch", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_core_stays_pure() -> None:
    """The banned-api rule must really fire inside sparkwatch/core (a rule that never fires checks nothing)."""
    probe = ROOT / "sparkwatch" / "core" / "_probe_impure.py"
    probe.write_text("import os\n\nCWD = os.getcwd()\n")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", str(probe)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        probe.unlink()
    assert out.returncode == 1 and "TID251" in out.stdout, out.stdout


def test_mypy_strict_is_clean() -> None:
    out = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
