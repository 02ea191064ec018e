"""A stand-in telemetry process that floods the guard with valid `tel` messages until it is killed.

Usage: flood_telemetry.py --channel-fd N [...]  (the guard's telemetry command line; the rest is ignored)

What a bug in telemetry (a report in a tight loop) would do: every datagram is a well-formed TelMsg of a few KiB,
sent as fast as the socket takes them (the send blocks once the guard's buffer is full, so this is exactly as fast as
the guard lets it be). It never reads, so it never answers a reload either.
"""

from __future__ import annotations

import argparse
import socket
import time

from sparkwatch.common.messages import TelMsg, encode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--channel-fd", type=int, required=True)
    args, _rest = parser.parse_known_args()
    sock = socket.socket(fileno=args.channel_fd)
    sock.setblocking(True)
    pids = {100_000 + i: (i + 1) << 20 for i in range(200)}  # ~5 KiB a datagram
    while True:
        sock.send(encode(TelMsg(engines=1, compile_jobs=0, gpu_ts=time.time(), gpu_pids=pids)))


if __name__ == "__main__":
    main()
