"""Live: a real `sparkwatch run`, a real Prometheus scraping it every second, a real Alertmanager, a loopback webhook.

- Every query of the dashboard (panels and annotations) is sent, variables substituted the way Grafana does, to
  Prometheus' /api/v1/query: each must parse and return data, except the ones listed in EMPTY_OK with the reason
  (no GPU here, no kill on purpose), and even those only when a series they need is really absent from sparkwatch's
  exposition.
- Every alert rule expression parses and evaluates, and every series selector in it matches series.
- The real rule file (with `for:` cut to 0 s) and the example alertmanager.yml route a firing SparkwatchDown (a
  second, dead target) through Prometheus and Alertmanager to the webhook.

The engine is tests/helpers/fake_engine.py: a real process titled VLLM::EngineCore (as vLLM sets it) holding a
ninja -> nvcc -> cicc chain; the JIT cache is a flashinfer-shaped directory. The guard floor is 1 MiB and its scope
is this test's process tree, so it can never fire.
"""

from __future__ import annotations

import gc
import http.server
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from tests.conftest import Spawner, require_tool
from tests.grafana_support import (
    ALERTS,
    ASSETS,
    Query,
    dashboard_queries,
    load_dashboard,
    metric_names,
    rule_queries,
    selectors,
    substitute,
)
from tests.launchbox import Box, fitting_util, small_args, small_model

pytestmark = pytest.mark.slow

SCRAPES_BEFORE_QUERYING = 8  # 1 s apart: enough for rate() over 4 s and increase() over the 20 s "range"
RATE_INTERVAL = "4s"  # what Grafana computes for $__rate_interval with a 1 s scrape interval: 4 x scrape
INTERVAL = "1s"
RANGE = "20s"

NO_GPU = "no NVIDIA GPU here: NVML series are absent, never 0 (docs/contract.md); checked on the H200 capture instead"
# What a whole `sparkwatch run` exported on a real H200 host (captured through the device tool; its tests hold it to
# the contract): the second node of the side-by-side checks, and the one with a GPU.
H200_EXPOSITION = Path(__file__).resolve().parent / "fixtures" / "gpu" / "h200-daemon-metrics.prom"
NO_NEXT_BOOT = "no NVIDIA packages here: whether the next kernel has modules is unknown, so the series is absent"
NO_KILL = "the guard never fires in this test (floor 1 GiB): guard_last_kill_timestamp_seconds appears with a kill"

# Queries that may return nothing here, and why. Each is accepted empty only if one of the sparkwatch_* series it
# reads is absent from sparkwatch's own /metrics (so a wrong label or a broken join still fails), except the
# annotation, which is empty by logic: it matches kills, and there are none.
NO_PROBE = "no engine here serves an endpoint (tests/test_serving_probe.py and test_real_engine.py scrape them)"
NO_RAY = "no Ray cluster here: the group series appear only where a raylet runs (tests/test_ray_group.py scrapes them)"
EMPTY_OK: dict[str, str] = {
    "panel 'Last kill' A": NO_KILL,
    "panel 'GPU power and utilization during boot' A": NO_GPU,
    "panel 'GPU power and utilization during boot' B": NO_GPU,
    "panel 'GPU power' A": NO_GPU,
    "panel 'GPU utilization' A": NO_GPU,
    "panel 'GPU temperature' A": NO_GPU,
    "panel 'SM clock' A": NO_GPU,
    "panel 'GPU energy rate' A": NO_GPU,
    "panel 'Next boot' A": NO_NEXT_BOOT,
    "panel 'Serving' A": NO_PROBE,
    "panel 'Time to a token' A": NO_PROBE,
    "panel 'Groups over Ray' A": NO_RAY,
    "panel 'Groups over Ray' B": NO_RAY,
    "panel 'Ray nodes' A": NO_RAY,
    "panel 'Engines in containers' A": "no engine runs in a container here (tests/test_container_labels.py scrapes "
    "sparkwatch_container_info from a real dockerd's)",
}
EMPTY_BY_LOGIC: dict[str, str] = {
    "annotation 'Guard kills'": "no kill happens in this test (floor 1 GiB), and the annotation marks kills",
    "panel 'GPU Xid events' A": "no Xid happens in this test, and the panel shows only codes that occurred (> 0)",
}
# Series a rule reads that may be absent here (same reasons); every other selector of every rule must match.
ABSENT_OK: dict[str, str] = {
    "sparkwatch_driver_next_boot_ok": NO_NEXT_BOOT,
    "sparkwatch_memory_warn_headroom_bytes": "exporters older than the gauge (the H200 capture): 4 GiB default",
    # No webhook_url in this test: the outbox series appear only with one (tests/test_outbox.py scrapes them).
    "sparkwatch_alerts_pending": "no webhook_url configured here",
    "sparkwatch_alert_delivery_failures_total": "no webhook_url configured here",
    "sparkwatch_engine_serving": NO_PROBE,
    "sparkwatch_group_dead_members": NO_RAY,
    "sparkwatch_ray_node_up": NO_RAY,
    "sparkwatch_peer_lost": "no peers configured here (tests/test_peers.py and test_ray_group.py have them)",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def wait_until(what: str, predicate: Any, timeout_s: float, procs: list[subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + timeout_s
    last = "none"
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, (
                f"{cast('list[str]', p.args)[0]} exited with {p.returncode} while waiting for {what}"
            )
        try:
            value = predicate()
            if value:
                return value
        except (OSError, ValueError, KeyError) as exc:
            # Keep the text, not the exception: a stored exception is a cycle (its traceback holds this frame),
            # and an HTTPError in it holds an open socket until a later GC pass finds it, inside whichever test runs
            # then, as an unraisable ResourceWarning (CI failed on exactly that, in a Grafana test).
            last = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, urllib.error.HTTPError):
                exc.close()
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last error: {last})")


class Webhook:
    """A loopback HTTP receiver that queues every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.received: queue.Queue[dict[str, Any]] = queue.Queue()
        received = self.received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                received.put(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/sparkwatch"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class StaticExposition:
    """Serves a captured exposition at /metrics, like a second node would."""

    def __init__(self, text: bytes) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.instance = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Stack:
    prometheus: str  # base URL
    instance: str  # the live sparkwatch target
    dead_instance: str
    gpu_instance: str  # serves H200_EXPOSITION
    metrics_text: str  # one scrape of sparkwatch's /metrics, for the absent-series checks
    webhook: Webhook
    last_phase_at: float  # when the launched engine entered its last boot phase (time.time())

    def query(self, expr: str) -> dict[str, Any]:
        url = f"{self.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            body = http_get(url)
        except urllib.error.HTTPError as exc:  # 400 with a JSON error for a bad expression
            with exc:
                body = exc.read()
        data: dict[str, Any] = json.loads(body)
        return data

    def exported(self, metric: str) -> bool:
        return any(
            line.startswith((metric + " ", metric + "{"))
            for line in self.metrics_text.splitlines()
            if not line.startswith("#")
        )


def spawn(spawner: Spawner, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return spawner.popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


def write_jit_cache(base: Path) -> None:
    """A flashinfer cache as flashinfer writes it: <base>/.cache/flashinfer/<version>/121a/cached_ops/<module>/."""
    module = base / ".cache" / "flashinfer" / "0.4.1" / "121a" / "cached_ops" / "batch_decode"
    module.mkdir(parents=True)
    sources = ["batch_decode", "batch_decode_kernel", "decode_config", "page"]
    lines = [
        "ninja_required_version = 1.3",
        "builddir = .",
        "nvcc = /usr/local/cuda/bin/nvcc",
        "cuda_cflags = -gencode=arch=compute_121a,code=sm_121a -O3",
        "rule cuda_compile",
        "  command = $nvcc $cuda_cflags -c $in -o $out",
        "rule link",
        "  command = c++ $in -shared -o $out",
        *(f"build $builddir/{s}.cuda.o: cuda_compile /src/flashinfer/csrc/{s}.cu" for s in sources),
        "build batch_decode.so: link " + " ".join(f"{s}.cuda.o" for s in sources),
    ]
    (module / "build.ninja").write_text("\n".join(lines) + "\n")
    for s in sources[:2]:  # half built: progress 2 of 4
        (module / f"{s}.cuda.o").write_bytes(b"\x7fELF" + b"\0" * 4092)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    prometheus_bin = require_tool("prometheus")
    alertmanager_bin = require_tool("prometheus-alertmanager")
    tmp = tmp_path_factory.mktemp("live")
    spawner = Spawner()  # the shared helper: at teardown it SIGKILLs exactly what it started, and their descendants
    procs: list[subprocess.Popen[bytes]] = []
    webhook = Webhook()
    servers: list[StaticExposition] = []
    try:
        # --- an engine tree with a compiler in it, and a JIT cache
        home = tmp / "home"
        home.mkdir()
        write_jit_cache(home)
        # ninja -> nvcc -> cicc under a VLLM::EngineCore, as flashinfer's JIT runs inside vLLM
        engine = spawner.engine("--title", "VLLM::EngineCore", "--compiler", pidfile=tmp / "engine.pids", wait_for=4)
        procs.append(engine)

        # --- sparkwatch, and an engine it will know by declaration (`sparkwatch launch`, below)
        (tmp / "launch").mkdir()
        box = Box(tmp / "launch")
        port = free_port()
        instance = f"127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        env.update(
            SPARKWATCH_ANCESTOR_PID=str(os.getpid()),
            SPARKWATCH_FLOOR="1GiB",
            SPARKWATCH_MLOCK="false",
            # No journal to read: the previous boot is `unknown`, so the "Previous boot" annotation has a series.
            SPARKWATCH_POSTMORTEM_JOURNAL_DIR=str(tmp / "no-journal"),
            HOME=str(home),
            XDG_CONFIG_HOME=str(tmp / "config"),
            XDG_STATE_HOME=str(tmp / "state"),
            FLASHINFER_WORKSPACE_BASE=str(home),
            XDG_RUNTIME_DIR=str(box.run_dir),  # where `sparkwatch launch` declares its engines
        )
        argv = [sys.executable, "-m", "sparkwatch", "run", "--listen", instance, "--state-dir", str(tmp / "sw")]
        sparkwatch = spawn(spawner, argv, tmp / "sparkwatch.log", env)
        procs.append(sparkwatch)
        metrics_url = f"http://{instance}/metrics"
        # Wait for a snapshot that already holds the engine (the telemetry loop runs about every second).
        wait_until(
            "sparkwatch to export the test engine",
            lambda: b'sparkwatch_engine_processes{engine="vllm"}' in http_get(metrics_url),
            30,
            procs,
        )

        # --- Alertmanager with the example config, pointed at the loopback webhook
        am_config = yaml.safe_load((ASSETS / "alertmanager.yml").read_text(encoding="utf-8"))
        for receiver in am_config["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = webhook.url
        am_config["route"]["group_wait"] = "1s"  # the example waits 10 s to batch; the routing is what is tested
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am_config))
        am_port = free_port()
        alertmanager = spawn(
            spawner,
            [
                alertmanager_bin,
                f"--config.file={tmp / 'alertmanager.yml'}",
                f"--storage.path={tmp / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
            tmp / "alertmanager.log",
        )
        procs.append(alertmanager)

        # --- Prometheus: the real rules with `for:` cut to 0 s, sparkwatch at 1 s, and a dead second target
        rules = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))
        for group in rules["groups"]:
            for rule in group["rules"]:
                rule.pop("for", None)
        (tmp / "alerts.yml").write_text(yaml.safe_dump(rules))
        dead_instance = f"127.0.0.1:{free_port()}"
        gpu = StaticExposition(H200_EXPOSITION.read_bytes())
        servers.append(gpu)
        prom_config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "alerts.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [
                {"job_name": "sparkwatch", "static_configs": [{"targets": [instance, dead_instance, gpu.instance]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_config))
        prom_port = free_port()
        prometheus = spawn(
            spawner,
            [
                prometheus_bin,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
            tmp / "prometheus.log",
        )
        procs.append(prometheus)
        base = f"http://127.0.0.1:{prom_port}"
        wait_until("Alertmanager ready", lambda: http_get(f"http://127.0.0.1:{am_port}/-/ready"), 20, procs)
        wait_until("Prometheus ready", lambda: http_get(f"{base}/-/ready"), 20, procs)

        def scrapes() -> bool:
            expr = f'count_over_time(sparkwatch_build_info{{instance="{instance}"}}[1m])'
            url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            result = json.loads(http_get(url))["data"]["result"]
            return bool(result) and float(result[0]["value"][1]) >= SCRAPES_BEFORE_QUERYING

        wait_until(f"{SCRAPES_BEFORE_QUERYING} scrapes", scrapes, 40, procs)

        # --- a launched, budgeted engine that boots while Prometheus scrapes (its phases about a second apart), so
        # the boot timeline, the footprint against its budget and the boot-phase annotation have real series
        model = small_model(tmp / "launch")
        launch = [sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", "--budget", "auto", "-q",
                  "--", *small_args(model, fitting_util()), "--phase-s", "1"]  # fmt: skip
        procs.append(spawner.popen(launch, env=box.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def booted() -> bytes | None:
            text = http_get(metrics_url)
            wanted = (b"sparkwatch_engine_ready_seconds{", b"sparkwatch_engine_footprint_bytes{")
            return text if all(w in text for w in wanted) else None

        metrics = wait_until(
            "the launched engine to be ready, with its footprint measured against its budget", booted, 60, procs
        )
        last_phase_at = time.time()
        wait_until(f"{SCRAPES_BEFORE_QUERYING} scrapes of it", lambda: ready_scraped(base), 40, procs)
        yield Stack(base, instance, dead_instance, gpu.instance, metrics.decode(), webhook, last_phase_at)
    finally:
        spawner.cleanup()
        webhook.close()
        for server in servers:
            server.close()
        for name in ("sparkwatch.log", "prometheus.log", "alertmanager.log"):
            log = tmp / name
            if log.exists():
                sys.stderr.write(f"--- {name} (last lines)\n" + "\n".join(log.read_text().splitlines()[-15:]) + "\n")


def ready_scraped(base: str) -> bool:
    expr = "count_over_time(sparkwatch_engine_ready_seconds[1m])"
    result = json.loads(http_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))["data"]["result"]
    return bool(result) and float(result[0]["value"][1]) >= SCRAPES_BEFORE_QUERYING


def grafana_substitute(expr: str, stack: Stack) -> str:
    return substitute(
        expr, job="sparkwatch", instance=stack.instance, rate_interval=RATE_INTERVAL, interval=INTERVAL, range_=RANGE
    )


def test_every_dashboard_query_parses_and_returns_data(stack: Stack) -> None:
    queries = dashboard_queries(load_dashboard())
    assert len(queries) >= 35
    problems: list[str] = []
    empty_explained: list[str] = []
    for q in queries:
        expr = grafana_substitute(q.expr, stack)
        assert "$" not in expr, f"{q.where}: a variable was left unsubstituted: {expr}"
        answer = stack.query(expr)
        if answer.get("status") != "success":
            problems.append(f"{q.where}: {answer.get('error')} in {expr}")
            continue
        result = answer["data"]["result"]
        if result:
            # The job/instance filter really selected the live node: never the dead target, never another job.
            for series in result:
                labels = series["metric"]
                assert labels.get("instance", stack.instance) == stack.instance, f"{q.where}: {labels}"
            continue
        if q.where in EMPTY_BY_LOGIC:
            empty_explained.append(q.where)
            continue
        if q.where == "annotation 'Boot phases'" and time.time() - stack.last_phase_at > 55:
            empty_explained.append(q.where)  # it marks phase changes within the last minute, and that minute passed
            continue
        absent = sorted(n for n in metric_names(q.expr) if not stack.exported(n))
        if q.where in EMPTY_OK and absent:
            empty_explained.append(q.where)
            continue
        reason = f"(absent from the exposition: {absent})" if absent else "(its series are all exported)"
        problems.append(f"{q.where}: no data {reason}: {expr}")
    assert not problems, "\n".join(problems)
    # Most of the dashboard must show real data on any Linux box: the pool, the guard, the boot row, sparkwatch.
    assert len(queries) - len(empty_explained) >= 30, empty_explained


def test_the_gpu_panels_show_a_real_gpu(stack: Stack) -> None:
    """The panels allowed empty for want of a GPU here return data on the series a real H200 exported."""
    gpu_queries = [q for q in dashboard_queries(load_dashboard()) if EMPTY_OK.get(q.where) == NO_GPU]
    assert len(gpu_queries) >= 7
    for q in gpu_queries:
        expr = substitute(
            q.expr,
            job="sparkwatch",
            instance=stack.gpu_instance,
            rate_interval=RATE_INTERVAL,
            interval=INTERVAL,
            range_=RANGE,
        )
        result = stack.query(expr)["data"]["result"]
        assert result, f"{q.where}: no data from the H200 exposition: {expr}"
        assert all(r["metric"].get("instance", stack.gpu_instance) == stack.gpu_instance for r in result)
    # And the pool's GPU band is the H200's per-process bytes, not the 0 fallback.
    pool = next(p for p in load_dashboard()["panels"] if p["title"].startswith("Unified pool"))
    gpu_band = next(t["expr"] for t in pool["targets"] if t["legendFormat"] == "GPU processes")
    expr = substitute(gpu_band, job="sparkwatch", instance=stack.gpu_instance, rate_interval="", interval="", range_="")
    value = float(stack.query(expr)["data"]["result"][0]["value"][1])
    assert value == 4838129664.0  # sparkwatch_gpu_process_memory_bytes{pid="486"} in the capture


def test_two_nodes_side_by_side(stack: Stack) -> None:
    """With both nodes selected ($instance = All), the pool, guard and GPU queries return one series set per node."""
    titles = ("Headroom above the floor", "Fill rate", "Memory pressure (PSI)", "Guard mode", "Scrape up")
    for q in dashboard_queries(load_dashboard()):
        if not any(q.where.startswith(f"panel {t!r}") for t in titles) and not q.where.startswith("panel 'Unified"):
            continue
        expr = substitute(
            q.expr,
            job="sparkwatch",
            instance=[stack.instance, stack.gpu_instance],
            rate_interval=RATE_INTERVAL,
            interval=INTERVAL,
            range_=RANGE,
        )
        instances = {r["metric"].get("instance") for r in stack.query(expr)["data"]["result"]}
        assert instances == {stack.instance, stack.gpu_instance}, f"{q.where}: {instances} from {expr}"


def test_the_variable_queries_find_the_node(stack: Stack) -> None:
    """label_values(sparkwatch_build_info, job) and (…{job=~"$job"}, instance), as Grafana asks for them."""
    url = f"{stack.prometheus}/api/v1/label/job/values?" + urllib.parse.urlencode({"match[]": "sparkwatch_build_info"})
    assert json.loads(http_get(url))["data"] == ["sparkwatch"]
    match = 'sparkwatch_build_info{job=~"sparkwatch"}'
    url = f"{stack.prometheus}/api/v1/label/instance/values?" + urllib.parse.urlencode({"match[]": match})
    # Both nodes; the dead target exports nothing, so it is not offered as a node.
    assert sorted(json.loads(http_get(url))["data"]) == sorted([stack.instance, stack.gpu_instance])


def test_the_pool_stack_adds_up_to_memtotal(stack: Stack) -> None:
    """The four stacked bands of the pool panel sum to MemTotal (within a scrape's drift)."""
    pool = next(p for p in load_dashboard()["panels"] if p["title"].startswith("Unified pool"))
    bands = [t["expr"] for t in pool["targets"][:4]]
    total_expr = " + on (job, instance) ".join(f"({grafana_substitute(b, stack)})" for b in bands)
    total = float(stack.query(total_expr)["data"]["result"][0]["value"][1])
    mem_total = float(
        stack.query(f'sparkwatch_memory_total_bytes{{instance="{stack.instance}"}}')["data"]["result"][0]["value"][1]
    )
    assert abs(total - mem_total) <= 0.02 * mem_total, (total, mem_total)


def test_every_rule_expression_evaluates_and_its_series_exist(stack: Stack) -> None:
    problems: list[str] = []
    for q in rule_queries():
        answer = stack.query(q.expr)
        if answer.get("status") != "success":
            problems.append(f"{q.where}: {answer.get('error')}")
        for sel in selectors(q.expr):
            name = sel.split("{")[0]
            if name in ABSENT_OK and not stack.exported(name):
                continue
            if not stack.query(f"group({sel})")["data"]["result"]:
                problems.append(f"{q.where}: selector {sel} matches no series")
    assert not problems, "\n".join(problems)


def test_a_firing_rule_reaches_the_webhook_through_alertmanager(stack: Stack) -> None:
    """SparkwatchDown on the dead target: Prometheus evaluates it, Alertmanager routes it, the webhook gets it."""
    deadline = time.monotonic() + 30
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            payload = stack.webhook.received.get(timeout=1)
        except queue.Empty:
            continue
        seen.append(payload)
        for alert in payload.get("alerts", []):
            labels = alert["labels"]
            if labels.get("alertname") == "SparkwatchDown" and labels.get("instance") == stack.dead_instance:
                assert alert["status"] == "firing"
                assert payload["receiver"] == "sparkwatch-webhook"
                assert labels["severity"] == "critical" and labels["job"] == "sparkwatch"
                assert stack.dead_instance in alert["annotations"]["summary"]
                assert "systemctl --user status sparkwatch" in alert["annotations"]["description"]
                return
    pytest.fail(f"no SparkwatchDown for {stack.dead_instance} reached the webhook; got {seen}")


def test_queries_cover_every_panel() -> None:
    """The live test must see every panel's query: none hides in a place dashboard_queries() does not read."""
    dash = load_dashboard()
    n_targets = sum(len(p.get("targets", [])) for p in dash["panels"])
    n_annotations = sum(1 for a in dash["annotations"]["list"] if "expr" in a)
    assert len(dashboard_queries(dash)) == n_targets + n_annotations
    assert all(isinstance(q, Query) for q in dashboard_queries(dash))


def test_wait_until_leaves_no_open_socket_behind() -> None:
    """Prometheus and Alertmanager answer 503 while they start. wait_until must not keep that HTTPError (its open
    response) in a cycle for a later GC pass: pytest then fails whichever test is running, as it did once in CI."""

    class Starting(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(503)
            self.send_header("Content-Length", "8")
            self.end_headers()
            self.wfile.write(b"starting")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Starting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/-/ready"
        with pytest.raises(AssertionError, match="503"):
            wait_until("ready", lambda: http_get(url), 0.6, [])
    finally:
        server.shutdown()
        server.server_close()
    gc.collect()  # an unclosed socket found here is an unraisable ResourceWarning: an error under filterwarnings
