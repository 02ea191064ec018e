"""How a peer proves its document (issue 37; docs/multinode.md, "Authenticating the pair"): the shared key, its
file, and the proof the agent answers with. Standard library only: the config's validation, the telemetry process
(both ends: exporter.server signs, telemetry.peerwatch checks) and `sparkwatch peer-key` use the one owner here.

The key (`peer_key_file`) is one line of hex, 32 random bytes as `sparkwatch peer-key write PATH` writes it, the same
file on every node of the pair. Its file must be a regular file, never a symlink, owned by the agent's user or root
and readable by nobody else: a key another user could read or replace proves nothing. The key never leaves the
process: no log, event, metric or answer carries it (nor anything derived from it but a proof over one answer).

Each read of a peer sends a fresh random nonce (`GET /peer/v1/state?nonce=HEX`). An agent holding the key answers
its document with three headers:
- `X-Sparkwatch-Node`: its node's name (percent-encoded), the `node` its document names;
- `X-Sparkwatch-Time`: its clock, whole seconds since the epoch;
- `X-Sparkwatch-Proof`: HMAC-SHA256 under the key of the domain tag, that node name, the nonce, the time and the
  SHA-256 of the body.
The reader holds the proof to its own nonce (a proof recorded earlier answers another nonce: replays fail), the
time within MAX_SKEW_S of its own clock, and the node to the document's; compared with hmac.compare_digest. A
document that fails is not the peer's, whoever answered on its port (telemetry.peerwatch).

hashlib and hmac (libcrypto: part of the ~8 MiB that telemetry spares where nothing needs it,
tests/test_telemetry_imports.py) are imported only where a key is: the nonce is os.urandom's.
"""

from __future__ import annotations

import errno
import os
import stat
import time
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

KEY_BYTES = 32  # what `peer-key write` makes: 256 bits
KEY_MIN_BYTES = 16  # a shorter key is refused (a typo, a truncated copy)
KEY_FILE_MAX_BYTES = 4096
NONCE_BYTES = 16
# A proof dated further than this from the reader's clock is refused. The nonce already refuses a replay; the time
# bounds how long a proof could be held back within one read (never longer than the read's own second) and catches
# two clocks that are far apart (NTP off on one Spark). Two minutes takes a node whose clock drifted without NTP
# for a day or two.
MAX_SKEW_S = 120.0
DOMAIN = b"sparkwatch-peer-state-v1"
NODE_HEADER = "X-Sparkwatch-Node"
TIME_HEADER = "X-Sparkwatch-Time"
PROOF_HEADER = "X-Sparkwatch-Proof"
NONCE_PARAM = "nonce"


class PeerKeyError(ValueError):
    """The key file is not one the agent may trust: one line saying why (the config names the key)."""


def read_key(path: Path, *, euid: int | None = None) -> bytes:
    """The key in `path`, or PeerKeyError naming what is wrong: not a regular file, a symlink, owned by another user
    (root and the reader's own uid are taken), readable or writable by its group or others, not hex, too short."""
    euid = os.geteuid() if euid is None else euid
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PeerKeyError(f"{path}: is a symlink; the key's file must be the file itself") from None
        raise PeerKeyError(f"{path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        _check_stat(path, st, euid)
        data = os.read(fd, KEY_FILE_MAX_BYTES + 1)
    finally:
        os.close(fd)
    return parse_key(path, data)


def check_key_file(path: Path) -> bytes | None:
    """The config's check of `peer_key_file`: PeerKeyError when the file is wrong; the key, or None when this user
    may not read it (root's key, read by a user's `launch` or `status`: that command's peers are display-only)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise PeerKeyError(f"{path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode):
        raise PeerKeyError(f"{path}: is a symlink; the key's file must be the file itself")
    euid = os.geteuid()
    _check_stat(path, st, euid)
    if st.st_uid != euid and euid != 0:
        return None  # root's, 0600: not ours to read
    return read_key(path)


def _check_stat(path: Path, st: os.stat_result, euid: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise PeerKeyError(f"{path}: is not a regular file")
    if st.st_uid not in (euid, 0):
        raise PeerKeyError(
            f"{path}: is owned by uid {st.st_uid}, not by this user (uid {euid}) or root: whoever owns it can "
            "change the key; refused"
        )
    if st.st_mode & 0o077:
        raise PeerKeyError(
            f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets its group or others read or change the key; "
            f"refused (chmod 600 {path})"
        )


def parse_key(path: Path, data: bytes) -> bytes:
    if len(data) > KEY_FILE_MAX_BYTES:
        raise PeerKeyError(f"{path}: larger than {KEY_FILE_MAX_BYTES} bytes: not a key `sparkwatch peer-key` wrote")
    try:
        key = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise PeerKeyError(f"{path}: not one line of hex (write one with `sparkwatch peer-key write PATH`)") from None
    if len(key) < KEY_MIN_BYTES:
        raise PeerKeyError(f"{path}: {len(key)} bytes of key, under {KEY_MIN_BYTES}: a truncated copy?")
    return key


def new_key_text() -> str:
    return os.urandom(KEY_BYTES).hex() + "\n"


def write_key(path: Path, *, force: bool = False) -> None:
    """A new key in `path`, 0600, created without following a symlink; an existing file is left alone unless
    `force` (then replaced whole: a rename over it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    target = path
    if force:
        target = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
    fd = os.open(target, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, new_key_text().encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    if force:
        os.rename(target, path)


def new_nonce() -> str:
    return os.urandom(NONCE_BYTES).hex()


def nonce_of(path: str) -> str | None:
    """The nonce a request's path carries, when it is one (hex, NONCE_BYTES): else None (an unsigned answer)."""
    _route, _sep, query = path.partition("?")
    if not query:
        return None
    values = urllib.parse.parse_qs(query, max_num_fields=4).get(NONCE_PARAM)
    if not values or len(values[0]) != 2 * NONCE_BYTES:
        return None
    try:
        bytes.fromhex(values[0])
    except ValueError:
        return None
    return values[0].lower()


def _mac(key: bytes, node: str, nonce: str, when: str, body: bytes) -> str:
    import hashlib  # noqa: PLC0415 - only where a key is configured (the module's docstring)
    import hmac  # noqa: PLC0415

    msg = b"\0".join((DOMAIN, node.encode("ascii"), nonce.encode("ascii"), when.encode("ascii")))
    return hmac.new(key, msg + b"\0" + hashlib.sha256(body).digest(), hashlib.sha256).hexdigest()


def prove(key: bytes, node: str, nonce: str, body: bytes, now: float | None = None) -> tuple[tuple[str, str], ...]:
    """The headers that prove `body` is this node's answer to `nonce`."""
    quoted = urllib.parse.quote(node, safe="")
    when = str(int(time.time() if now is None else now))
    return (
        (NODE_HEADER, quoted),
        (TIME_HEADER, when),
        (PROOF_HEADER, _mac(key, quoted, nonce, when, body)),
    )


class ProofError(ValueError):
    """Why an answer is not proven: one line, never the key or the proof."""


def check(key: bytes, nonce: str, body: bytes, headers: Mapping[str, str], now: float | None = None) -> str:
    """The node name an answer to `nonce` is proven for; ProofError otherwise. `headers`: lower-cased names."""
    proof = headers.get(PROOF_HEADER.lower())
    quoted = headers.get(NODE_HEADER.lower())
    when = headers.get(TIME_HEADER.lower())
    if proof is None or quoted is None or when is None:
        raise ProofError("no proof in its answer (peer_key_file unset on that node, or not sparkwatch)")
    if not quoted.isascii() or not when.isascii() or not when.isdigit() or len(when) > 12:
        raise ProofError("a proof of another shape")
    import hmac  # noqa: PLC0415 - loaded by _mac already

    expected = _mac(key, quoted, nonce, when, body)
    if not hmac.compare_digest(expected, proof.strip().lower()):
        raise ProofError("its proof does not check (another key, an answer to another read, or a changed body)")
    skew = (time.time() if now is None else now) - int(when)
    if abs(skew) > MAX_SKEW_S:
        ahead = "ahead of" if skew < 0 else "behind"
        raise ProofError(f"its proof's time is over {MAX_SKEW_S:g} s {ahead} this node's clock (NTP off on one?)")
    return urllib.parse.unquote(quoted)


def proof_kind(scheme: str, key: bool, mtls: bool) -> str | None:
    """How a peer of `scheme` is proven: "key" (peer_key_file), "mtls" (https:// under the pinned client CA, with this
    node's certificate: `mtls`), or None: display-only. The one rule, for the peer watch and the commands' line."""
    if key:
        return "key"
    if mtls and scheme == "https":
        return "mtls"
    return None


def peers_line(peers: list[str], key_file: Path | None, mtls: bool) -> tuple[str | None, bool]:
    """The one line `check-config`, `doctor` and `status` say of the peers, and whether any is display-only."""
    if not peers:
        return None, False
    from sparkwatch.common.peeraddr import parse_peer  # noqa: PLC0415

    kinds = [proof_kind(parse_peer(p)[0], key_file is not None, mtls) for p in peers]
    n = len(peers)
    if key_file is not None:
        return f"peers: {n} configured, proven by peer_key_file", False
    proven = sum(k is not None for k in kinds)
    if proven == n:
        return f"peers: {n} configured, proven by mutual TLS", False
    shown = "display-only" if not proven else f"{proven} proven by mutual TLS, {n - proven} display-only"
    return f"peers: {n} configured, {shown}: no peer_key_file (docs/multinode.md)", True


class PeerSettings(Protocol):
    peers: list[str]
    peer_key_file: Path | None
    tls_client_ca_file: Path | None
    tls_cert_file: Path | None


def mtls_of(settings: PeerSettings) -> bool:
    """Whether an https:// peer is proven by the channel: the client CA pinned, this node's certificate shown."""
    return settings.tls_client_ca_file is not None and settings.tls_cert_file is not None


def settings_line(settings: PeerSettings) -> tuple[str | None, bool]:
    """peers_line for these settings."""
    return peers_line(list(settings.peers), settings.peer_key_file, mtls_of(settings))
