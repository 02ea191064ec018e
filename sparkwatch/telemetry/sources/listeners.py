"""Which listening TCP sockets a set of processes owns: the serving probe talks only to those (telemetry/serving.py).

A port is the engine's when a socket in LISTEN state on it (the root's network namespace: /proc/PID/net/tcp and
tcp6) has an inode that one of the engine's processes holds open (/proc/PID/fd/* -> `socket:[INODE]`). Anything else
on that port (another user's server, a process that took the port after the engine died) is never probed.

Cost: one listdir and a readlink per open fd of each member, and two small reads of the root's net tables; the probe
asks at most once per probe (every 30 s while serving). An unreadable fd directory (another user's process, hidepid)
owns nothing we can prove: no probe.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"  # include/net/tcp_states.h: TCP_LISTEN
FDS_MAX = 65536  # open fds looked at per process: an engine holds hundreds
LISTENERS_MAX = 4096  # LISTEN rows read per table


@dataclass(frozen=True, slots=True)
class Listener:
    address: str  # as the kernel has it: "0.0.0.0", "127.0.0.1", "::", "::1"
    port: int
    inode: int

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


def parse_tcp_table(text: str) -> list[Listener]:
    """The LISTEN rows of a /proc/net/tcp or tcp6 table."""
    out: list[Listener] = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        addr, _colon, port_hex = fields[1].partition(":")
        try:
            out.append(Listener(_address(addr), int(port_hex, 16), int(fields[9])))
        except ValueError:
            continue
        if len(out) >= LISTENERS_MAX:
            break
    return out


def listeners(proc_root: Path | str, pid: int) -> list[Listener]:
    """The listening TCP sockets of `pid`'s network namespace (IPv4 and IPv6)."""
    out: list[Listener] = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc_root}/{pid}/net/{table}", encoding="ascii", errors="replace") as fh:
                out.extend(parse_tcp_table(fh.read(1 << 22)))
        except OSError:
            continue
    return out


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
    candidates = [lst for lst in listeners(proc_root, root_pid) if lst.port == port]
    if not candidates:
        return None
    inodes = socket_inodes(proc_root, pids)
    for lst in candidates:
        if lst.inode in inodes:
            return lst
    return None
