"""Test helpers shared by the test modules."""

from __future__ import annotations

import os
import shutil

import pytest


def tools_required() -> bool:
    return os.environ.get("SPARKWATCH_REQUIRE_TOOLS") == "1"


def require_tool(name: str) -> str:
    """The path of a real tool, else skip (or fail when SPARKWATCH_REQUIRE_TOOLS=1, as CI sets it)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed"
        if tools_required():
            pytest.fail(f"{message} (SPARKWATCH_REQUIRE_TOOLS=1)")
        pytest.skip(message)
    return path


def require(condition: bool, reason: str) -> None:
    """Skip unless `condition`; a failure instead when SPARKWATCH_REQUIRE_TOOLS=1."""
    if condition:
        return
    if tools_required():
        pytest.fail(f"{reason} (SPARKWATCH_REQUIRE_TOOLS=1)")
    pytest.skip(reason)
