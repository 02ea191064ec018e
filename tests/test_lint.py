"""ruff and mypy (strict) are part of the test suite, so the README's one test command checks them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def lint_imports(probes: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """import-linter over the tree with probe modules (path under sparkwatch/ -> source) in place, removed after;
    exit 1 is expected: a contract that never fires checks nothing."""
    paths = [ROOT / "sparkwatch" / rel for rel in probes]
    try:
        for path, text in zip(paths, probes.values(), strict=True):
            path.write_text(text)
        out = subprocess.run(
            [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    assert out.returncode == 1, out.stdout
    return out


def test_guard_contract_fires_on_pydantic() -> None:
    """import-linter must really refuse pydantic anywhere under sparkwatch/guard/ (scripts/lint runs the contracts)."""
    out = lint_imports({"guard/_probe_heavy.py": "import pydantic\n\nVERSION = pydantic.VERSION\n"})
    assert "sparkwatch.guard is not allowed to import pydantic" in out.stdout, out.stdout
    assert "sparkwatch.guard._probe_heavy -> pydantic" in out.stdout, out.stdout


def test_guard_contract_fires_through_common() -> None:
    """Transitively too: a common module that imports telemetry code breaks the guard's contract and common's."""
    out = lint_imports(
        {
            "common/_probe_reach.py": "from sparkwatch.telemetry import outbox\n\nOUTBOX = outbox\n",
            "guard/_probe_user.py": "from sparkwatch.common import _probe_reach\n\nREACH = _probe_reach\n",
        }
    )
    assert "sparkwatch.guard is not allowed to import sparkwatch.telemetry" in out.stdout, out.stdout
    assert "sparkwatch.common is not allowed to import sparkwatch.telemetry" in out.stdout, out.stdout


def test_telemetry_may_not_import_the_guard() -> None:
    """The independence contract fires: telemetry reaching into the guard's code (as it once imported the kill loop
    for GuardStats) breaks "Guard and telemetry share only common and core"."""
    out = lint_imports({"telemetry/_probe_guard.py": "from sparkwatch.guard import killer\n\nKILLER = killer\n"})
    assert "Guard and telemetry share only common and core BROKEN" in out.stdout, out.stdout
    assert "sparkwatch.telemetry._probe_guard -> sparkwatch.guard.killer" in out.stdout, out.stdout
