"""Real tools for tests: skip when missing, fail when CI demands them (SPARKWATCH_REQUIRE_TOOLS=1)."""

from __future__ import annotations

import os
import shutil

import pytest


def tools_required() -> bool:
    return os.environ.get("SPARKWATCH_REQUIRE_TOOLS") == "1"


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        reason = f"{name} is not installed"
        if tools_required():
            pytest.fail(f"{reason} (SPARKWATCH_REQUIRE_TOOLS=1)")
        pytest.skip(reason)
    return path


def missing(reason: str) -> None:
    """Skip (or fail under SPARKWATCH_REQUIRE_TOOLS=1) for something other than a missing executable."""
    if tools_required():
        pytest.fail(f"{reason} (SPARKWATCH_REQUIRE_TOOLS=1)")
    pytest.skip(reason)
