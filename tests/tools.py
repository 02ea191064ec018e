"""require_tool: a missing real tool skips the test, unless SPARKWATCH_REQUIRE_TOOLS=1 (CI) makes it fail."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"{name} not installed")
    assert path is not None
    return path


def missing(reason: str) -> None:
    """Skip for a reason this machine cannot help, or fail when CI demands the real thing."""
    if os.environ.get("SPARKWATCH_REQUIRE_TOOLS") == "1":
        pytest.fail(f"required: {reason}")
    pytest.skip(reason)
