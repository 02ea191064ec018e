"""Groups without Ray (core.kill.mpgroup): the rendezvous an engine's command line names, and when a node must stop
its members, pure; and the watch (telemetry.mpwatch) over peers as the peer watch leaves them. The same over real
processes, two agents and two network namespaces: tests/test_ray_group.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.common.messages import GroupTeardownMsg
from sparkwatch.common.sources.procs import read_start_ticks
from sparkwatch.config.settings import load_settings
from sparkwatch.core.kill import mpgroup
from sparkwatch.core.kill.mpgroup import Member, Rendezvous, rendezvous, teardowns
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.mpwatch import MpGroupWatch
from sparkwatch.telemetry.peerwatch import Peer
from tests.daemon import daemon_env, free_port

VLLM = ("/usr/bin/python3", "/usr/local/bin/vllm", "serve", "nvidia/Qwen3-235B-A22B-FP4", "--tensor-parallel-size", "1")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # vLLM's multiprocessing backend across nodes: the head, then a headless node
        ((*VLLM, "--nnodes", "2", "--node-rank", "0", "--master-addr", "192.168.100.10", "--master-port", "29501"),
         Rendezvous("192.168.100.10:29501", 2, 0)),
        ((*VLLM, "--nnodes=2", "--node-rank=1", "--master-addr=192.168.100.10", "--headless"),
         Rendezvous("192.168.100.10:29501", 2, 1)),  # vLLM's default port
        ((*VLLM, "--nnodes", "2", "--node_rank", "1", "--master_addr", "10.0.0.1", "--master_port", "1234"),
         Rendezvous("10.0.0.1:1234", 2, 1)),  # underscores, as vLLM also accepts
        # SGLang
        (("python3", "-m", "sglang.launch_server", "--model-path", "m", "--tp", "2", "--nnodes", "2", "--node-rank",
          "1", "--dist-init-addr", "192.168.100.10:20000"), Rendezvous("192.168.100.10:20000", 2, 1)),
        # one node: no group
        (VLLM, None),
        ((*VLLM, "--nnodes", "1"), None),
        # what does not parse makes no member (a parse error is never a reason to kill)
        ((*VLLM, "--nnodes", "two"), None),
        ((*VLLM, "--nnodes", "2", "--node-rank", "2"), None),
        ((*VLLM, "--nnodes", "2", "--master-port", "70000"), None),
        ((*VLLM, "--nnodes", "2", "--dist-init-addr", "nohostport"), None),
        ((*VLLM, "--nnodes"), None),
    ],
)  # fmt: skip
def test_the_rendezvous_is_read_from_the_engine_s_own_command_line(
    argv: tuple[str, ...], expected: Rendezvous | None
) -> None:
    assert rendezvous(argv) == expected
    if expected is not None:
        assert mpgroup.member_of(expected.key, argv)
        assert not mpgroup.member_of("10.9.9.9:1", argv)


LLAMA = ("/opt/llama.cpp/build/bin/llama-server", "-m", "/models/Qwen3-235B-A22B-Q4_K_M.gguf", "-ngl", "99")


def test_a_llama_cpp_head_is_a_member_of_each_rpc_server_it_names_and_an_rpc_server_is_only_listed() -> None:
    """`--rpc host:port,host:port` (llama.cpp's common/arg.cpp): one group per rpc-server; an entry that does not
    parse is left out. rpc-server's port from `-p`/`--port`, 50052 by default; any other process has none."""
    head = (*LLAMA, "--rpc", "192.168.100.11:50052,192.168.100.12:50053,nohost,10.0.0.9:port")
    assert mpgroup.rpc_endpoints(head) == ("192.168.100.11:50052", "192.168.100.12:50053")
    assert mpgroup.group_keys(head) == (("192.168.100.11:50052", 0), ("192.168.100.12:50053", 0))
    assert mpgroup.member_of("192.168.100.12:50053", head) and not mpgroup.member_of("192.168.100.13:50052", head)
    assert mpgroup.rpc_endpoints((*LLAMA, "--rpc=10.0.0.2:50052")) == ("10.0.0.2:50052",)
    assert mpgroup.group_keys(LLAMA) == ()  # one node: no group
    server = "/opt/llama.cpp/build/bin/rpc-server"
    assert mpgroup.rpc_server_port((server, "-H", "0.0.0.0")) == mpgroup.RPC_PORT
    assert mpgroup.rpc_server_port((server, "-H", "0.0.0.0", "-p", "50060")) == 50060
    assert mpgroup.rpc_server_port((server, "--port=50061", "-c")) == 50061
    assert mpgroup.rpc_server_port((server, "-p", "fifty")) is None  # a parse error makes no member
    assert mpgroup.rpc_server_port(head) is None
    # an rpc-server is never a member that may be stopped for a group: a head that ends leaves it waiting
    assert mpgroup.group_keys((server, "-p", "50052")) == ()


KEY = "10.0.0.1:29501"
OWNER = 1000  # the user who runs the engine on both nodes
MINE = (Member(KEY, 0, 100, 7, OWNER),)


def test_a_peer_member_that_vanishes_ends_the_group_here() -> None:
    then = {"b:9847": ("spark-b", frozenset({(KEY, OWNER, 200)}))}
    assert teardowns(MINE, then, {"b:9847": ("spark-b", frozenset({(KEY, OWNER, 200)}))}) == ()
    (t,) = teardowns(MINE, then, {"b:9847": ("spark-b", frozenset())})
    assert t.loss == mpgroup.Loss(KEY, OWNER, mpgroup.RANK_GONE, "b:9847", "spark-b", 200)
    assert t.members == MINE
    # a restarted rank is another pid: the one we knew is gone
    (t,) = teardowns(MINE, then, {"b:9847": ("spark-b", frozenset({(KEY, OWNER, 201)}))})
    assert t.loss.pid == 200
    # already handed to the guard: not again
    assert teardowns(MINE, then, {"b:9847": ("spark-b", frozenset())}, done=[(KEY, OWNER)]) == ()


def test_another_user_s_process_naming_the_same_rendezvous_never_ends_the_owner_s_group() -> None:
    """A user on B who starts and stops a process naming the owner's rendezvous (its command line is theirs to write)
    is not the owner's member: its end ends nothing here, and the owner's member on B still counts."""
    then = {"b": ("spark-b", frozenset({(KEY, 1001, 300), (KEY, OWNER, 200)}))}
    assert teardowns(MINE, then, {"b": ("spark-b", frozenset({(KEY, OWNER, 200)}))}) == ()
    (t,) = teardowns(MINE, then, {"b": ("spark-b", frozenset({(KEY, 1001, 300)}))})
    assert (t.loss.uid, t.loss.pid) == (OWNER, 200)
    # nor does another user's member here take part in the owner's group
    theirs = Member(KEY, 0, 101, 8, 1001)
    (t,) = teardowns((*MINE, theirs), then, {"b": ("spark-b", frozenset({(KEY, 1001, 300)}))})
    assert t.members == MINE


def test_a_lost_peer_ends_the_groups_it_held_and_only_those() -> None:
    other = "10.0.0.1:29600"
    mine = (*MINE, Member(other, 0, 101, 8, OWNER))
    then = {"b:9847": ("spark-b", frozenset({(KEY, OWNER, 200)}))}
    (t,) = teardowns(mine, then, {"b:9847": None})
    assert (t.loss.key, t.loss.cause, t.loss.pid) == (KEY, mpgroup.PEER_LOST, None)
    assert t.members == MINE


def test_a_group_not_run_here_or_never_seen_on_a_peer_ends_nothing() -> None:
    # the peer's group is not ours
    assert (
        teardowns(MINE, {"b": ("spark-b", frozenset({("10.0.0.2:1", OWNER, 5)}))}, {"b": ("spark-b", frozenset())})
        == ()
    )
    # a peer never seen with a member (it starts later, or has none): nothing to lose
    assert teardowns(MINE, {}, {"b": None}) == ()
    assert teardowns(MINE, {"b": ("spark-b", frozenset())}, {"b": None}) == ()


def test_a_peer_document_without_groups_still_parses_and_one_with_them_round_trips() -> None:
    old = peerdoc.build("spark-b", ("n1",), None, (), ())
    assert b',"groups":null' in old  # not known yet (before the agent's first cycle): never read as "all gone"
    assert peerdoc.parse(old.replace(b',"groups":null', b"")).groups is None
    doc = peerdoc.parse(peerdoc.build("spark-b", (), None, (), (), groups=(peerdoc.PeerMember(KEY, 1, 200, OWNER),)))
    assert doc.groups == (peerdoc.PeerMember(KEY, 1, 200, OWNER),)


def test_the_watch_ends_a_group_once_and_not_a_new_run_while_the_peer_is_still_lost() -> None:
    """telemetry.mpwatch over peers as the peer watch leaves them: B lists its member, then is lost. A's member is
    handed to the guard once per resend window; once A's member is gone and the owner starts a new one while B is
    still lost, nothing is sent for it (B's answer decides again when it comes back)."""
    me = os.getpid()  # this process stands for A's member: its own namespace, its own start time
    proc = Proc(me, 1, os.getuid(), "vllm", "S", read_start_ticks("/proc", me) or 0, 1 << 20,
                ("vllm", "serve", "m", "--nnodes", "2", "--master-addr", "10.0.0.1"))  # fmt: skip
    trees: list[EngineTree] = [EngineTree("vllm", proc, (proc,))]
    sent: list[GroupTeardownMsg] = []
    settings = load_settings(None, {"group_teardown": True})
    watch = MpGroupWatch(settings, sent.append, lambda: trees)
    assert watch.published() == (peerdoc.PeerMember(KEY, 0, me, os.getuid()),)
    peer = Peer("b:9847", "http", "b", 9847, proven=True)  # a proven peer (display-only ones end nothing)
    peer.doc = peerdoc.PeerDoc(1, "spark-b", (), None, (), (), (peerdoc.PeerMember(KEY, 1, 200, os.getuid()),))
    assert watch.observe([peer]) == []
    peer.lost = True
    (msg,) = watch.observe([peer])
    assert (msg.group, msg.cause, msg.first_node, msg.first_pid) == (KEY, mpgroup.PEER_LOST, "spark-b", None)
    assert msg.members == ((me, proc.start_ticks, mpgroup.MP_RANK),)
    assert watch.observe([peer]) == []  # within the resend window
    trees.clear()  # the member is gone: the group is over here
    assert watch.observe([peer]) == []
    trees.append(EngineTree("vllm", proc, (proc,)))  # a new run while B is still lost
    assert watch.observe([peer]) == []


def test_a_peer_that_does_not_know_yet_ends_nothing_and_a_missed_scan_unlists_nothing() -> None:
    me = os.getpid()
    proc = Proc(me, 1, os.getuid(), "vllm", "S", read_start_ticks("/proc", me) or 0, 1 << 20,
                ("vllm", "serve", "m", "--nnodes", "2", "--master-addr", "10.0.0.1"))  # fmt: skip
    trees: list[EngineTree] = [EngineTree("vllm", proc, (proc,))]
    sent: list[GroupTeardownMsg] = []
    started = [False]
    watch = MpGroupWatch(load_settings(None, {}), sent.append, lambda: trees if started[0] else None)
    assert watch.published() is None  # before telemetry's first cycle
    started[0] = True
    assert watch.published() == (peerdoc.PeerMember(KEY, 0, me, os.getuid()),)
    trees.clear()  # a cycle whose scan missed the tree: the process lives, it stays listed
    assert watch.published() == (peerdoc.PeerMember(KEY, 0, me, os.getuid()),)
    trees.append(EngineTree("vllm", proc, (proc,)))
    peer = Peer("b:9847", "http", "b", 9847, proven=True)  # a proven peer (display-only ones end nothing)
    peer.doc = peerdoc.PeerDoc(1, "spark-b", (), None, (), (), (peerdoc.PeerMember(KEY, 1, 200, os.getuid()),))
    assert watch.observe([peer]) == []
    peer.doc = peerdoc.PeerDoc(1, "spark-b", (), None, (), (), None)  # B's agent restarted: its groups unknown
    assert watch.observe([peer]) == [] and sent == []


def test_engines_lists_this_node_s_members_of_groups_without_ray(tmp_path: Path) -> None:
    """`sparkwatch engines` shows each group this node takes part in without Ray: a `vllm serve … --nnodes 2` of the
    test's own, titled as vLLM's entry point leaves it, with its rendezvous and node rank, in JSON and as text."""
    vllm = tmp_path / "vllm"
    vllm.write_text("import time\ntime.sleep(60)\n")
    argv = [sys.executable, str(vllm), "serve", "m", "--nnodes", "2", "--node-rank", "1", "--master-addr",
            "10.9.0.1", "--master-port", "29600", "--headless"]  # fmt: skip
    engine = subprocess.Popen(argv)
    try:
        env = {**daemon_env(tmp_path, free_port()), "SPARKWATCH_RAY_DASHBOARD_URL": ""}
        cmd = [sys.executable, "-m", "sparkwatch", "engines", "--window", "0", "--no-probe"]
        out = subprocess.run([*cmd, "--json"], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        listed = json.loads(out.stdout)["groups_without_ray"]
        assert listed == [{"group": "10.9.0.1:29600", "node_rank": 1, "pid": engine.pid, "role": "member"}]
        text = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert f"group 10.9.0.1:29600  node rank 1  pid {engine.pid}  here" in text.stdout
    finally:
        engine.kill()
        engine.wait(5)
