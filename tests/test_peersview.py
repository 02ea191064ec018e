"""The commands' view of the other nodes (issue 39): `status` and `doctor` read each peer once with a reader of their
own (cli.peerread), not telemetry's running watch, and say of each whether its word is proven, its last answer's
age, MemAvailable and groups.

Against real HTTP on loopback (tests.test_peers.Peer): a peer proven by the pair's key, the same peer display-only
to a reader without the key, a forger refused, a refused port and a host that never answers.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from sparkwatch.cli.peerread import read_peers, views
from sparkwatch.config.settings import Settings, load_settings
from sparkwatch.core.model import MemInfo
from sparkwatch.core.report.peerchecks import PeerView, peer_line
from sparkwatch.telemetry import peerdoc
from tests.daemon import free_port
from tests.helpers.peerkey import key_file, key_of
from tests.test_peers import KEY, GiB, cli, peer, silent_host


def member_doc() -> bytes:
    """Node B's document: 52 GiB available, its rank 1 of the group KEY."""
    mem = MemInfo(total_bytes=128 * GiB, free_bytes=50 * GiB, available_bytes=52 * GiB, cached_bytes=2 * GiB,
                  buffers_bytes=0, swap_total_bytes=0, swap_free_bytes=0)  # fmt: skip
    groups = (peerdoc.PeerMember(KEY, 1, 200, os.getuid()),)
    return peerdoc.build("spark-b", (), mem, (), (), groups=groups)


def settings_of(tmp_path: Path, *peers: str, key: Path | None = None) -> Settings:
    keys = {"peer_key_file": key} if key is not None else {}
    return load_settings(None, {"state_dir": tmp_path / "state", "peers": list(peers), **keys}, check_memory=False)


def test_the_reader_says_proven_display_only_refused_and_silent_all_at_once(tmp_path: Path) -> None:
    """With the key: the peer's document taken and proven; a forger's (no key on its side) refused as bad_proof;
    a refused port and two silent hosts said as such; the silent ones read at once, each within its second."""
    path = key_file(tmp_path / "key")
    with peer(key_of(path)) as honest, peer() as forger, silent_host() as quiet1, silent_host() as quiet2:
        honest.body = forger.body = member_doc()
        labels = [f"127.0.0.1:{honest.port}", f"127.0.0.1:{forger.port}", f"127.0.0.1:{free_port()}",
                  f"127.0.0.1:{quiet1}", f"127.0.0.1:{quiet2}"]  # fmt: skip
        start = time.monotonic()
        readings = read_peers(settings_of(tmp_path, *labels, key=path), timeout_s=1.0)
        took = time.monotonic() - start
        assert took < 1.9, took  # two silent peers, read side by side, not one after the other
        ok, forged, refused, silent1, silent2 = readings
        assert ok.proven and ok.doc is not None and ok.doc.node == "spark-b" and honest.nonces
        assert not forged.proven and forged.error is not None and forged.error.startswith("bad_proof")
        assert refused.doc is None and refused.error is not None and refused.error.startswith("refused")
        assert [s.error.split(":")[0] for s in (silent1, silent2) if s.error] == ["timeout", "timeout"]
        line = peer_line(views([ok])[0])
        assert re.match(
            rf"spark-b \(127.0.0.1:{honest.port}\): proven \(peer_key_file\), answered [01]\.\d s ago", line
        )
        assert "MemAvailable 52.0 GiB" in line and f"groups: {KEY} rank 1" in line
        # Without the key the same peer is display-only: shown, its word moves nothing, no proof asked for.
        honest.nonces.clear()
        (plain,) = read_peers(settings_of(tmp_path / "plain", f"127.0.0.1:{honest.port}"))
        assert plain.doc is not None and not plain.proven and honest.nonces == []
        assert peer_line(views([plain])[0]).startswith(f"spark-b (127.0.0.1:{honest.port}): display-only, answered")


def test_a_silent_peer_keeps_its_last_answer_and_its_age() -> None:
    v = PeerView("10.0.0.2:9101", "key", "timeout: timed out", "spark-b", 12.3, 52 * GiB, 1, (), 1)
    assert peer_line(v) == (
        "spark-b (10.0.0.2:9101): no answer (timeout: timed out); its last answer 12.3 s ago, "
        "proven (peer_key_file): MemAvailable 52.0 GiB, 1 engine tree, no groups, Ray: 1 node"
    )


def test_status_once_and_doctor_show_each_peer(tmp_path: Path) -> None:
    """`status --once` has a PEERS section, `doctor --json` a peers check naming each peer's state: the proven one
    answering with its MemAvailable and group; the refused one a warn with its fix."""
    path = key_file(tmp_path / "key")
    with peer(key_of(path)) as p:
        p.body = member_doc()
        gone = f"127.0.0.1:{free_port()}"
        env = {"SPARKWATCH_PEERS": json.dumps([f"127.0.0.1:{p.port}", gone]), "SPARKWATCH_PEER_KEY_FILE": str(path)}
        status = cli(tmp_path, "status", "--once", env=env)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        (first,) = [i for i, line in enumerate(lines) if line.startswith("PEERS")]
        assert f"spark-b (127.0.0.1:{p.port}): proven (peer_key_file), answered" in lines[first]
        assert "MemAvailable 52.0 GiB" in lines[first] and f"{KEY} rank 1" in status.stdout
        assert f"{gone}: no answer (refused" in status.stdout
        doctor = cli(tmp_path, "doctor", "--json", env=env)
        (check,) = [c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "peers"]
        assert check["status"] == "warn" and check["summary"].startswith("peers: 2 configured, proven by peer_key_file")
        assert f"spark-b (127.0.0.1:{p.port}): proven (peer_key_file), answered" in check["summary"]
        assert f"{gone}: no answer (refused" in check["summary"] and f"on {gone}: systemctl status" in check["fix"]
        # Every peer answering and proven: ok.
        env["SPARKWATCH_PEERS"] = json.dumps([f"127.0.0.1:{p.port}"])
        doctor = cli(tmp_path, "doctor", "--json", env=env)
        (check,) = [c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "peers"]
        assert check["status"] == "ok" and "MemAvailable 52.0 GiB" in check["summary"], check


def test_status_without_peers_reads_and_imports_no_peer_code(tmp_path: Path) -> None:
    out = cli(tmp_path, "status", "--once", env={"PYTHONVERBOSE": "1"})
    assert out.returncode == 0 and "PEERS" not in out.stdout
    assert "sparkwatch.cli.peerread" not in out.stderr and "sparkwatch.telemetry.peerwatch" not in out.stderr
