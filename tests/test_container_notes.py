"""Containers named everywhere, and their io.sparkwatch.* labels enforced, without a daemon: the message telemetry sends
the guard (common.messages.ContainersMsg), what telemetry chooses to send (telemetry.containerboard), how the guard
ranks, budgets and records with it (core.kill.policy, guard.budgets, core.kill.killrecord), and the views' words.
The same with a real dockerd and a real guard: tests/test_container_labels.py."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import pytest

from sparkwatch.common.messages import BadMessage, ContainersMsg, decode, encode
from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.config.settings import load_settings
from sparkwatch.core.container import (
    NOTES_MAX,
    ContainerFacts,
    ContainerNote,
    ContainerNotes,
    container_line,
    note_of,
)
from sparkwatch.core.containerid import ContainerRef
from sparkwatch.core.kill import policy
from sparkwatch.core.kill.budget import BudgetParams
from sparkwatch.core.kill.killrecord import KillFacts, kill_fields, kill_line, kill_summary
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, MemInfo, Proc
from sparkwatch.core.postmortem.verdict import SparkwatchEvent, event_containers
from sparkwatch.core.units import MiB
from sparkwatch.guard.budgets import BudgetWatch
from sparkwatch.guard.supervisor import TelemetrySupervisor
from sparkwatch.telemetry.containerboard import ContainerBoard
from sparkwatch.telemetry.exporter.containermetric import ContainerCollector
from sparkwatch.telemetry.sources.dockerapi import DockerEvent
from tests.helpers.configs import guard_config_with
from tests.helpers.proctree import FakeProc, write_proc

A, B, C = "a1" * 32, "b2" * 32, "c3" * 32
SCOPE = f"/system.slice/docker-{A}.scope"


def facts(cid: str, name: str, **labels: str) -> ContainerFacts:
    return ContainerFacts(
        id=cid, name=name, image="nvcr.io/nvidia/vllm:25.09-py3", state="running", pid=4242, labels=labels
    )


def proc(pid: int, cgroup: str | None = None, rss_mib: int = 100, start: int = 10) -> Proc:
    return Proc(pid, 1, 0, "VLLM::EngineCor", "S", start, rss_mib * MiB, ("VLLM::EngineCore",), cgroup=cgroup)


def tree(pid: int, cgroup: str | None = None, rss_mib: int = 100, start: int = 10) -> EngineTree:
    root = proc(pid, cgroup, rss_mib, start)
    return EngineTree("vllm", root, (root,))


# --- the message ------------------------------------------------------------------------------------------------


def test_the_message_carries_names_and_labels_and_refuses_what_is_past_its_limits() -> None:
    note = ContainerNote(A, "vllm-a", "nvcr.io/nvidia/vllm:25.09-py3", "spark", "vllm", 60 << 30, True, -3)
    msg = ContainersMsg((note,))
    assert decode(encode(msg)) == msg
    too_many = ContainersMsg(tuple(ContainerNote(f"{i:064x}", "n", "i") for i in range(NOTES_MAX + 1)))
    with pytest.raises(BadMessage, match="more than"):
        decode(encode(too_many))
    for bad in (
        ContainerNote("a1" * 16, "n", "i"),  # not a whole id
        ContainerNote(A, "n" * 1000, "i"),  # a name past the limit
        ContainerNote(A, "n", "i", budget_bytes=0),
    ):
        with pytest.raises(BadMessage):
            decode(encode(ContainersMsg((bad,))))


def test_the_guard_keeps_telemetrys_last_word_and_a_resend_changes_nothing() -> None:
    supervisor = TelemetrySupervisor(guard_config_with(), None, None)  # type: ignore[arg-type]  # never started
    assert not supervisor.containers()
    msg = ContainersMsg((ContainerNote(A, "vllm-a", "img", budget_bytes=300 * MiB, protect=False, priority=5),))
    supervisor._handle(msg)
    first = supervisor.containers()
    assert first.budgets == {A: 300 * MiB} and first.priorities == {A: 5} and not first.protected
    supervisor._handle(ContainersMsg(msg.containers))  # the 30 s resend
    assert supervisor.containers() is first  # the budgets' discovery keys on a new object: none made
    supervisor._handle(ContainersMsg(()))
    assert not supervisor.containers()


# --- what telemetry sends ---------------------------------------------------------------------------------------


def test_the_board_tells_the_guard_the_engines_containers_and_the_labelled_ones_once_and_on_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[ContainersMsg] = []
    now = [100.0]
    board = ContainerBoard(sent.append, resend_s=30.0, clock=lambda: now[0])
    board.observe([], [facts(C, "no-labels")])
    assert sent == []  # nothing that matters: nothing sent, ever
    engine = facts(A, "vllm-a", **{"com.docker.compose.project": "spark", "com.docker.compose.service": "vllm"})
    labelled = facts(B, "labelled", **{"io.sparkwatch.budget": "lots", "io.sparkwatch.priority": "7"})
    with caplog.at_level(logging.WARNING, logger="sparkwatch"):
        board.observe([tree(9, SCOPE)], [engine, labelled, facts(C, "no-labels")])
        board.observe([tree(9, SCOPE)], [engine, labelled, facts(C, "no-labels")])
    [msg] = sent
    assert [n.name for n in msg.containers] == ["vllm-a", "labelled"]  # the engine's first; the unlabelled one not
    assert (msg.containers[0].project, msg.containers[0].service) == ("spark", "vllm")
    assert (msg.containers[1].budget_bytes, msg.containers[1].priority) == (None, 7)  # the bad label ignored
    said = [r.getMessage() for r in caplog.records if "io.sparkwatch.budget" in r.getMessage()]
    assert len(said) == 1 and "labelled" in said[0] and "ignored" in said[0]  # named once
    assert board.engine_containers() == (engine,)
    now[0] += 31
    board.observe([tree(9, SCOPE)], [engine, labelled])
    assert len(sent) == 2 and sent[1] == msg  # the resend
    # A container's start event tells the guard at once, before any telemetry cycle.
    budgeted = facts(C, "budgeted", **{"io.sparkwatch.budget": "300MiB"})
    board.on_event(DockerEvent("start", C, 0, {}), budgeted)
    assert sent[-1].containers[-1] == note_of(budgeted) and sent[-1].containers[-1].budget_bytes == 300 * MiB
    board.on_event(DockerEvent("die", C, 0, {}), None)
    assert C not in {n.id for n in sent[-1].containers}


def test_the_board_bounds_what_it_sends() -> None:
    sent: list[ContainersMsg] = []
    board = ContainerBoard(sent.append)
    many = [facts(f"{i:064x}", f"c{i}", **{"io.sparkwatch.protect": "true"}) for i in range(NOTES_MAX + 10)]
    board.observe([], many)
    assert len(sent[-1].containers) == NOTES_MAX
    decode(encode(sent[-1]))  # within what the guard takes


def test_a_refused_datagram_is_sent_again_at_the_next_look() -> None:
    answers = [False, True]
    sent: list[ContainersMsg] = []

    def send(m: ContainersMsg) -> bool:
        sent.append(m)
        return answers.pop(0)

    board = ContainerBoard(send)
    labelled = facts(A, "x", **{"io.sparkwatch.protect": "1"})
    board.observe([], [labelled])
    board.observe([], [labelled])
    assert len(sent) == 2 and board.sent_total == 1


def test_the_info_metric_is_the_engines_containers_with_secrets_redacted() -> None:
    leaky = ContainerFacts(
        id=A, name="vllm-a", image="bob:s3cr3tT0ken@registry.example.com/team/vllm:0.8", state="running", pid=1
    )
    [family] = ContainerCollector(lambda: [leaky]).collect()
    [sample] = family.samples
    assert sample.labels["image"] == "<redacted>@registry.example.com/team/vllm:0.8"
    assert sample.labels["id"] == A and sample.labels["restart_policy"] == "no" and sample.value == 1
    assert list(ContainerCollector(lambda: []).collect()) == []


# --- the guard: ranking, budgets, records -----------------------------------------------------------------------


def notes(*items: ContainerNote) -> ContainerNotes:
    return ContainerNotes.of(items)


def test_a_protected_container_is_never_chosen_and_its_priority_label_ranks_the_rest() -> None:
    protected_scope = f"/system.slice/docker-{B}.scope"
    trees = [tree(100, SCOPE, 1000, start=1), tree(200, protected_scope, 9000, start=2), tree(300, None, 500, start=3)]
    told = notes(ContainerNote(A, "first", "img", priority=10), ContainerNote(B, "keep", "img", protect=True))
    params = policy.PolicyParams.build(kill_priority=["50=VLLM"])  # the label is the more specific word
    ranking = policy.rank(trees, policy.GrowthHistory(), 0.0, None, params, containers=told)
    assert [c.tree.root.pid for c in ranking] == [300, 100, 200]
    assert ranking[0].priority == 50 and ranking[1].priority == 10
    assert "kill_priority +10 (io.sparkwatch.priority)" in ranking[1].reasons
    spared = ranking[2]
    assert spared.never_kill == "io.sparkwatch.protect=true"
    assert any("container keep (img; b2b2b2b2b2b2)" in r for r in spared.reasons)
    chosen = policy.choose(ranking, exclude={(300, 3), (100, 1)})
    assert chosen is None  # only the protected one is left: nothing to kill
    # without telemetry's word the cgroup path is not even read, and everything ranks as before
    plain = policy.rank(trees, policy.GrowthHistory(), 0.0, None, params)
    assert all(c.never_kill is None and c.priority == 50 for c in plain)


def mem(available_mib: int = 20_000) -> MemInfo:
    return MemInfo(127_000 * MiB, available_mib * MiB, 0, 0, 0, 0, 0)


def test_the_kill_line_event_and_summary_name_the_container_and_say_the_id_alone_when_unnamed() -> None:
    named, bare_id = tree(100, SCOPE), tree(200, f"/docker/{B}")
    note = ContainerNote(A, "vllm-a", "nvcr.io/nvidia/vllm:25.09-py3", "spark", "vllm", 300 * MiB)
    base = KillFacts(Trigger.BUDGET, mem(), 8 << 30, 0.0, False, (named,), ((named.root, "vllm"),))
    facts_ = dataclasses.replace(base, container_notes=(note,))
    line = kill_line(facts_)
    assert "in container vllm-a (nvcr.io/nvidia/vllm:25.09-py3 spark/vllm; a1a1a1a1a1a1)" in line
    assert "in container vllm-a (nvcr.io/nvidia/vllm:25.09-py3 spark/vllm; a1a1a1a1a1a1)" in kill_summary(facts_)
    assert kill_fields(facts_)["containers"] == [
        {
            "root_pid": 100,
            "runtime": "docker",
            "id": A,
            "name": "vllm-a",
            "image": "nvcr.io/nvidia/vllm:25.09-py3",
            "compose_project": "spark",
            "compose_service": "vllm",
        }
    ]
    unnamed = KillFacts(Trigger.FLOOR, mem(), 8 << 30, 0.0, False, (bare_id,), ((bare_id.root, "vllm"),))
    assert " in container b2b2b2b2b2b2 (1 process)" in kill_line(unnamed)
    assert kill_fields(unnamed)["containers"] == [{"root_pid": 200, "runtime": "docker", "id": B}]


def test_the_budget_watch_takes_a_containers_label_and_a_protected_one_is_never_held(tmp_path: Path) -> None:
    """guard.budgets over a fixture /proc: a tree whose cgroup names a container with io.sparkwatch.budget is held
    to it (source label, before the config's); one whose container is protected is not held to any budget, and the
    log says so once."""
    root = write_proc(
        tmp_path / "proc",
        [
            FakeProc(100, 1, "VLLM::EngineCor", ["VLLM::EngineCore"], rss_bytes=900 * MiB, cgroup=SCOPE),
            FakeProc(
                200,
                1,
                "VLLM::EngineCor",
                ["VLLM::EngineCore"],
                rss_bytes=900 * MiB,
                cgroup=f"/system.slice/docker-{B}.scope",
            ),
        ],
    )
    settings = load_settings(None, {"proc_root": root, "engine_budgets": ["200MiB=VLLM"]})
    from sparkwatch.common.enginerules import engine_rules, engine_scope

    rules, scope = engine_rules(settings), engine_scope(settings)
    killed: list[tuple[int, str, int]] = []
    lines: list[str] = []
    watch = BudgetWatch(
        str(root),
        ProcScanner(root),
        kill=lambda r: killed.append((r.target.tree.root.pid, r.target.source, r.target.budget_bytes)),  # type: ignore[union-attr]
        event=lambda *e: None,
        line=lambda level, text: lines.append(text),
    )
    told = notes(
        ContainerNote(A, "vllm-a", "img", budget_bytes=300 * MiB), ContainerNote(B, "keep", "img", protect=True)
    )
    config_budgets = tuple(policy.parse_engine_budgets(settings.engine_budgets))
    now = time.monotonic()
    for i in range(3):
        watch.tick(now + i, 20_000 * MiB, rules=rules, scope=scope, params=BudgetParams(debounce_samples=1),
                   config_budgets=config_budgets, launched=(), gpu=None, containers=told)  # fmt: skip
    assert killed == [(100, "label", 300 * MiB)]
    assert len(lines) == 1 and "root=200" in lines[0] and "io.sparkwatch.protect=true" in lines[0]
    assert "container keep (img; b2b2b2b2b2b2)" in lines[0] and "(config)" in lines[0]


# --- the views ----------------------------------------------------------------------------------------------------


def test_a_view_names_the_container_in_place_of_the_shim() -> None:
    ref = ContainerRef("docker", A)
    f = facts(A, "vllm-a", **{"com.docker.compose.project": "spark", "com.docker.compose.service": "vllm"})
    assert container_line(ref, f) == (
        "in container vllm-a (nvcr.io/nvidia/vllm:25.09-py3 spark/vllm; a1a1a1a1a1a1), restart no"
    )
    assert container_line(ref, None) == "in container a1a1a1a1a1a1 (docker)"


def test_postmortem_names_a_killed_container_from_the_events_fields() -> None:
    fields = [{"root_pid": 1, "runtime": "docker", "id": A, "name": "vllm-a", "image": "img"}, {"id": B}, "junk"]
    assert event_containers(fields) == ("container vllm-a (img)", "container b2b2b2b2b2b2")
    from sparkwatch.core.postmortem.verdict import _event_causes

    old = SparkwatchEvent(10.0, "kill", "Killed vllm (root pid 1, 1 process): …", containers=event_containers(fields))
    [cause] = _event_causes([old], 0.0)
    assert cause.line.endswith("[container vllm-a (img); container b2b2b2b2b2b2]")
    new = SparkwatchEvent(10.0, "kill", "Killed vllm (root pid 1) in container vllm-a (img; a1a1a1a1a1a1)",
                          containers=("container vllm-a (img)",))  # fmt: skip
    assert "[" not in _event_causes([new], 0.0)[0].line  # named once
