"""require_tool until tests/conftest.py holds the shared one (same contract)."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    """Path of a real tool the test needs. Skips when missing, fails instead under SPARKWATCH_REQUIRE_TOOLS=1 (CI)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (apt packages are listed in .ci/run)"
        if os.environ.get("SPARKWATCH_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path
