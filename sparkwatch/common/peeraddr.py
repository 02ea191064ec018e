"""A configured peer's address (`peers`): the one parser, for the config's validation and the peer watch."""

from __future__ import annotations

import urllib.parse


def parse_peer(text: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a configured peer: "spark-b:9847", "http://spark-b:9847", "https://10.0.0.2:9847".
    Raises ValueError saying what is wrong (the config names the key)."""
    url = text if "://" in text else f"http://{text}"
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{text!r}: only http:// or https://")
    if parts.path not in ("", "/") or parts.query or parts.username or parts.password:
        raise ValueError(f"{text!r}: host:port only (no path, query or credentials)")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text!r}: not a port") from None
    if not parts.hostname or port is None:
        raise ValueError(f"{text!r}: needs a host and a port")
    return parts.scheme, parts.hostname, port
