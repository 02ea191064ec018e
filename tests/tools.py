"""Real tools the tests use: found, skipped with a reason, or (SPARKWATCH_REQUIRE_TOOLS=1, as in CI) a failure."""

from __future__ import annotations

import os
import shutil

import pytest


def require_tool(name: str) -> str:
    """The path of `name` on PATH (or under /usr/sbin, /sbin); skip the test when it is missing, fail in CI."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin")
    if path:
        return path
    message = f"{name} is not installed (Debian: see the apt list in .ci/run)"
    if os.environ.get("SPARKWATCH_REQUIRE_TOOLS") == "1":
        pytest.fail(message + "; SPARKWATCH_REQUIRE_TOOLS=1 requires it")
    pytest.skip(message)
