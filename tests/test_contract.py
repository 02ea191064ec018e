"""The contract in docs/contract.md, held to the code: metric families, event kinds, the golden kill event and the
webhook request that carries it, the CLI's commands, the config keys, NVML's codes.

Regenerate the golden files after an intended change with SPARKWATCH_TEST_UPDATE_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pynvml
import pytest
from prometheus_client.core import Metric

from sparkwatch import __version__
from sparkwatch.cli import build_parser
from sparkwatch.common.eventlog import EventLog, make_event
from sparkwatch.common.spool import AlertRouter
from sparkwatch.common.stats import BudgetStat, KernelLogStats
from sparkwatch.common.systemd import EVENT_PRIORITY, PRIORITY_NOTICE
from sparkwatch.config.settings import Settings
from sparkwatch.core.container import ContainerFacts
from sparkwatch.core.containerpolicy import Gate
from sparkwatch.core.driver.nvmlcodes import NvmlReturn
from sparkwatch.core.enums import CheckStatus, DriverVerdict
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill.killrecord import KillFacts, kill_fields, kill_summary, victims_of
from sparkwatch.core.kill.triggers import TRIGGERS, Recovery, Trigger
from sparkwatch.core.model import BootState, EngineServing, EngineTree, Event, GpuDevice, GpuReport, MemInfo, Proc
from sparkwatch.core.postmortem.verdict import BootEnd
from sparkwatch.core.report.alerts import ALERT_MIN_INTERVAL_S
from sparkwatch.telemetry.exporter.containermetric import ContainerCollector
from sparkwatch.telemetry.exporter.contract import BY_NAME, METRICS, MetricSpec, markdown_table, presence_table
from sparkwatch.telemetry.exporter.gatemetric import GateCollector
from sparkwatch.telemetry.exporter.groupmetric import GroupCollector
from sparkwatch.telemetry.exporter.internal import InternalCollector
from sparkwatch.telemetry.exporter.peermetric import PeerCollector
from sparkwatch.telemetry.exporter.postmortemmetric import PostmortemCollector
from sparkwatch.telemetry.exporter.server import build_registry
from sparkwatch.telemetry.loop import Telemetry
from sparkwatch.telemetry.outbox import Outbox
from sparkwatch.telemetry.postmortemtask import Judged
from tests.conftest import wait_until
from tests.helpers.proctree import FIXED_MTIME
from tests.helpers.scenario import (
    StaticEvents,
    StaticGuard,
    build_scenario,
    gb10_report,
    group_view,
    guard_stats,
    peer_view,
    shm_leftovers,
    stranded_driver,
    zero_durations,
)
from tests.test_doctor import CHECK_IDS

REPO = Path(__file__).resolve().parent.parent
CONTRACT = REPO / "docs" / "contract.md"
GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("SPARKWATCH_TEST_UPDATE_GOLDEN") == "1"
GiB = 1 << 30
MiB = 1 << 20


# --- metrics ------------------------------------------------------------------------------------------------------


def family_name(metric: Metric) -> str:
    """The family as the contract lists it: prometheus_client drops a counter's _total from Metric.name."""
    return metric.name + "_total" if metric.type == "counter" else metric.name


def check_family(metric: Metric) -> MetricSpec:
    name = family_name(metric)
    spec = BY_NAME.get(name)
    assert spec is not None, f"{name} is exported but not in sparkwatch/telemetry/exporter/contract.py"
    assert metric.type == spec.type, (name, metric.type, spec.type)
    assert metric.samples, name
    for sample in metric.samples:
        assert set(sample.labels) - {"le"} == set(spec.labels), (name, sample.labels, spec.labels)
    return spec


class StaticOutbox:
    pending = 1
    delivered_total = 3
    failed_attempts_total = 2
    spool_errors_total = 0
    dropped_total = 1
    quarantined_total = 1
    worker_restarts_total = 0
    last_delivery_timestamp_s: float | None = FIXED_MTIME + 90.0


def h200(index: int) -> GpuDevice:
    """A GPU with its own memory (an H200 as NVML shows it), one field failing with an error code."""
    return GpuDevice(
        index=index,
        uuid="GPU-0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d",
        name="NVIDIA H200",
        bus_id="00000000:19:00.0",
        unified=False,
        power_watts=118.0,
        power_limit_watts=700.0,
        utilization_ratio=0.97,
        temperature_celsius=None,
        sm_clock_hertz=1_980_000_000.0,
        sm_clock_max_hertz=1_980_000_000.0,
        energy_joules=5_000_000.0,
        memory_total_bytes=150_754_820_096,
        memory_used_bytes=4 * GiB,
        supported={"power": True, "memory": True, "temperature": True},
        field_errors={"temperature": pynvml.NVML_ERROR_UNKNOWN},
    )


class TwoGpus:
    """A GB10 (unified) next to a discrete GPU: every GPU family the exporter has."""

    def collect(self) -> GpuReport:
        report = gb10_report()
        return dataclasses.replace(report, devices=(*report.devices, h200(1)))


ENGINE_CONTAINER = ContainerFacts(
    id="4f" * 32,
    name="vllm-main",
    image="nvcr.io/nvidia/vllm:25.09-py3",
    state="running",
    pid=4242,
    restart_policy="unless-stopped",
    network_mode="host",
    labels={"com.docker.compose.project": "spark", "com.docker.compose.service": "vllm"},
)


def full_exposition(tmp_path: Path) -> list[Metric]:
    """Everything the exporter can publish at once: the golden scenario plus an outbox, a guard loop that ran and a
    discrete GPU with a failing field."""
    settings: Settings = build_scenario(tmp_path)
    telemetry = Telemetry(
        settings,
        gpu_source=TwoGpus(),
        wall_clock=lambda: FIXED_MTIME + 100.0,
        driver=stranded_driver,
        shm=shm_leftovers,
    )
    snap = zero_durations(telemetry.collect())
    boot = BootState(4242, "vllm", "Qwen/Qwen3-8B", "ready", FIXED_MTIME + 90.0, FIXED_MTIME, 61.5, 60 << 30, 58 << 30)
    serving = (
        EngineServing("vllm", 4242, "0.0.0.0:8000", "serving", 0, 0.041, FIXED_MTIME + 95.0),
        EngineServing(
            "llama.cpp", 5151, "127.0.0.1:8080", "wedged", 3, None, None, 40.0, "no answer within 10 s", counted=False
        ),
    )
    snap = dataclasses.replace(snap, boots=(boot,), serving=serving)
    stats = guard_stats()
    stats.last_loop_monotonic = 1.0
    stats.budgets = [BudgetStat(4242, "vllm", "Qwen/Qwen3-8B", 60 << 30, 55 << 30, "rss+gpu", 58 << 30, "launch")]
    kernel_log = StaticKernelLog(KernelLogStats(readable=True, lines_total=10, xid_total={79: 1}))
    registry = build_registry(
        settings, lambda: snap, StaticGuard(stats), StaticEvents(), StaticOutbox(), kernel_log=kernel_log
    )
    registry.register(
        InternalCollector(
            lambda: {"guard": {"sd_notify": {"notify_send_errors": 1}}, "telemetry": {"driver": {"errors": 2}}},
            lambda: {"guard": 23 << 20, "telemetry": 46 << 20},
            lambda: True,
            lambda: 1,
        )
    )
    registry.register(PostmortemCollector(lambda: Judged(BootEnd.DRIVER_NO_MEMORY, FIXED_MTIME, "a" * 32)))
    registry.register(GroupCollector(group_view))
    registry.register(PeerCollector(peer_view, lambda: 0.0))
    registry.register(
        GateCollector(lambda: (Gate("3f2a" * 16, "vllm-qwen", "nvcr.io/nvidia/vllm:25.09", 0.0, 0.0, 1),))
    )
    registry.register(ContainerCollector(lambda: [ENGINE_CONTAINER]))
    return list(registry.collect())


@dataclasses.dataclass
class StaticKernelLog:
    stats: KernelLogStats
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


def test_the_exporter_publishes_exactly_the_contract(tmp_path: Path) -> None:
    """Every family exported is in the one list with its type and labels, and every listed family is exported."""
    exported = {check_family(m).name for m in full_exposition(tmp_path)}
    missing = [m.name for m in METRICS if m.name not in exported]
    assert not missing, f"in the contract, never exported: {missing}"


def contract_section(title: str) -> str:
    text = CONTRACT.read_text(encoding="utf-8")
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/contract.md has no '## {title}' section"
    return match.group(1)


def generated_block(section: str, name: str) -> str:
    match = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", section, re.S)
    assert match, f"no {name}:begin/end markers"
    return match.group(1)


def test_the_document_holds_the_metrics_table() -> None:
    """docs/contract.md shows the list; it is not a second copy that can drift (regenerate with UPDATE_GOLDEN)."""
    section = contract_section("Metrics")
    want = {"metrics": markdown_table(), "presence": presence_table()}
    if UPDATE:
        text = CONTRACT.read_text(encoding="utf-8")
        for name, table in want.items():
            old = generated_block(section, name)
            text = text.replace(f"<!-- {name}:begin -->\n{old}", f"<!-- {name}:begin -->\n{table}")
        CONTRACT.write_text(text, encoding="utf-8")
        section = contract_section("Metrics")
    for name, table in want.items():
        assert generated_block(section, name) == table, f"docs/contract.md {name} table is stale"


# --- kill triggers ------------------------------------------------------------------------------------------------

RECOVERY_WORDS = {
    Recovery.ABOVE_FLOOR: "cancels it (MemAvailable above the floor at the re-read)",
    Recovery.FLOOR_FAR: "cancels it once the floor is 2 kill budgets away at its fill rate",
    Recovery.NEVER: "never cancels it",
}


def triggers_table() -> str:
    """core.kill.triggers' table as docs/contract.md shows it: one row per member, in the enum's order."""
    rows = [
        "| trigger | what it is | a pool that came back | its tree | a kill loop |",
        "|---|---|---|---|---|",
    ]
    for trigger in Trigger:
        spec = TRIGGERS[trigger]
        tree = "named by the request" if spec.names_tree else "chosen by the kill path's policy"
        loop = "counts" if spec.counts_toward_loop else "never counts"
        rows.append(f"| `{trigger}` | {spec.wording} | {RECOVERY_WORDS[spec.recovery]} | {tree} | {loop} |")
    return "\n".join(rows) + "\n"


def test_the_document_holds_the_triggers_table() -> None:
    """docs/contract.md lists every trigger the guard has, as core.kill.triggers declares them (regenerate with
    UPDATE_GOLDEN): the commit that added `wedged` missed a hand-typed list."""
    assert set(TRIGGERS) == set(Trigger)
    section = contract_section("Kill triggers")
    if UPDATE:
        text = CONTRACT.read_text(encoding="utf-8")
        old = generated_block(section, "triggers")
        CONTRACT.write_text(
            text.replace(f"<!-- triggers:begin -->\n{old}", f"<!-- triggers:begin -->\n{triggers_table()}")
        )
        section = contract_section("Kill triggers")
    assert generated_block(section, "triggers") == triggers_table(), "docs/contract.md triggers table is stale"


def test_every_trigger_is_exported_at_0_from_the_start(tmp_path: Path) -> None:
    """SparkwatchGuardKilled and SparkwatchGuardWouldKill take increase(): a series that appears at 1 is no increase,
    so a fresh guard exports every trigger's kill and would-kill counters at 0 (`wedged` once was not)."""
    from sparkwatch.common.stats import GuardStats

    registry = build_registry(build_scenario(tmp_path), lambda: None, StaticGuard(GuardStats()))
    for name in ("sparkwatch_guard_kills_total", "sparkwatch_guard_would_kills_total"):
        for trigger in Trigger:
            assert registry.get_sample_value(name, {"trigger": trigger}) == 0, (name, trigger)


def test_the_kill_alert_names_every_trigger() -> None:
    """The shipped alert's comment says which triggers start at 0: every one of the enum."""
    rules = (REPO / "sparkwatch" / "data" / "grafana" / "sparkwatch-alerts.yml").read_text(encoding="utf-8")
    match = re.search(r"- alert: SparkwatchGuardKilled\n(.*?)\n\s+expr:", rules, re.S)
    assert match
    assert set(re.findall(r"`([a-z_]+)`", match.group(1))) == {t.value for t in Trigger}


# --- events -------------------------------------------------------------------------------------------------------


def event_rows() -> dict[str, tuple[str, str]]:
    """kind -> (alert interval, journal priority) from the Events table."""
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \| (\d) \|", contract_section("Events"), re.M)
    return {kind: (interval.strip(), priority) for kind, interval, priority in rows}


def test_every_event_kind_is_documented_with_its_alerting_and_priority() -> None:
    rows = event_rows()
    assert set(rows) == {k.value for k in EventKind}
    minutes = {
        "every one": 0.0,
        "once per episode": 0.0,
        "5 min": 300.0,
        "15 min": 900.0,
        "30 min": 1800.0,
        "1 h": 3600.0,
    }
    for kind in EventKind:
        interval, priority = rows[kind]
        assert ALERT_MIN_INTERVAL_S.get(kind) == (None if interval == "no" else minutes[interval]), kind
        assert int(priority) == EVENT_PRIORITY.get(kind, PRIORITY_NOTICE), kind


def golden_kill() -> Event:
    """One real kill as the guard records it: a vLLM tree with a secret on its command line, taken at the floor."""

    def proc(pid: int, ppid: int, comm: str, argv: tuple[str, ...], rss: int) -> Proc:
        return Proc(pid, ppid, 1000, comm, "S", 4_200_000 + pid, rss, argv)

    root = proc(
        41234,
        1,
        "vllm",
        (
            "/opt/venv/bin/python3",
            "/opt/venv/bin/vllm",
            "serve",
            "Qwen/Qwen3-30B-A3B",
            "--api-key",
            "sk-live-0123456789",
        ),
        2 * GiB,
    )
    core = proc(41301, 41234, "VLLM::EngineCor", ("VLLM::EngineCore",), 61 * GiB)
    tree = EngineTree("vllm", root, (root, core))
    facts = KillFacts(
        trigger=Trigger.FLOOR,
        mem=MemInfo(127_600_748 * 1024, 4_839_424 * 1024, 3 * GiB, 0, 2 * GiB, 0, 0),
        floor_bytes=8 * GiB,
        fill_rate_bytes_per_s=1.42e10,
        dry_run=False,
        trees=(tree,),
        victims=victims_of((tree,)),
        detect_to_signal_ms=1.734,
        signal_to_reaped_ms=212.5,
        reclaimed_bytes=63 * GiB,
        victim_rss_bytes=63 * GiB,
        victim_gpu_bytes=71 * GiB,
        available_after_settle_bytes=66 * GiB,
        settle_s=1.0,
        why_this_tree=("grew 6.2 GiB in 4.0 s", "RSS 63.0 GiB, GPU 71.0 GiB"),
        ranking=(
            (41234, "vllm", ("grew 6.2 GiB in 4.0 s", "RSS 63.0 GiB, GPU 71.0 GiB")),
            (40001, "vllm", ("steady",)),
        ),
    )
    event = make_event(EventKind.KILL, kill_summary(facts), kill_fields(facts), ts=1_763_483_861.25, node="spark-a")
    # The id is made of the time and 12 random hex digits: fix the random part, check the shape.
    assert re.fullmatch(r"0019a97d44102[0-9a-f]{12}", event.id), event.id
    return dataclasses.replace(event, id="0019a97d44102c9e1d2f4a6b0")


def check_golden(name: str, data: object) -> None:
    path = GOLDEN / name
    text = json.dumps(data, indent=2, sort_keys=False) + "\n"
    if UPDATE:
        path.write_text(text, encoding="utf-8")
    golden = json.loads(path.read_text(encoding="utf-8"))
    assert golden == data, f"{name} changed: regenerate with SPARKWATCH_TEST_UPDATE_GOLDEN=1 and review the diff"


def test_golden_kill_event_as_events_jsonl_holds_it(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl")
    log.append(golden_kill())
    (line,) = (tmp_path / "events.jsonl").read_text(encoding="utf-8").splitlines()
    data = json.loads(line)
    check_golden("kill-event.json", data)
    assert "sk-live" not in line  # the secret on the command line never reaches the event
    assert [v["pid"] for v in data["victims"]] == [41234, 41301]


class Captured:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []


@pytest.fixture
def webhook() -> Iterator[tuple[str, Captured]]:
    captured = Captured()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            captured.requests.append((self.path, dict(self.headers.items()), body))
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hooks/T0/B1", captured
    finally:
        server.shutdown()
        server.server_close()


def test_golden_webhook_request_for_a_kill(tmp_path: Path, webhook: tuple[str, Captured]) -> None:
    """The POST a receiver gets for the golden kill: body = the event plus `text`, and the documented headers."""
    url, captured = webhook
    secret = "s3cret-hmac-key"
    outbox = Outbox(tmp_path / "outbox", url, secret, backoff_min_s=0.05, backoff_max_s=0.2)
    log = EventLog(tmp_path / "events.jsonl")
    log.subscribe(AlertRouter(outbox))
    outbox.start()
    try:
        log.append(golden_kill())
        assert wait_until(lambda: bool(captured.requests), 20, 0.05), "no delivery"
    finally:
        outbox.stop()
    path, headers, body = captured.requests[0]
    payload = json.loads(body)
    check_golden("webhook-kill.json", payload)
    assert path == "/hooks/T0/B1"
    event_line = json.loads((tmp_path / "events.jsonl").read_text(encoding="utf-8"))
    assert {k: v for k, v in payload.items() if k != "text"} == event_line  # the same JSON as events.jsonl
    assert payload["text"].startswith(":skull: sparkwatch on spark-a: Killed vllm")
    assert headers["Content-Type"] == "application/json"
    assert headers["User-Agent"] == f"sparkwatch/{__version__}"
    assert headers["X-Sparkwatch-Event-Id"] == "0019a97d44102c9e1d2f4a6b0"
    assert headers["X-Sparkwatch-Signature"] == "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    assert secret not in body.decode() and "sk-live" not in body.decode()


# --- the command line, the config keys, NVML ----------------------------------------------------------------------


def test_every_command_is_documented_with_its_exit_codes() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    commands = set(sub.choices or ())
    documented = set(re.findall(r"^\| `([a-z-]+)[ `]", contract_section("Command line"), re.M))
    assert commands == documented


def test_every_config_key_is_documented() -> None:
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", contract_section("Configuration"), re.M))
    assert documented == set(Settings.model_fields)


def test_doctor_checks_and_verdicts_are_documented() -> None:
    section = contract_section("doctor --json")
    assert re.findall(r"^\| `([a-z-]+)` \|", section, re.M) == CHECK_IDS
    verdicts = re.search(r"is one of\n?(.*?)\(", section, re.S)
    assert verdicts is not None
    assert re.findall(r"`([a-z_]+)`", verdicts.group(1)) == [v.value for v in DriverVerdict]
    assert re.findall(r"`([a-z]+)`", section.split("`status` is", 1)[1].split("(", 1)[0]) == list(CheckStatus)


def test_nvml_codes_are_pynvmls() -> None:
    for code in NvmlReturn:
        assert getattr(pynvml, f"NVML_{code.name}") == code.value, code


def test_memory_series_come_from_the_fresher_reading(tmp_path: Path) -> None:
    """The guard's MemAvailable (sent on change, 4 Hz near the floor) or telemetry's own (each cycle): the newer."""
    from sparkwatch.common.stats import GuardStats
    from sparkwatch.telemetry.exporter.collector import SparkwatchCollector

    settings: Settings = build_scenario(tmp_path)
    snap = Telemetry(settings, gpu_source=TwoGpus(), wall_clock=lambda: 1000.0).collect()
    guard_mem = dataclasses.replace(snap.mem, available_bytes=7 << 30) if snap.mem else None
    stats = GuardStats(mem=guard_mem, last_loop_monotonic=50.0)

    def available(now_mono: float, now_wall: float) -> float:
        collector = SparkwatchCollector(
            lambda: snap,
            settings=settings,
            guard=StaticGuard(stats),
            monotonic=lambda: now_mono,
            wall_clock=lambda: now_wall,
        )
        fam = next(m for m in collector.collect() if m.name == "sparkwatch_memory_available_bytes")
        return float(fam.samples[0].value)

    assert snap.mem is not None
    assert available(50.5, snap.ts + 2.0) == 7 << 30  # the guard read it 0.5 s ago, telemetry 2 s ago
    assert available(54.0, snap.ts + 0.5) == snap.mem.available_bytes  # the guard's is 4 s old
