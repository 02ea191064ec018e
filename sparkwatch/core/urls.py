"""A URL as sparkwatch shows it: scheme://host[:port], never the path, query or userinfo.

Apart from core.redact so that the guard process, which redacts every line it logs, never loads urllib: only the
config and the outbox (telemetry) show the webhook's URL.
"""

from __future__ import annotations

import urllib.parse


def redact_url(url: str) -> str:
    """scheme://host[:port] only: a Slack-style webhook URL carries its secret in the path (and userinfo may too)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{port}" if port else "")
