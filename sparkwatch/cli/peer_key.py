"""`sparkwatch peer-key write PATH [--force]`: the pair's shared key (common.peerproof; docs/multinode.md).

Run it on one Spark, copy the file to the other (`scp`, then `chmod 600` there if the copy loosened it), and set
`peer_key_file` to it on both: each agent's peer document is then proven by the key, and a peer's word moves the
guard. The file is created 0600, never through a symlink; an existing one is kept unless --force. The key is never
printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "peer-key",
        help="write the shared key that proves the peers' documents",
        description="Write a new random key (32 bytes, one line of hex) to PATH, mode 0600, for `peer_key_file`: "
        "run it on one Spark, copy the file to the other, set peer_key_file on both (docs/multinode.md). An "
        "existing file is kept unless --force. The key is never printed.",
    )
    p.add_argument("action", choices=["write"], help="write: make a new key")
    p.add_argument("path", type=Path, metavar="PATH", help="the key's file (e.g. /etc/sparkwatch/peer.key)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.common.peerproof import write_key

    path: Path = args.path
    try:
        write_key(path, force=args.force)
    except FileExistsError:
        print(f"sparkwatch peer-key: {path} exists; keeping it (--force replaces it)", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"sparkwatch peer-key: {path}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"sparkwatch peer-key: wrote a new key to {path} (0600). Copy it to the other node (scp {path} "
          f"OTHER:{path}) and set peer_key_file = \"{path}\" on both (docs/multinode.md).")  # fmt: skip
    return 0
