"""The pair's shared key for tests (common.peerproof): a key file as `sparkwatch peer-key write` makes it, and the
environment and settings that name it."""

from __future__ import annotations

from pathlib import Path

from sparkwatch.common.peerproof import read_key, write_key


def key_file(directory: Path, name: str = "peer.key") -> Path:
    """A new key in `directory` (0600, this test's user), made once: both agents of a pair name the same file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    if not path.exists():
        write_key(path)
    return path


def key_of(path: Path) -> bytes:
    return read_key(path)


def key_env(path: Path) -> dict[str, str]:
    return {"SPARKWATCH_PEER_KEY_FILE": str(path)}
