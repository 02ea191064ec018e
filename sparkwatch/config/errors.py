"""What every config module shares and none owns: the error a mistake becomes, and the environment's prefixes.

A leaf (stdlib only, imports nothing of sparkwatch): config.schema and config.settings both import it, so the schema
no longer imports the loader that imports it lazily (the schema ↔ settings cycle the lazy-pydantic trick made).
"""

from __future__ import annotations

ENV_PREFIX = "SPARKWATCH_"
# Names under this prefix belong to the test suite (SPARKWATCH_TEST_REQUIRE_TOOLS), not to the daemon.
TEST_ENV_PREFIX = ENV_PREFIX + "TEST_"


class ConfigError(Exception):
    """A configuration mistake, already phrased for a human in one line."""
