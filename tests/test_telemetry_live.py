"""The exporter live: a real `sparkwatch run` linted by promtool, scraped by a real Prometheus, and served over mTLS."""

from __future__ import annotations

import json
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Spawner, require_tool, wait_until
from tests.daemon import RunningDaemon, free_port, sparkwatch_run


def live_env(tmp_path: Path) -> dict[str, str]:
    return {
        "SPARKWATCH_FLOOR": "1GiB",  # the guard never fires here
        "SPARKWATCH_VLLM_CACHE_DIRS": f'["{tmp_path / "no-vllm-cache"}"]',
        "SPARKWATCH_TELEMETRY_INTERVAL_S": "0.5",
    }


def get(url: str, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=5, context=context) as resp:
        body: bytes = resp.read()
    return body.decode()


def scrape_when_ready(daemon: RunningDaemon) -> str:
    """The first scrape that carries a telemetry cycle (the endpoint is up before the first cycle ends)."""
    text = ""

    def ready() -> bool:
        nonlocal text
        text = get(f"http://127.0.0.1:{daemon.port}/metrics")
        return "sparkwatch_collector_success" in text

    assert wait_until(ready, 15, 0.1), text
    return text


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[RunningDaemon]:
    with sparkwatch_run(tmp_path, env=live_env(tmp_path)) as d:
        yield d


def test_live_exposition_passes_promtool(daemon: RunningDaemon, spawner: Spawner, tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    spawner.engine("--worker", "VLLM::Worker_TP0", "--compiler", pidfile=tmp_path / "tree.pids", wait_for=5)
    text = ""

    def cicc_count() -> float:
        found = re.search(r'^sparkwatch_compile_processes\{tool="cicc"\} ([0-9.]+)$', text, re.MULTILINE)
        return float(found.group(1)) if found else -1.0

    def engine_seen() -> bool:
        # The whole tree, and its cicc known as one: a cycle can catch the fake cicc before it took its title.
        # The census is node-wide, so on a shared box (another run compiling with nvcc) there may be more cicc.
        nonlocal text
        text = get(f"http://127.0.0.1:{daemon.port}/metrics")
        return 'sparkwatch_engine_processes{engine="vllm"} 5.0' in text and cicc_count() >= 1

    assert wait_until(engine_seen, 15, 0.2), text
    out = subprocess.run([promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert 'sparkwatch_collector_success{collector="procs"} 1.0' in text
    assert "sparkwatch_guard_kills_total" in text and "sparkwatch_build_info" in text


PROMETHEUS_CONFIG = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: sparkwatch
    scrape_interval: 1s
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


def test_real_prometheus_scrapes_sparkwatch(daemon: RunningDaemon, spawner: Spawner, tmp_path: Path) -> None:
    prometheus = require_tool("prometheus")
    scrape_when_ready(daemon)
    config = tmp_path / "prometheus.yml"
    config.write_text(PROMETHEUS_CONFIG.replace("{port}", str(daemon.port)))
    port = free_port()
    spawner.popen(
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def query(expr: str) -> list[dict[str, object]]:
        url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            data = json.loads(get(url))
        except (urllib.error.URLError, ConnectionError):
            return []
        result: list[dict[str, object]] = data["data"]["result"]
        return result

    assert wait_until(lambda: bool(query('up{job="sparkwatch"} == 1')), 40, 0.5), "Prometheus never scraped"
    for expr in (
        "sparkwatch_build_info",
        "sparkwatch_memory_available_bytes > 0",
        "sparkwatch_memory_floor_bytes == 1073741824",  # SPARKWATCH_FLOOR above
        'sparkwatch_collector_success{collector="procs"} == 1',
        'sparkwatch_guard_kills_total{trigger="floor"}',
        "sparkwatch_guard_kill_duration_seconds_bucket",
        'sparkwatch_compile_processes{tool="nvcc"}',
        "sparkwatch_memory_pressure_stalled_seconds_total",
    ):
        assert wait_until(lambda e=expr: bool(query(e)), 10, 0.5), f"no series for {expr}"  # type: ignore[misc]
    # rate() works on the counters across at least two scrapes
    time.sleep(2.5)
    assert query('rate(sparkwatch_guard_kills_total{trigger="floor"}[10s]) == 0')


def openssl(*args: str) -> None:
    subprocess.run([require_tool("openssl"), *args], check=True, capture_output=True, timeout=60)


def make_pki(d: Path) -> None:
    """A CA, a server and a client certificate with the extensions a strict verifier requires (Python 3.13 sets
    VERIFY_X509_STRICT by default: a CA without keyUsage, or a leaf without authorityKeyIdentifier, is refused)."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"), "-days", "2",
            "-subj", "/CN=sparkwatch test CA", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    leaf = "authorityKeyIdentifier=keyid,issuer\nkeyUsage=critical,digitalSignature\n"
    for name, cn in (("server", "127.0.0.1"), ("client", "prometheus")):
        openssl("req", *ec, "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"), "-subj", f"/CN={cn}")
        ext = d / f"{name}.ext"
        usage = (
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
            if name == "server"
            else ("extendedKeyUsage=clientAuth\n")
        )
        ext.write_text(leaf + usage)
        openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                "-CAcreateserial", "-out", str(d / f"{name}.pem"), "-days", "2", "-extfile", str(ext))  # fmt: skip


def mtls_env(pki: Path) -> dict[str, str]:
    """A daemon serving under mutual TLS with the certificates of make_pki."""
    return {
        "SPARKWATCH_TLS_CERT_FILE": str(pki / "server.pem"),
        "SPARKWATCH_TLS_KEY_FILE": str(pki / "server.key"),
        "SPARKWATCH_TLS_CLIENT_CA_FILE": str(pki / "ca.pem"),
    }


def test_mtls(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    pki.mkdir()
    make_pki(pki)
    env = {**live_env(tmp_path), **mtls_env(pki)}
    with sparkwatch_run(tmp_path, env=env) as d:
        url = f"https://127.0.0.1:{d.port}/metrics"
        with_cert = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with_cert.load_cert_chain(str(pki / "client.pem"), str(pki / "client.key"))
        assert wait_until(lambda: "sparkwatch_build_info" in get(url, with_cert), 15, 0.2)
        without = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            get(url, without)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            get(f"http://127.0.0.1:{d.port}/metrics")  # plain HTTP on a TLS port is no answer
