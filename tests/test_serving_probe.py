"""The serving probe (core/engines/serving.py, telemetry/probewatch.py, guard/wedgewatch.py) against real processes on
loopback: an engine stand-in whose health answers while its completions fail (tests/helpers/serving_engine.py), a
port owned by another process, an API key that must reach the engine and nothing else. The real engine's tests are in
tests/test_real_engine.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sparkwatch.common import logs
from sparkwatch.common.eventlog import read_events
from sparkwatch.config.settings import Settings, load_settings
from sparkwatch.core.engines import progress
from sparkwatch.core.engines import serving as core
from sparkwatch.core.engines.serving import Outcome, ProbeResult, Serving, ServingParams, ServingTrack
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.kill.killrecord import GroupLoss, KillFacts, WedgeStall, kill_reason
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import MemInfo
from sparkwatch.telemetry.loop import Telemetry
from sparkwatch.telemetry.probewatch import Wedged
from sparkwatch.telemetry.sources.completion import send_probe
from sparkwatch.telemetry.sources.listeners import parse_tcp_table
from tests.daemon import free_port, sparkwatch_run, wait_for_event

HELPER = Path(__file__).parent / "helpers" / "serving_engine.py"
PARAMS = ServingParams(interval_s=30.0, retry_s=5.0, timeout_s=10.0, failures_wedged=3)


# --- the schedule and what a run of results means (pure)


def _fail(ts: float) -> ProbeResult:
    return ProbeResult(Outcome.FAILED, ts, None, "HTTP 500")


def test_three_failures_in_a_row_wedge_an_engine_once_and_a_token_brings_it_back() -> None:
    track, change = core.step(ServingTrack(), ProbeResult(Outcome.OK, 100.0, 0.04), 0.0, PARAMS)
    assert track.state == Serving.SERVING and change is None and track.next_due == 30.0
    changes = []
    for i in range(5):
        track, change = core.step(track, _fail(130.0 + 5 * i), 30.0 + 5 * i, PARAMS)
        changes.append(change)
        assert track.next_due == 30.0 + 5 * i + PARAMS.retry_s  # faster after a failure
    assert [c is not None for c in changes] == [False, False, True, False, False]  # one engine_wedged
    assert changes[2] is not None and changes[2].since_ts == 130.0 and changes[2].failures == 3
    assert track.state == Serving.WEDGED and core.wedged_for_s(track, 160.0) == 30.0
    track, change = core.step(track, ProbeResult(Outcome.OK, 170.0, 0.05), 60.0, PARAMS)
    assert track.state == Serving.SERVING and change is not None and change.new == Serving.SERVING
    assert track.failures == 0 and core.wedged_for_s(track, 171.0) is None


@pytest.mark.parametrize("outcome", [Outcome.NOT_LISTENING, Outcome.UNAUTHORIZED])
def test_not_listening_or_a_key_refused_never_counts_as_a_failure(outcome: Outcome) -> None:
    track = ServingTrack()
    for i in range(10):
        track, change = core.step(track, ProbeResult(outcome, float(i)), float(i), PARAMS)
        assert change is None and track.failures == 0
    assert track.state == Serving.UNKNOWN


def test_a_booting_engine_is_never_wedged() -> None:
    track = ServingTrack()
    for i in range(10):
        track, change = core.step(track, _fail(float(i)), float(i), PARAMS, booting=True)
        assert change is None
    assert track.state == Serving.UNKNOWN and track.failures == 0


# --- busy is not wedged: the engine's own counters (core/engines/progress.py), pure

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0
vllm:generation_tokens_total{engine="1",model_name="a {b} c"} 6.0
vllm:generation_tokens_created{engine="0",model_name="m"} 1.7e+09
vllm:prompt_tokens_total{engine="0",model_name="m"} 5e+02
vllm:prompt_tokens_total{engine="1",model_name="m"} NaN
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3.0
"""


def test_the_progress_counters_of_each_engines_exposition() -> None:
    """Summed over label sets (a label value may hold braces and spaces); _created, buckets, NaN skipped."""
    vllm = progress.parse_counters(VLLM_METRICS)
    assert vllm == progress.Counters(
        "vllm", (("vllm:generation_tokens_total", 1240.0), ("vllm:prompt_tokens_total", 500.0)), 3.0
    )
    sglang = progress.parse_counters(
        'sglang:generation_tokens_total{model_name="m"} 9.0\n'
        'sglang:realtime_tokens_total{mode="decode",model_name="m",tp_rank="0"} 70.0\n'
        'sglang:realtime_tokens_total{mode="prefill_compute",model_name="m",tp_rank="0"} 30.0\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 4.0\n'
    )
    assert sglang == progress.Counters("sglang", (("sglang:realtime_tokens_total", 100.0),), 4.0)
    llama = progress.parse_counters(
        "# TYPE llamacpp:n_decode_total counter\nllamacpp:n_decode_total 332\nllamacpp:requests_processing 1\n"
        "llamacpp:tokens_predicted_total 4096\n"
    )
    assert llama == progress.Counters("llama.cpp", (("llamacpp:n_decode_total", 332.0),), 1.0)
    # Counters that move only when a request ends are no progress counters: an SGLang serving only them has none.
    assert progress.parse_counters('sglang:generation_tokens_total{model_name="m"} 9.0\n') is None
    assert progress.parse_counters('{"detail":"Not Found"}') is None and progress.parse_counters("") is None


def _failed_with(track: ServingTrack, ts: float, read: progress.MetricsRead) -> tuple[ServingTrack, core.Change | None]:
    return core.step(track, _fail(ts), ts, PARAMS, counters=read)


def _vllm_at(generated: float) -> progress.MetricsRead:
    return progress.MetricsRead(
        progress.Read.COUNTERS,
        progress.Counters("vllm", (("vllm:generation_tokens_total", generated), ("vllm:prompt_tokens_total", 9.0)), 6),
    )


def test_failed_probes_while_the_counters_move_are_busy_never_wedged() -> None:
    track = ServingTrack()
    for i in range(20):
        track, change = _failed_with(track, float(i), _vllm_at(100.0 + 40 * i))
        assert change is None and track.state != Serving.WEDGED and not track.killable
    assert track.state == Serving.BUSY and track.failures == 0 and track.moved == 40.0
    assert track.next_due == 19.0 + PARAMS.interval_s  # busy: the next look a whole interval away


def test_failed_probes_with_the_counters_stalled_wedge_it_and_only_then_is_it_killable() -> None:
    track = ServingTrack()
    looks = []
    for i in range(4):
        track, change = _failed_with(track, float(i), _vllm_at(500.0))
        looks.append((track.state, track.look, track.killable))
    assert looks == [
        (Serving.FAILING, progress.Look.FIRST, False),
        (Serving.FAILING, progress.Look.STALLED, False),
        (Serving.WEDGED, progress.Look.STALLED, True),
        (Serving.WEDGED, progress.Look.STALLED, True),
    ]
    unread = progress.MetricsRead(progress.Read.UNREAD, error="/metrics: no answer within 1 s")
    track, _change = _failed_with(track, 4.0, unread)
    assert track.state == Serving.WEDGED and not track.killable  # no proof at this look
    track, _change = _failed_with(track, 5.0, _vllm_at(500.0))
    assert track.killable and track.counters is not None
    assert progress.stall_words(track.counters) == "tokens generated stayed at 500"
    track, change = _failed_with(track, 6.0, _vllm_at(501.0))  # it moved again: busy, the wedge is over
    assert track.state == Serving.BUSY and change is not None and change.new == Serving.BUSY


def test_an_engine_without_counters_may_be_shown_wedged_and_is_never_killable() -> None:
    none = progress.MetricsRead(progress.Read.NONE, error="/metrics: HTTP 404")
    track = ServingTrack()
    for i in range(6):
        track, _change = _failed_with(track, float(i), none)
    assert track.state == Serving.WEDGED and track.uncounted and not track.killable


def _kill_facts(trigger: Trigger, **extra: object) -> KillFacts:
    mem = MemInfo(128 << 30, int(22.8 * (1 << 30)), 0, 0, 0, 0, 0)
    facts = KillFacts(trigger, mem, 4 << 30, 0.0, False, (), ())
    return replace(facts, **extra)  # type: ignore[arg-type]


def test_every_trigger_has_its_own_reason_and_a_wedge_is_not_the_floor() -> None:
    wedge = WedgeStall(3, 12.4, "no answer within 10 s", "vllm:generation_tokens_total", 1234.0)
    reasons = {
        "floor": kill_reason(_kill_facts(Trigger.FLOOR)),
        "predicted": kill_reason(_kill_facts(Trigger.PREDICTED, fill_rate_bytes_per_s=float(1 << 30))),
        "escalate": kill_reason(_kill_facts(Trigger.ESCALATE)),
        "hunt": kill_reason(_kill_facts(Trigger.HUNT)),
        "driver_alloc_failed": kill_reason(_kill_facts(Trigger.DRIVER_ALLOC_FAILED)),
        "budget": kill_reason(_kill_facts(Trigger.BUDGET, budget_bytes=1 << 30, footprint_bytes=2 << 30)),
        "group_teardown": kill_reason(
            _kill_facts(Trigger.GROUP_TEARDOWN, group=GroupLoss("pg1", "rank_died", "b", 7, ()))
        ),
        "wedged": kill_reason(_kill_facts(Trigger.WEDGED, wedge=wedge)),
    }
    assert len(set(reasons.values())) == len(reasons), reasons
    assert reasons["wedged"] == (
        "engine wedged: 3 probes failed over 12 s with no progress in its counters (tokens generated stayed at 1234)"
    )
    assert "floor" not in reasons["wedged"] and "MemAvailable" not in reasons["wedged"]


def test_endpoints_from_the_engines_command_lines() -> None:
    ep = core.endpoint_of
    assert ep(["vllm", "serve", "m"]) == core.Endpoint("0.0.0.0", 8000, "vllm")
    assert ep(["vllm", "serve", "m", "--port=8123", "--api_key", "k"]) == core.Endpoint(
        "0.0.0.0", 8123, "vllm", key_flag=True
    )
    assert ep(["python3", "-m", "sglang.launch_server", "--model-path", "m"]) == core.Endpoint(
        "127.0.0.1", 30000, "sglang"
    )
    assert ep(["./build/bin/llama-server", "-m", "x.gguf", "--host", "0.0.0.0"]) == core.Endpoint(
        "0.0.0.0", 8080, "llama-server"
    )
    assert ep(["python", "-m", "llama_cpp.server", "--model", "x.gguf"]) == core.Endpoint(
        "localhost", 8000, "llama_cpp.server"
    )
    assert ep(["vllm", "serve", "m", "--port", "99999"]) is None  # not a port: nothing to probe
    assert ep(["llama-cli", "-m", "x.gguf"]) is None and ep(["python", "train.py"]) is None
    assert core.endpoint_of_url("http://127.0.0.1:8001/v1") == core.Endpoint("127.0.0.1", 8001, "url")
    assert core.endpoint_of_url("http://[::1]:9/api/v1/completions") == core.Endpoint("::1", 9, "url", prefix="/api")
    assert core.endpoint_of_url("https://x:1") is None and core.endpoint_of_url("http://x") is None
    assert core.api_key_of(["vllm", "serve", "m"], {"VLLM_API_KEY": "e"}, "vllm") == "e"
    assert core.api_key_of(["vllm", "serve", "m", "--api-key=f"], {"VLLM_API_KEY": "e"}, "vllm") == "f"


def test_the_listen_table_parser_reads_ipv4_and_ipv6_wildcards() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1\n"
        "   1: 0100007F:1F41 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 4343 1\n"
    )
    v6 = (
        "  sl  local_address                         remote_address                        st\n"
        "   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 0:0 0:0 0 1000 0 77 1\n"
    )
    (a,) = parse_tcp_table(text)
    assert (a.address, a.port, a.inode, a.connect_host) == ("127.0.0.1", 8000, 4242, "127.0.0.1")
    (b,) = parse_tcp_table(v6)
    assert (b.address, b.port, b.inode, b.connect_host) == ("::", 8080, 77, "::1")


def test_sock_diag_and_the_proc_tables_name_the_same_listeners() -> None:
    """The probe asks the kernel through sock_diag (0.1 ms) where /proc/PID/net/tcp cost 4 ms a table: same answer."""
    import socket

    from sparkwatch.telemetry.sources.listeners import listeners, table_listeners

    with socket.socket() as v4, socket.socket(socket.AF_INET6) as v6:
        v4.bind(("127.0.0.1", 0))
        v4.listen(1)
        v6.bind(("::1", 0))
        v6.listen(1)
        fast = {(x.address, x.port, x.inode) for x in listeners("/proc", os.getpid())}
        slow = {(x.address, x.port, x.inode) for x in table_listeners("/proc", os.getpid())}
        ports = {v4.getsockname()[1], v6.getsockname()[1]}
    assert {p for _a, p, _i in fast} >= ports
    assert {x for x in fast if x[1] in ports} == {x for x in slow if x[1] in ports}


# --- a real stand-in on loopback


@dataclass
class StandIn:
    proc: subprocess.Popen[bytes]
    port: int
    requests: Path
    broken: Path

    def seen(self) -> list[dict[str, object]]:
        if not self.requests.exists():
            return []
        return [json.loads(line) for line in self.requests.read_text().splitlines()]


@contextmanager
def stand_in(
    tmp_path: Path, *engine: str, port: int | None = None, bind: bool = True, batch1_tok_s: float = 0.0
) -> Iterator[StandIn]:
    """The stand-in titled `engine` (its command line: `--port PORT` is added), serving on 127.0.0.1:PORT unless
    `bind` is false (then it sleeps, titled so, and owns no socket). `batch1_tok_s`: shaped as a vLLM engine with one
    sequence slot, generating that many tokens a second, with vLLM's /metrics (tests/helpers/serving_engine.py)."""
    port = port or free_port()
    requests, broken = tmp_path / f"requests-{port}.log", tmp_path / f"broken-{port}"
    cmd = [*engine, "--port", str(port)]
    shape = ["--batch1", str(batch1_tok_s)] if batch1_tok_s else []
    argv = [sys.executable, str(HELPER), "--requests", str(requests), "--broken", str(broken), *shape, "--", *cmd]
    if not bind:
        argv = [sys.executable, "-c", "import setproctitle,sys,time; setproctitle.setproctitle(sys.argv[1]); "
                "time.sleep(3600)", " ".join(cmd)]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE)
    try:
        if bind:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            assert b"listening" in line, line
        else:
            time.sleep(0.3)
        yield StandIn(proc, port, requests, broken)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def fast_settings(tmp_path: Path, **extra: object) -> Settings:
    return load_settings(
        None,
        {
            "ancestor_pid": os.getpid(),
            "state_dir": tmp_path / "state",
            "probe_interval_s": 0.3,
            "probe_retry_s": 0.2,
            "probe_timeout_s": 1.0,
            "probe_failures_wedged": 3,
            **extra,
        },
    )


def run_until(telemetry: Telemetry, done: object, timeout_s: float = 20.0) -> list[dict[str, object]]:
    """Telemetry cycles until `done(events so far)`; returns the events as their dicts."""
    events: list[dict[str, object]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        telemetry.collect()
        events += [e.to_json_dict() for e in telemetry.drain_events()]
        if done(events):  # type: ignore[operator]
            return events
        time.sleep(0.1)
    raise AssertionError(f"not done after {timeout_s} s: {events}")


def kinds(events: list[dict[str, object]]) -> list[object]:
    return [e["kind"] for e in events]


def test_health_answering_while_completions_fail_is_wedged_then_serving_again(tmp_path: Path) -> None:
    """/health and /v1/models answer 200 throughout; only the token tells. 500s, then a hang past the timeout."""
    telemetry = Telemetry(fast_settings(tmp_path))
    try:
        with stand_in(tmp_path, "vllm", "serve", "/models/m") as engine:
            serving = lambda ev: any(s.state == "serving" for s in telemetry.collect().serving)  # noqa: E731
            run_until(telemetry, serving)
            engine.broken.write_text("500")
            events = run_until(telemetry, lambda ev: EventKind.ENGINE_WEDGED in kinds(ev))
            wedged = next(e for e in events if e["kind"] == EventKind.ENGINE_WEDGED)
            assert wedged["root_pid"] == engine.proc.pid and wedged["failures"] == 3
            assert wedged["error"] == "HTTP 500" and wedged["endpoint"] == f"0.0.0.0:{engine.port}"
            assert engine.proc.poll() is None  # the process lives: up, not serving
            (state,) = telemetry.collect().serving
            assert state.state == "wedged" and state.wedged_for_s is not None
            engine.broken.unlink()
            events = run_until(telemetry, lambda ev: EventKind.ENGINE_SERVING_AGAIN in kinds(ev))
            assert kinds(events).count(EventKind.ENGINE_WEDGED) == 0  # once per wedge
            engine.broken.write_text("hang")
            events = run_until(telemetry, lambda ev: EventKind.ENGINE_WEDGED in kinds(ev))
            wedged = next(e for e in events if e["kind"] == EventKind.ENGINE_WEDGED)
            assert wedged["error"] == "no answer within 1 s"
            paths = {r["path"] for r in engine.seen()}
            # the probe asks for a token, never /health; after a failed one, the engine's own counters
            assert paths == {"/v1/completions", "/metrics"}
    finally:
        telemetry.close()


def test_the_probe_never_reaches_a_port_another_process_owns(tmp_path: Path) -> None:
    """An engine whose command line names a port it does not hold (it died and another server took it, or it has
    not bound yet): the server that does hold it is never asked, and the engine is not called wedged."""
    port = free_port()
    hits: list[str] = []

    class Other(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            hits.append(self.path)
            self.send_response(500)
            self.end_headers()

        def log_message(self, format: str, *a: object) -> None:
            pass

    other = ThreadingHTTPServer(("127.0.0.1", port), Other)  # this test's own process: not the engine's
    import threading

    threading.Thread(target=other.serve_forever, daemon=True).start()
    telemetry = Telemetry(fast_settings(tmp_path))
    try:
        with stand_in(tmp_path, "vllm", "serve", "/models/m", port=port, bind=False) as engine:
            deadline = time.monotonic() + 3.0
            events = []
            while time.monotonic() < deadline:
                snap = telemetry.collect()
                events += telemetry.drain_events()
                time.sleep(0.1)
            assert any(t.root.pid == engine.proc.pid for t in snap.engines)  # an engine the probe looked at
            assert telemetry.probes.probes_total == 0 and hits == [] and events == []
            assert all(s.state == "unknown" for s in snap.serving)
    finally:
        telemetry.close()
        other.shutdown()
        other.server_close()


def test_the_api_key_reaches_the_engine_and_nothing_else(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The key on the engine's command line goes in the probe's Authorization header; the events, the metrics and
    the log never carry it, in a wedge and back."""
    key = "sk-probe-secret-7f3a9c"
    telemetry = Telemetry(fast_settings(tmp_path))
    caplog.set_level("DEBUG", logger=logs.get("telemetry").name)
    try:
        with stand_in(tmp_path, "vllm", "serve", "/models/m", "--api-key", key) as engine:
            engine.broken.write_text("500")
            events = run_until(telemetry, lambda ev: EventKind.ENGINE_WEDGED in kinds(ev))
            engine.broken.unlink()
            events += run_until(telemetry, lambda ev: EventKind.ENGINE_SERVING_AGAIN in kinds(ev))
            snap = telemetry.collect()
            assert {r["auth"] for r in engine.seen()} == {f"Bearer {key}"}
            from sparkwatch.telemetry.exporter.server import build_registry, render

            exposition = render(build_registry(telemetry.settings, lambda: snap)).decode()
            assert f'sparkwatch_engine_serving{{engine="vllm",pid="{engine.proc.pid}"}} 1.0' in exposition
            assert "sparkwatch_engine_probe_latency_seconds" in exposition
            for text in (json.dumps(events), exposition, caplog.text, repr(snap.serving)):
                assert key not in text
    finally:
        telemetry.close()


def test_send_probe_holds_one_deadline_against_a_server_that_accepts_and_never_answers(tmp_path: Path) -> None:
    import socket

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        t0 = time.monotonic()
        answer = send_probe("127.0.0.1", srv.getsockname()[1], timeout_s=0.5)
        took = time.monotonic() - t0
    assert answer.outcome == Outcome.FAILED and answer.error == "no answer within 0.5 s"
    assert 0.4 < took < 2.0


# --- the daemon: engine_wedged recorded, and with kill_wedged_after_s the guard kills, trigger wedged


@contextmanager
def clients(port: int, count: int, max_tokens: int, **extra: object) -> Iterator[list[int]]:
    """`count` clients of the engine's API, each sending completions of `max_tokens` one after another until the
    block ends: a batch-1 engine's one slot is never free for long. Yields the answers' statuses as they come.
    `extra`: more of the request's fields (a real engine's `logit_bias`, to keep it from ending early)."""
    import threading
    import urllib.request

    stop, statuses = threading.Event(), []

    def client() -> None:
        body = json.dumps({"prompt": "Tell me a story", "max_tokens": max_tokens, **extra}).encode()
        while not stop.is_set():
            req = urllib.request.Request(  # a real engine's API (FastAPI) parses only a body said to be JSON
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as answer:
                    statuses.append(answer.status)
            except OSError:
                statuses.append(0)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    try:
        yield statuses
    finally:
        stop.set()
        for t in threads:
            t.join(10)  # each ends with its completion in flight: a few seconds of the slot


def test_a_busy_batch1_engine_is_never_wedged_and_a_frozen_one_is_handed_to_the_guard(tmp_path: Path) -> None:
    """The issue's attack: six clients keep a batch-1 engine's one slot busy, the probe waits past its timeout again
    and again. Its own counters move: busy, never engine_wedged, never handed to the guard. Then its generation
    stops (counters frozen, requests hang): wedged, and handed over with the counter that stayed."""
    handed: list[Wedged] = []
    telemetry = Telemetry(fast_settings(tmp_path, kill_wedged_after_s=0.5), on_wedged=handed.append)
    try:
        with stand_in(tmp_path, "vllm", "serve", "/models/m", batch1_tok_s=40) as engine:
            run_until(telemetry, lambda ev: any(s.state == "serving" for s in telemetry.collect().serving))
            seen: set[str] = set()
            with clients(engine.port, 6, max_tokens=40) as statuses:  # 1 s of the slot each: the probe waits
                deadline = time.monotonic() + 6.0
                events: list[dict[str, object]] = []
                while time.monotonic() < deadline:
                    seen |= {s.state for s in telemetry.collect().serving}
                    events += [e.to_json_dict() for e in telemetry.drain_events()]
                    time.sleep(0.1)
            assert statuses.count(200) >= 3, statuses  # the clients were served all along
            assert "busy" in seen and "wedged" not in seen, seen
            assert EventKind.ENGINE_WEDGED not in kinds(events) and handed == [], (events, handed)
            assert telemetry.probes.counter_reads_total >= 2  # the probe failed, and its counters were read
            engine.broken.write_text("freeze")
            # the probe itself takes the slot and hangs there; /metrics still answers, unmoved
            events = run_until(telemetry, lambda ev: EventKind.ENGINE_WEDGED in kinds(ev) and handed != [])
            wedged = next(e for e in events if e["kind"] == EventKind.ENGINE_WEDGED)
            assert wedged["killable"] is True and wedged["progress_counter"] == "vllm:generation_tokens_total"
            assert "its own counters did not move (tokens generated stayed at " in str(wedged["summary"]), wedged
            assert handed[0].counter == "vllm:generation_tokens_total" and handed[0].root_pid == engine.proc.pid
            assert engine.proc.poll() is None  # telemetry only names it: the guard decides
    finally:
        telemetry.close()


def test_an_engine_without_counters_is_shown_wedged_and_never_handed_to_the_guard(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No /metrics (404, as llama-cpp-python's server answers): a wedge cannot be told from busy there. It is shown
    wedged, says why, once in the log, and is never handed to the guard whatever kill_wedged_after_s says."""
    handed: list[Wedged] = []
    telemetry = Telemetry(fast_settings(tmp_path, kill_wedged_after_s=0.3), on_wedged=handed.append)
    caplog.set_level("WARNING", logger=logs.get("telemetry").name)
    try:
        with stand_in(tmp_path, "vllm", "serve", "/models/m") as engine:
            engine.broken.write_text("500")
            events = run_until(telemetry, lambda ev: EventKind.ENGINE_WEDGED in kinds(ev))
            wedged = next(e for e in events if e["kind"] == EventKind.ENGINE_WEDGED)
            assert wedged["killable"] is False and wedged["progress_counter"] is None
            assert "serves no progress counters: a wedge cannot be told from busy" in str(wedged["summary"])
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                snap = telemetry.collect()
                time.sleep(0.1)
            assert handed == [] and engine.proc.poll() is None
            (state,) = snap.serving
            assert state.state == "wedged" and state.counted is False
            from sparkwatch.telemetry.exporter.server import build_registry, render
            from sparkwatch.tui.status_view import serving_text

            exposition = render(build_registry(telemetry.settings, lambda: snap)).decode()
            assert f'sparkwatch_engine_progress_counters{{engine="vllm",pid="{engine.proc.pid}"}} 0.0' in exposition
            assert serving_text(state).endswith("; no progress counters: never killed as wedged"), serving_text(state)
            said = [r.getMessage() for r in caplog.records if "serves no progress counters" in r.getMessage()]
            assert said == [
                f"kill_wedged_after_s refused: engine {engine.proc.pid} (vllm) serves no progress counters: a wedge "
                "cannot be told from busy, it is never killed as wedged (no /metrics with them)"
            ]
    finally:
        telemetry.close()


@pytest.mark.slow
def test_the_daemon_never_kills_a_busy_engine_and_kills_a_wedged_one_for_its_wedge(tmp_path: Path) -> None:
    """With kill_wedged_after_s: six clients on a batch-1 engine (the issue's SIGKILL 9.4 s later) kill nothing; its
    generation frozen, the guard kills it, trigger wedged, and the kill line names the wedge, not the floor."""
    env = {
        "SPARKWATCH_PROBE_INTERVAL_S": "0.5",
        "SPARKWATCH_PROBE_RETRY_S": "0.3",
        "SPARKWATCH_PROBE_TIMEOUT_S": "1",
        "SPARKWATCH_PROBE_FAILURES_WEDGED": "2",
        "SPARKWATCH_KILL_WEDGED_AFTER_S": "2",
    }
    with (
        stand_in(tmp_path, "vllm", "serve", "/models/m", batch1_tok_s=40) as engine,
        sparkwatch_run(tmp_path, env=env) as d,
    ):
        time.sleep(1.5)
        assert engine.seen(), "the daemon never probed the engine"
        with clients(engine.port, 6, max_tokens=40):
            time.sleep(12.0)
        assert "/metrics" in {r["path"] for r in engine.seen()}  # probes failed: the counters were read
        busy_kinds = [e["kind"] for e in read_events(d.events_path)]
        assert EventKind.ENGINE_WEDGED not in busy_kinds and EventKind.KILL not in busy_kinds, busy_kinds
        assert engine.proc.poll() is None
        engine.broken.write_text("freeze")
        wedged = wait_for_event(d.events_path, EventKind.ENGINE_WEDGED, 30)
        assert wedged["root_pid"] == engine.proc.pid and wedged["killable"] is True
        kill = wait_for_event(d.events_path, EventKind.KILL, 30)
        assert kill["trigger"] == "wedged" and kill["progress_counter"] == "vllm:generation_tokens_total", kill
        summary = str(kill["summary"])
        assert (
            "engine wedged: " in summary and "with no progress in its counters (tokens generated stayed at" in summary
        )
        assert "floor" not in summary, summary
        assert engine.proc.wait(15) == -signal.SIGKILL
        assert any("wedged" in str(r) for r in kill["why"]), kill  # type: ignore[attr-defined]
    kinds_seen = [e["kind"] for e in read_events(d.events_path)]
    assert kinds_seen.count(EventKind.KILL) == 1, kinds_seen


# --- what people are shown: `engines` asks once, `status` shows the probe's last word


def _engines(tmp_path: Path, *args: str, command: tuple[str, ...] = ("engines", "--window", "0")) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(SPARKWATCH_ANCESTOR_PID=str(os.getpid()), SPARKWATCH_STATE_DIR=str(tmp_path / "state"))
    done = subprocess.run(
        [sys.executable, "-m", "sparkwatch", *command, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_engines_asks_each_engine_for_a_token(tmp_path: Path) -> None:
    with stand_in(tmp_path, "vllm", "serve", "/models/m") as engine:
        assert "serving: a token in " in _engines(tmp_path) and engine.seen()
        engine.broken.write_text("500")
        assert f"NOT SERVING: a one-token completion to 0.0.0.0:{engine.port} failed (HTTP 500)" in _engines(tmp_path)
        rows = json.loads(_engines(tmp_path, "--json"))["engines"]
        (row,) = [r for r in rows if r["root_pid"] == engine.proc.pid]
        assert row["serving"]["state"] == "not_serving" and row["serving"]["error"] == "HTTP 500"
        asked = len(engine.seen())
        assert "serving" not in _engines(tmp_path, "--no-probe") and len(engine.seen()) == asked
        engine.broken.unlink()
        status = _engines(tmp_path, command=("status", "--once"))
        assert f"vllm {engine.proc.pid} · " in status and "· serving (token in " in status, status


def test_status_shows_the_probes_word_on_the_engine_row() -> None:
    from sparkwatch.core.model import EngineServing
    from sparkwatch.tui.status_view import serving_text

    assert serving_text(EngineServing("vllm", 1, "0.0.0.0:8000", "serving", 0, 0.041)) == "serving (token in 41 ms)"
    wedged = EngineServing("vllm", 1, "0.0.0.0:8000", "wedged", 3, None, None, 90.0, "no answer within 10 s")
    assert serving_text(wedged) == "WEDGED for 1m30s: up but not serving, 3 probes failed (no answer within 10 s)"


# --- the guard's half: telemetry's word is checked again before anything is signalled


def test_the_guard_checks_a_wedge_itself_before_its_kill_path_kills(tmp_path: Path) -> None:
    """Off by default (kill_wedged_after_s 0: telemetry's word is only an event); with it set, only the named root
    with the same start time, the root of an engine tree by the guard's own rules, wedged at least that long, goes to
    the kill path; the kill path then kills it, trigger wedged, once."""
    from sparkwatch.common.eventlog import EventLog
    from sparkwatch.common.messages import WedgedMsg
    from sparkwatch.common.sources.procs import read_start_ticks
    from sparkwatch.config.schema import guard_config
    from sparkwatch.guard.poolwatch import PoolWatch
    from sparkwatch.guard.wedgewatch import WedgeWatch

    def guard(after_s: float) -> PoolWatch:
        settings = load_settings(
            None,
            {
                "state_dir": str(tmp_path / "state"),
                "ancestor_pid": os.getpid(),
                "postmortem": False,
                "floor": "1GiB",
                "mlock": False,
                "kernel_log_path": str(tmp_path / "no-kmsg"),
                "kill_wedged_after_s": after_s,
            },
        )
        return PoolWatch.build(guard_config(settings), EventLog(tmp_path / "events.jsonl"))

    with stand_in(tmp_path, "vllm", "serve", "/models/m") as engine, stand_in(tmp_path, "python3", "train.py") as other:
        ticks = read_start_ticks("/proc", engine.proc.pid) or 0
        msg = WedgedMsg("vllm", engine.proc.pid, ticks, 120.0, 3, "HTTP 500", "vllm:generation_tokens_total", 1234.0)
        off = guard(0.0)
        watch = WedgeWatch(lambda: off.snapshot, off.inbox.submit)
        assert not watch.handle(msg) and watch.off_total == 1
        pool = guard(60.0)
        pool.reaper.start()
        try:
            watch = WedgeWatch(lambda: pool.snapshot, pool.inbox.submit)
            assert not watch.handle(WedgedMsg("vllm", engine.proc.pid, ticks + 1, 120.0, 3))  # a reused pid
            assert not watch.handle(WedgedMsg("vllm", engine.proc.pid, ticks, 30.0, 3))  # not wedged long enough
            other_ticks = read_start_ticks("/proc", other.proc.pid) or 0
            assert not watch.handle(WedgedMsg("vllm", other.proc.pid, other_ticks, 120.0, 3))  # not an engine
            # A failed probe alone (no counter of the engine's own proved the stall), or a counter that is none of
            # the engines' progress counters: a busy engine gives the first, nothing of ours names the second.
            assert not watch.handle(WedgedMsg("vllm", engine.proc.pid, ticks, 120.0, 3, "no answer within 10 s"))
            assert not watch.handle(replace(msg, counter="MemAvailable <= floor"))
            assert watch.refused_total == 5 and engine.proc.poll() is None and other.proc.poll() is None
            assert watch.handle(msg) and watch.handle(msg)  # twice: the kill path kills it once
            assert engine.proc.poll() is None  # the check only asks: the kill path kills, on the guard's tick
            pool.tick()
            assert engine.proc.wait(10) == -signal.SIGKILL
            pool.tick()
        finally:
            pool.reaper.stop()
        events = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == EventKind.KILL]
        assert [e["trigger"] for e in events] == ["wedged"] and other.proc.poll() is None
        assert events[0]["progress_counter"] == "vllm:generation_tokens_total" and events[0]["failures"] == 3
        wedged = "engine wedged: 3 probes failed over 120 s with no progress in its counters (tokens generated stayed"
        assert f"{wedged} at 1234)" in str(events[0]["summary"]), events[0]


# --- launch --probe URL: an engine whose command line names no endpoint sparkwatch knows


@pytest.mark.slow
def test_launch_probe_url_makes_ready_the_first_token(tmp_path: Path) -> None:
    """An engine of kind `other` (no ready line, no port sparkwatch can read): `--probe URL` names where it serves;
    its first token is launch's time to first token and the guard's engine_ready."""
    from tests.launchbox import Box

    box = Box(tmp_path)
    port = free_port()
    requests, broken = tmp_path / "requests.log", tmp_path / "broken"
    engine = [sys.executable, str(HELPER), "--requests", str(requests), "--broken", str(broken), "--",
              "my-server", "--port", str(port)]  # fmt: skip
    err = tmp_path / "launch.err"
    with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as d, open(err, "wb") as fh:
        cmd = [sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", "--no-scope", "--budget",
               "1GiB", "--probe", f"http://127.0.0.1:{port}/v1", "--", *engine]  # fmt: skip
        proc = subprocess.Popen(cmd, env=box.env, stdout=subprocess.DEVNULL, stderr=fh)
        try:
            ready = wait_for_event(d.events_path, "engine_ready", 60)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    text = err.read_text()
    assert "answered its first token after" in text, text
    ttft = ready["seconds_to_first_token"]
    assert isinstance(ttft, float) and ttft > 0, ready
    assert {json.loads(line)["path"] for line in requests.read_text().splitlines()} == {"/v1/completions"}
    bad = subprocess.run(
        [*cmd[:7], "--probe", "https://x:1", "--", "true"], env=box.env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--probe" in bad.stderr
