"""Peer document bench (issue 37): what parsing a peer's document costs at its size cap, and what the proof adds to
one read of a peer.

1. Parse: telemetry.peerdoc.parse over documents built to the limits, CPU time of one call, median of --parses:
   - typical: what an agent serving two engines sends (16 kills, 2 raylets, 2 members);
   - at every cap, padded to MAX_DOC_BYTES with long kill summaries and raylet strings: the most an accepted
     document can cost;
   - one list past its cap, at MAX_DOC_BYTES (refused by count, after json.loads);
   - 13,000 budgets in 1 MiB (issue 37's document: refused by size now, 154 ms before);
   - one list of small numbers filling MAX_DOC_BYTES: the worst shape for json.loads (refused by count);
   - the same body again (PeerWatch compares the bytes and parses nothing).
2. Read: PeerWatch._read of a real MetricsServer on loopback serving the typical document, over plain HTTP: A
   without a key (today's read), B with peer_key_file (a nonce, the proof, its check). Rounds alternate A B A B,
   each the median of --reads reads; the table gives every round and the median of the round medians.

    /work/main/.venv/bin/python bench/peerdoc_bench.py --parses 50 --rounds 5 --reads 200 --out bench/RESULTS-peerdoc.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from tables import publish

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkwatch.common.peerproof import read_key, write_key  # noqa: E402
from sparkwatch.common.stats import RecentKill  # noqa: E402
from sparkwatch.config.settings import load_settings  # noqa: E402
from sparkwatch.core.model import MemInfo  # noqa: E402
from sparkwatch.telemetry import peerdoc  # noqa: E402
from sparkwatch.telemetry.peerwatch import PeerWatch  # noqa: E402

GiB = 1 << 30
NODE = "f" * 56
MEM = MemInfo(128 * GiB, 50 * GiB, 52 * GiB, 2 * GiB, 0, 0, 0)


def kills(n: int, pids: int, summary: str) -> tuple[peerdoc.PeerKill, ...]:
    recent = [RecentKill(1764824400.0 + i, "budget", summary, tuple(range(1000, 1000 + pids))) for i in range(n)]
    return peerdoc.kills_from_guard(recent)


def typical() -> bytes:
    groups = (peerdoc.PeerMember("10.0.0.1:29501", 1, 4242, 1000), peerdoc.PeerMember("10.0.0.1:29600", 1, 4343, 1000))
    said = kills(16, 12, "footprint 60.2 GiB (rss) over its budget 64.0 GiB (launch)")
    doc = json.loads(peerdoc.build("spark-b", (NODE,), MEM, (), said, groups=groups, floor_bytes=8 * GiB, cpus=20))
    raylet = {"node": "10.0.0.2", "pid": 777, "head": False, "gcs_address": "10.0.0.1:6379", "environment_read": True,
              "max_jobs": "4", "memory_monitor_refresh_ms": "0", "nccl_ib_gid_index": "3", "memlock_bytes": -1,
              "ninja": True, "nvcc": True, "roce_v2_gid_index": 3, "uid": 1000, "vllm_host_ip": "10.0.0.2",
              "gloo_socket_ifname": "enp1s0f0np0", "nccl_socket_ifname": "enp1s0f0np0",
              "fabric_ifname": "enp1s0f0np0"}  # fmt: skip
    doc["raylets"] = [raylet, {**raylet, "pid": 778}]
    return json.dumps(doc, separators=(",", ":")).encode()


def at_caps(list_over: str | None = None) -> bytes:
    """Every list at its cap, strings long, padded to MAX_DOC_BYTES; `list_over`: that list one past its cap."""
    caps = dict(peerdoc.CAPS)
    doc = json.loads(typical())
    doc["ray_node_ids"] = [f"{i:056x}" for i in range(caps["ray_node_ids"])]
    doc["engines"] = [{"root_pid": 10_000 + i, "engine": "vllm", "rss_bytes": 60 * GiB} for i in range(caps["engines"])]
    pids = list(range(100_000, 100_000 + peerdoc.PIDS_PER_KILL))
    doc["kills"] = [{"ts": "2025-12-04T05:00:00Z", "kind": "kill", "trigger": "budget", "summary": "x" * 240,
                     "pids": pids} for _ in range(caps["kills"])]  # fmt: skip
    doc["groups"] = [{"key": f"10.0.{i // 250}.{i % 250}:29501", "node_rank": 1, "pid": 20_000 + i, "uid": 1000}
                     for i in range(caps["groups"])]  # fmt: skip
    doc["ray_gone"] = [{"node_id": NODE, "pid": 30_000 + i} for i in range(caps["ray_gone"])]
    doc["raylets"] = [{**doc["raylets"][0], "pid": 40_000 + i} for i in range(caps["raylets"])]
    doc["budgets"] = [{"group": f"{i:036x}", "budget_bytes": GiB, "uid": 1000} for i in range(caps["budgets"])]
    if list_over is not None:
        doc[list_over] = doc[list_over] + doc[list_over][:1]
    body = json.dumps(doc, separators=(",", ":")).encode()
    pad = peerdoc.MAX_DOC_BYTES - len(body)
    per = pad // len(doc["raylets"]) - 2
    for r in doc["raylets"]:  # long strings where a peer's words are (its raylets' checked variables)
        r["gcs_address"] += "y" * per
    body = json.dumps(doc, separators=(",", ":")).encode()
    while len(body) > peerdoc.MAX_DOC_BYTES:
        doc["raylets"][0]["gcs_address"] = doc["raylets"][0]["gcs_address"][: -(len(body) - peerdoc.MAX_DOC_BYTES)]
        body = json.dumps(doc, separators=(",", ":")).encode()
    return body


def budgets_1mib() -> bytes:
    budgets = tuple(peerdoc.PeerBudget("a" * 36, GiB, 1000) for _ in range(13_000))
    doc = json.loads(typical())
    doc["budgets"] = [{"group": b.group, "budget_bytes": b.budget_bytes, "uid": b.uid} for b in budgets]
    return json.dumps(doc, separators=(",", ":")).encode()


def numbers() -> bytes:
    """The worst shape for json.loads at the cap: a list of one-digit numbers."""
    n = (peerdoc.MAX_DOC_BYTES - 64) // 2
    return b'{"version":1,"budgets":[' + b",".join([b"0"] * n) + b"]}"


def cpu_ms(fn: Callable[[], object], n: int) -> float:
    out = []
    for _ in range(n):
        t = time.process_time()
        try:
            fn()
        except ValueError:
            pass
        out.append((time.process_time() - t) * 1e3)
    return statistics.median(out)


def parse_rows(n: int) -> list[str]:
    cases = [
        ("typical (2 raylets, 16 kills, 2 members)", typical()),
        ("every list at its cap, padded to MAX_DOC_BYTES", at_caps()),
        ("kills one past its cap, at MAX_DOC_BYTES (refused)", at_caps("kills")),
        ("13,000 budgets in 1 MiB (refused: larger than MAX_DOC_BYTES)", budgets_1mib()),
        ("one list of small numbers filling MAX_DOC_BYTES (refused by count)", numbers()),
    ]
    rows = ["| document | bytes | parse median (ms CPU) | outcome |", "| --- | ---: | ---: | --- |"]
    for name, body in cases:
        try:
            peerdoc.parse(body)
            outcome = "parsed"
        except ValueError as exc:
            outcome = f"refused: {str(exc)[:60]}"
        ms = cpu_ms(partial(peerdoc.parse, body), n)
        rows.append(f"| {name} | {len(body):,} | {ms:.2f} | {outcome} |")
    body = at_caps()
    copy = bytes(bytearray(body))
    rows.append(f"| the same body again (compared, not parsed) | {len(body):,} | "
                f"{cpu_ms(lambda: copy == body, n):.3f} | kept |")  # fmt: skip
    return rows


def read_rounds(rounds: int, reads: int, tmp: Path) -> tuple[list[str], float, float]:
    from sparkwatch.telemetry.exporter.server import MetricsServer, build_registry
    from sparkwatch.telemetry.peerwatch import PEER_TIMEOUT_S

    key_path = tmp / "peer.key"
    write_key(key_path)
    key = read_key(key_path)
    body = typical()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {"state_dir": tmp / "state", "listen": f"127.0.0.1:{port}"}
    server_settings = load_settings(None, base, check_memory=False)
    from sparkwatch.common.peerproof import prove

    server = MetricsServer(server_settings, build_registry(server_settings, lambda: None),
                           documents={peerdoc.PATH: lambda: body},
                           prover=lambda nonce, b: prove(key, "spark-b", nonce, b))  # fmt: skip
    server.start()
    peers = {"peers": [f"127.0.0.1:{port}"]}
    plain = PeerWatch(load_settings(None, {**base, **peers}, check_memory=False), lambda e: None)
    proven = PeerWatch(load_settings(None, {**base, **peers, "peer_key_file": key_path}, check_memory=False),
                       lambda e: None)  # fmt: skip
    rows = ["| round | A plain read (ms) | B proven read (ms) | B − A (ms) |", "| --- | ---: | ---: | ---: |"]
    meds: dict[str, list[float]] = {"A": [], "B": []}
    try:
        for w in (plain, proven):  # warm: imports, the first parse
            assert w._read(w.peers[0], PEER_TIMEOUT_S), w.peers[0].last_error
        for r in range(1, rounds + 1):
            got = {}
            for name, w in (("A", plain), ("B", proven)):
                times = []
                for _ in range(reads):
                    w.peers[0].body = None  # parse every time: the body would be unchanged here
                    t = time.perf_counter()
                    ok = w._read(w.peers[0], PEER_TIMEOUT_S)
                    times.append((time.perf_counter() - t) * 1e3)
                    assert ok and w.peers[0].proven == (name == "B")
                got[name] = statistics.median(times)
                meds[name].append(got[name])
            rows.append(f"| {r} | {got['A']:.3f} | {got['B']:.3f} | {got['B'] - got['A']:+.3f} |")
    finally:
        server.stop()
    return rows, statistics.median(meds["A"]), statistics.median(meds["B"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parses", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        parse = parse_rows(args.parses)
        reads, a, b = read_rounds(args.rounds, args.reads, Path(tmp))
    load = os.getloadavg()[0]
    text = [
        "# Peer documents: parse cost at the size cap, and a proven read against a plain one (issue 37)",
        "",
        f"bench/peerdoc_bench.py on {platform.node()} ({os.cpu_count()} CPUs, load {load:.1f}), Python "
        f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}:",
        "",
        f"    /work/main/.venv/bin/python bench/peerdoc_bench.py --parses {args.parses} --rounds {args.rounds} "
        f"--reads {args.reads} --out bench/RESULTS-peerdoc.md",
        "",
        f"## Parse (telemetry.peerdoc.parse; MAX_DOC_BYTES {peerdoc.MAX_DOC_BYTES:,}, goal ≤ 20 ms)",
        "",
        *parse,
        "",
        "## One read of a peer on loopback (PeerWatch._read: connect, GET, parse), A B A B",
        "",
        *reads,
        "",
        f"Median of the round medians: A {a:.3f} ms, B {b:.3f} ms: the proof adds {b - a:+.3f} ms (goal ≤ 1 ms).",
    ]
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
