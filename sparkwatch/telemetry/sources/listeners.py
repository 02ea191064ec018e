"""Which listening TCP sockets a set of processes owns: the serving probe talks only to those (telemetry/probewatch.py).

A port is the engine's when a socket in LISTEN state on it has an inode that one of the engine's processes holds open
(/proc/PID/fd/* -> `socket:[INODE]`). The listening sockets are asked of the kernel through sock_diag when the
engine's network namespace is the daemon's own, else read from /proc/PID/net/tcp and tcp6. Anything else on that
port (another user's server, a process that took the port after the engine died) is never probed.

Cost: one listdir and a readlink per open fd of each member, and two sock_diag dumps of the listening sockets (or
two reads of the root's net tables); once per probe (every 30 s while serving). An unreadable fd directory (another
user's process, hidepid) owns nothing we can prove: no probe.

Where to dial it (`dial_of`). In our own network namespace: the socket's own address (a wildcard on loopback). In
another one (an engine in a Docker bridge-network container): never our loopback, which is another namespace's
socket (another engine, or nothing, on the same port number: a published `-p 8001:8000` is not 8000 here), but the
engine's own IPv4 address in its namespace, at its own port: the namespace's local addresses from
/proc/PID/net/fib_trie, one that our routing table (/proc/self/net/route) reaches on a link of ours (a bridge: no
gateway, not loopback, not one of our own addresses), and on which no other process of that namespace listens on
the same port. Once connected, the connection must be seen landing there (`landed`: a row of the engine's own
/proc/PID/net/tcp with that address and port and our socket's address and port on the other end) before a byte is
sent. An engine that listens only on loopback inside its namespace, or whose addresses no link of ours reaches, is
`Unreachable` with the reason: not probed, never failed (core.engines.serving).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from sparkwatch.common.sources.procs import same_netns

_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN
_ESTABLISHED = "01"  # TCP_ESTABLISHED
_SYN_RECV = "03"  # TCP_SYN_RECV: a connection the listener has not completed yet (a request sock)
FDS_MAX = 65536  # open fds looked at per process: an engine holds hundreds
LISTENERS_MAX = 4096  # LISTEN rows read per table


@dataclass(frozen=True, slots=True)
class Listener:
    address: str  # as the kernel has it: "0.0.0.0", "127.0.0.1", "::", "::1"
    port: int
    inode: int
    uid: int = -1  # the user whose process made the socket, as the kernel recorded it (sock_i_uid): unforgeable
    # an established connection's other end (parse_tcp_table of a state other than LISTEN; a listener has none)
    remote: str = ""
    remote_port: int = 0

    @property
    def connect_host(self) -> str:
        """Where to connect to reach it from this host: a wildcard is reached on loopback."""
        if self.address == "0.0.0.0":
            return "127.0.0.1"
        if self.address == "::":
            return "::1"
        return self.address


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # IPv6: four 32-bit words, each in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped) if v6.ipv4_mapped is not None else str(v6)


def parse_tcp_table(text: str, state: str = _LISTEN) -> list[Listener]:
    """The rows of a /proc/net/tcp or tcp6 table in `state` (LISTEN), each by its local address and port (and, for a
    connection, its other end's)."""
    out: list[Listener] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != state:
            continue
        addr, _colon, port_hex = fields[1].partition(":")
        try:
            row = Listener(_address(addr), int(port_hex, 16), int(fields[9]), int(fields[7]))
            if state != _LISTEN:
                remote, _colon, remote_port = fields[2].partition(":")
                row = replace(row, remote=_address(remote), remote_port=int(remote_port, 16))
            out.append(row)
        except ValueError:
            continue
        if len(out) >= LISTENERS_MAX:
            break
    return out


# sock_diag (linux/inet_diag.h, linux/sock_diag.h): the kernel's listening sockets asked for by state, without the
# walk of every socket that generating /proc/PID/net/tcp costs (4 ms a table on this VM, 136 sockets: 8 of the
# probe's 9.8 ms; this asks for LISTEN only and walks only the listening hash).
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_LISTEN = 10
_DIAG_MSG = struct.Struct("=BBBB2s2s16s16sI8sIIIII")  # inet_diag_msg: 72 bytes
DIAG_REPLY_MAX_BYTES = 4 << 20  # a few thousand listeners at most


def _diag_listeners(family: int) -> list[Listener]:
    """The LISTEN TCP sockets of this process's network namespace in `family`, through sock_diag. Raises OSError."""
    req = struct.pack("=BBBBI48s", family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN, b"")
    hdr = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST_DUMP, 1, 0)
    out: list[Listener] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(hdr + req, (0, 0))
        got = 0
        while got < DIAG_REPLY_MAX_BYTES:
            data = nl.recv(65536)
            got += len(data)
            at = 0
            while at + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, at)
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR or length < 16:
                    raise OSError("sock_diag answered an error")
                if length >= 16 + _DIAG_MSG.size:
                    f = _DIAG_MSG.unpack_from(data, at + 16)
                    port = int.from_bytes(f[4], "big")
                    ip = ipaddress.ip_address(f[6][:4] if family == socket.AF_INET else f[6])
                    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
                    addr = str(mapped if mapped is not None else ip)
                    out.append(Listener(addr, port, f[14], f[13]))
                at += (length + 3) & ~3
            if not data:
                break
    return out


def listeners(proc_root: Path | str, pid: int) -> list[Listener]:
    """The listening TCP sockets of `pid`'s network namespace (IPv4 and IPv6): through sock_diag when it is ours
    (the daemon's own namespace, the common case), else from its /proc/PID/net tables."""
    if same_netns(proc_root, pid) and str(proc_root) == "/proc":
        try:
            return _diag_listeners(socket.AF_INET) + _diag_listeners(socket.AF_INET6)
        except OSError:
            pass  # no sock_diag here (a seccomp filter, an old kernel): the tables say the same, slower
    return table_listeners(proc_root, pid)


def table_listeners(proc_root: Path | str, pid: int, state: str = _LISTEN) -> list[Listener]:
    """The listening (or `state`) TCP sockets of `pid`'s network namespace, from /proc/PID/net/tcp and tcp6."""
    out: list[Listener] = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc_root}/{pid}/net/{table}", encoding="ascii", errors="replace") as fh:
                out.extend(parse_tcp_table(fh.read(1 << 22), state))
        except OSError:
            continue
    return out


def connected_addresses(proc_root: Path | str, pid: int, port: int) -> frozenset[str]:
    """The local addresses of the established TCP connections that `pid` holds on its local `port`: where its
    clients reached it (an rpc-server's, as the llama.cpp head names it: core.kill.mpgroup)."""
    rows = [r for r in table_listeners(proc_root, pid, _ESTABLISHED) if r.port == port]
    if not rows:
        return frozenset()
    inodes = socket_inodes(proc_root, [pid])
    return frozenset(r.address for r in rows if r.inode in inodes)


def connected_to(proc_root: Path | str, pid: int, host: str, port: int) -> bool:
    """Whether `pid` holds an established TCP connection to `host`:`port` (a literal address): a Ray driver's to its
    cluster's GCS, which it keeps open while it runs (telemetry.raywatch). Its network namespace's tables, then its
    own fds: a connection of another process there is not its."""
    try:
        want = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = want.ipv4_mapped if isinstance(want, ipaddress.IPv6Address) else None
    want_text = str(mapped if mapped is not None else want)
    rows = table_listeners(proc_root, pid, _ESTABLISHED)
    inodes = {r.inode for r in rows if r.remote_port == port and r.remote == want_text}
    return bool(inodes) and not inodes.isdisjoint(socket_inodes(proc_root, [pid]))


def socket_inodes(proc_root: Path | str, pids: Iterable[int]) -> set[int]:
    """The socket inodes these processes hold open (what each can read; an unreadable one adds nothing)."""
    out: set[int] = set()
    for pid in pids:
        base = f"{proc_root}/{pid}/fd"
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names[:FDS_MAX]:
            try:
                target = os.readlink(f"{base}/{name}")
            except OSError:
                continue
            if target.startswith("socket:["):
                try:
                    out.add(int(target[8:-1]))
                except ValueError:
                    continue
    return out


def owned_listener(proc_root: Path | str, root_pid: int, pids: Iterable[int], port: int) -> Listener | None:
    """The listening socket on `port` that one of `pids` holds open, or None."""
    return _owned(proc_root, pids, [lst for lst in listeners(proc_root, root_pid) if lst.port == port])


def _owned(proc_root: Path | str, pids: Iterable[int], candidates: list[Listener]) -> Listener | None:
    if not candidates:
        return None
    inodes = socket_inodes(proc_root, pids)
    for lst in candidates:
        if lst.inode in inodes:
            return lst
    return None


# --- where to dial it: our namespace, or the engine's own (a container's), never a guess

FIB_MAX_BYTES = 1 << 20  # a namespace's fib_trie: a few KiB (a router with a full table is no engine's namespace)
_RTF_UP, _RTF_GATEWAY, _RTF_REJECT = 0x1, 0x2, 0x200  # include/uapi/linux/route.h
LANDED_WAIT_S = 0.25  # how long the engine's namespace gets to show our connection (it is there when connect returns)


@dataclass(frozen=True, slots=True)
class Dial:
    """Where the serving probe connects to reach a listening socket the engine owns."""

    listener: Listener
    host: str
    port: int
    netns_pid: int = 0  # not 0: the engine's network namespace is not ours; the connection must land in this pid's

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Unreachable:
    """The engine owns a listening socket on its port that cannot be reached from here for certain: not probed."""

    reason: str


def parse_fib_local(text: str) -> list[str]:
    """The local IPv4 addresses (`/32 host LOCAL` leaves) of a /proc/PID/net/fib_trie, loopback included, once each."""
    out: list[str] = []
    leaf = ""
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] in ("|--", "+--"):
            leaf = words[1] if words[0] == "|--" else ""
        elif words[:3] == ["/32", "host", "LOCAL"] and leaf and leaf not in out:
            out.append(leaf)
    return out


def on_link(route_text: str, address: str) -> str | None:
    """The interface through which a /proc/net/route table reaches `address` directly (its best route: the longest
    prefix, then the lowest metric), or None: no route, a route through a gateway, a reject route, or loopback."""
    want = int(ipaddress.IPv4Address(address))
    best: tuple[int, int, str, int] | None = None  # (prefix length, -metric, interface, flags)
    for line in route_text.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        try:
            dest = int.from_bytes(bytes.fromhex(f[1]), "little")
            flags, metric = int(f[3], 16), int(f[6])
            mask = int.from_bytes(bytes.fromhex(f[7]), "little")
        except ValueError:
            continue
        if not flags & _RTF_UP or want & mask != dest & mask:
            continue
        rank = (bin(mask).count("1"), -metric, f[0], flags)
        if best is None or rank[:2] > best[:2]:
            best = rank
    if best is None or best[3] & (_RTF_GATEWAY | _RTF_REJECT) or best[2] == "lo":
        return None
    return best[2]


def _read(path: str, limit: int = FIB_MAX_BYTES) -> str:
    with open(path, encoding="ascii", errors="replace") as fh:
        return fh.read(limit)


def dial_of(proc_root: Path | str, root_pid: int, pids: Iterable[int], port: int) -> Dial | Unreachable | None:
    """Where to connect to the listening socket on `port` that one of `pids` holds open: None when they own none
    (not listening), Unreachable when it cannot be reached from here for certain (the reason in words)."""
    on_port = [lst for lst in listeners(proc_root, root_pid) if lst.port == port]
    owned = _owned(proc_root, pids, on_port)
    if owned is None:
        return None
    if same_netns(proc_root, root_pid):
        return Dial(owned, owned.connect_host, owned.port)
    where = f"{owned.address}:{port}" if ":" not in owned.address else f"[{owned.address}]:{port}"
    ip = ipaddress.ip_address(owned.address)
    if ip.is_loopback:
        return Unreachable(
            f"it listens on {where} in its own network namespace (a container's), out of the host's reach"
        )
    if owned.address == "::" or ip.version == 4:
        try:
            ours = parse_fib_local(_read(f"{proc_root}/self/net/fib_trie"))
            routes = _read(f"{proc_root}/self/net/route")
            theirs = [owned.address] if ip.version == 4 and not ip.is_unspecified else []
            if not theirs:
                theirs = parse_fib_local(_read(f"{proc_root}/{root_pid}/net/fib_trie"))
        except OSError as exc:
            return Unreachable(f"its network namespace's addresses could not be read ({exc.strerror or exc})")
    else:
        return Unreachable(f"it listens on {where} (IPv6) in its own network namespace: not probed there")
    others = [lst for lst in on_port if lst.inode != owned.inode]
    why: list[str] = []
    for address in theirs:
        if ipaddress.IPv4Address(address).is_loopback:
            continue
        if any(lst.address in (address, "0.0.0.0", "::") for lst in others):
            why.append(f"another socket listens on {address}:{port} there")
        elif address in ours:
            why.append(f"{address} is also one of the host's own addresses")
        elif on_link(routes, address) is None:
            why.append(f"no route from the host reaches {address} on a link of its own")
        else:
            return Dial(owned, address, port, root_pid)
    detail = "; ".join(why) if why else "its network namespace has no IPv4 address but loopback"
    return Unreachable(f"it listens on {where} in its own network namespace (a container's): {detail}")


def _connection_rows(proc_root: Path | str, pid: int, tables: tuple[str, ...]) -> list[Listener]:
    """The established and half-open TCP connections of `pid`'s network namespace in `tables` (no cap: a busy engine
    may hold thousands and ours must not be cut off)."""
    out: list[Listener] = []
    for table in tables:
        try:
            text = _read(f"{proc_root}/{pid}/net/{table}", 1 << 26)
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split(maxsplit=4)
            if len(fields) < 4 or fields[3] not in (_ESTABLISHED, _SYN_RECV):
                continue
            local, _c, lport = fields[1].partition(":")
            remote, _c, rport = fields[2].partition(":")
            try:
                out.append(Listener(_address(local), int(lport, 16), 0, -1, _address(remote), int(rport, 16)))
            except ValueError:
                continue
    return out


def landed(
    proc_root: Path | str, pid: int, dial: tuple[str, int], ours: tuple[str, int], *, v6_listener: bool = False
) -> bool:
    """Whether our connection from `ours` (our socket's address and port) to `dial` is one of `pid`'s network
    namespace's connections: it reached that very namespace, where the engine owns the only listener on that
    address and port (dial_of). `v6_listener`: the engine's socket is IPv6 (a dual-stack `::` takes IPv4 too, and its
    connections are in tcp6); else only tcp is read (each read walks the kernel's whole table: ~4 ms on a busy host)."""
    tables = ("tcp6",) if v6_listener else ("tcp",)
    deadline = time.monotonic() + LANDED_WAIT_S
    while True:
        for row in _connection_rows(proc_root, pid, tables):
            if (row.address, row.port, row.remote, row.remote_port) == (*dial, *ours):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
