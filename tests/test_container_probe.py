"""The serving probe of an engine in a container's own network namespace (telemetry/sources/listeners.py dial_of and
landed, telemetry/probewatch.py): it is asked at its own address there, never at our loopback, where another engine
(or nothing) holds the same port number; one out of reach is not_probed with the reason, never wedged.

Real containers under the session's own dockerd (tests/dockerd.py: bridge swd<N>, 172.29.N.1/24, `--iptables=false`,
so a published port goes through docker-proxy), each running the serving stand-in (tests/helpers/serving_engine.py)
titled as a vLLM server, beside a stand-in on the host at the same port number that answers otherwise.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from sparkwatch.common.sources.enginetrees import EngineFinder
from sparkwatch.core.engines.serving import ServingParams
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import EngineServing, EngineTree, Event
from sparkwatch.telemetry.probewatch import ProbeWatch
from sparkwatch.telemetry.sources.listeners import landed, on_link, parse_fib_local, table_listeners
from tests.daemon import free_port
from tests.dockerd import Dockerd, run_args
from tests.helpers.configs import guard_config_with
from tests.test_serving_probe import stand_in

PARAMS = ServingParams(interval_s=0.3, retry_s=0.2, timeout_s=1.0, failures_wedged=3)


# --- pure: the namespace's addresses and the host's routes


FIB_TRIE = """\
Main:
  +-- 0.0.0.0/0 3 0 5
     |-- 0.0.0.0
        /0 universe UNICAST
     +-- 127.0.0.0/8 2 0 2
        +-- 127.0.0.0/31 1 0 0
           |-- 127.0.0.0
              /8 host LOCAL
           |-- 127.0.0.1
              /32 host LOCAL
        |-- 127.255.255.255
           /32 link BROADCAST
     +-- 172.29.10.0/24 2 0 2
        +-- 172.29.10.0/30 2 0 2
           |-- 172.29.10.0
              /24 link UNICAST
           |-- 172.29.10.2
              /32 host LOCAL
        |-- 172.29.10.255
           /32 link BROADCAST
Local:
  +-- 0.0.0.0/0 3 0 5
           |-- 172.29.10.2
              /32 host LOCAL
"""

ROUTE = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    "eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
    "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
    "swd10\t000A1DAC\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
    "lo\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0\n"
    "eth0\t00001FAC\t0A0200C0\t0003\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
)


def test_a_namespaces_local_addresses_from_its_fib_trie() -> None:
    assert parse_fib_local(FIB_TRIE) == ["127.0.0.1", "172.29.10.2"]


@pytest.mark.parametrize(
    ("address", "iface"),
    [
        ("172.29.10.2", "swd10"),  # a bridge of the host's: reached directly
        ("192.0.2.7", "eth0"),
        ("172.31.0.2", None),  # only through a gateway: another host's namespace, maybe
        ("10.1.2.3", None),  # loopback route
        ("203.0.113.9", None),  # the default route goes through a gateway
    ],
)
def test_only_an_address_on_a_link_of_the_hosts_is_reached_directly(address: str, iface: str | None) -> None:
    assert on_link(ROUTE, address) == iface


# --- real containers


@dataclass
class ContainerEngine:
    name: str
    pid: int
    address: str  # its address on the bridge
    port: int  # in its own namespace
    requests: Path

    def seen(self) -> list[dict[str, object]]:
        if not self.requests.exists():
            return []
        return [json.loads(line) for line in self.requests.read_text().splitlines()]


@contextmanager
def container_engine(
    dockerd: Dockerd, tmp_path: Path, name: str, port: int, *, bind: str = "0.0.0.0", publish: int | None = None
) -> Iterator[ContainerEngine]:
    """The stand-in as a container's PID 1 on the bridge network, titled `vllm serve /models/m --port PORT`, bound
    to `bind`:PORT in the container's namespace; `publish`: `-p PUBLISH:PORT` (docker-proxy on the host)."""
    work = tmp_path / name
    work.mkdir(mode=0o777)
    flags = ["-v", f"{work}:/w"] + (["-p", f"{publish}:{port}"] if publish else [])
    argv = ["python3", "/src/tests/helpers/serving_engine.py", "--host", bind, "--requests", "/w/requests.log"]
    argv += ["--broken", "/w/broken", "--", "vllm", "serve", "/models/m", "--port", str(port)]
    dockerd.remove(name)
    dockerd.docker(*run_args(dockerd, name, *flags), *argv)
    try:
        pid = dockerd.container_pid(name)
        deadline = time.monotonic() + 20
        while not any(lst.port == port for lst in table_listeners("/proc", pid)):
            assert time.monotonic() < deadline, dockerd.docker("logs", name, check=False).stderr
            time.sleep(0.1)
        settings = dockerd.inspect(name)["NetworkSettings"]
        assert isinstance(settings, dict)
        yield ContainerEngine(name, pid, str(settings["IPAddress"]), port, work / "requests.log")
    finally:
        dockerd.remove(name)


def trees_of(*pids: int) -> tuple[EngineTree, ...]:
    finder = EngineFinder.from_settings(guard_config_with(), Path("/proc"), any_user=True)
    deadline = time.monotonic() + 10
    while True:
        trees = tuple(t for t in finder.find() if t.root.pid in pids and "vllm serve" in " ".join(t.root.argv))
        if len(trees) == len(pids) or time.monotonic() > deadline:
            assert len(trees) == len(pids), f"engine trees {[t.root.pid for t in trees]}, wanted {pids}"
            return trees
        time.sleep(0.1)


def probe_until(
    trees: tuple[EngineTree, ...], done: Callable[[dict[int, EngineServing]], bool], *, at_least_s: float = 0.0
) -> tuple[dict[int, EngineServing], list[Event]]:
    """The probe thread over these trees until `done(states by root pid)` holds (and at least `at_least_s` passed)."""
    events: list[Event] = []
    watch = ProbeWatch("/proc", PARAMS, on_event=events.append)
    t0 = time.monotonic()
    states: dict[int, EngineServing] = {}
    try:
        while time.monotonic() - t0 < 20:
            states = {s.root_pid: s for s in watch.observe(trees, ())}
            if done(states) and time.monotonic() - t0 >= at_least_s:
                return states, events
            time.sleep(0.1)
    finally:
        watch.stop()
    raise AssertionError(f"not done after 20 s: {states} {events}")


def wedged_roots(events: list[Event]) -> set[object]:
    return {e.fields.get("root_pid") for e in events if e.kind == EventKind.ENGINE_WEDGED}


@pytest.mark.docker
def test_a_published_container_engine_is_asked_at_its_own_address_not_at_the_hosts_port(
    dockerd: Dockerd, tmp_path: Path
) -> None:
    """`-p Q:P` and a failing engine on the host at P: each is asked at its own socket. Before, the container's
    engine was asked at 127.0.0.1:P, got the host engine's 500s and was called wedged."""
    port, published = free_port(), free_port()
    with (
        stand_in(tmp_path, "vllm", "serve", "/models/m", port=port) as host_engine,
        container_engine(dockerd, tmp_path, "sw-probe-published", port, publish=published) as boxed,
    ):
        host_engine.broken.write_text("500")
        trees = trees_of(host_engine.proc.pid, boxed.pid)

        def done(states: dict[int, EngineServing]) -> bool:
            mine, host = states.get(boxed.pid), states.get(host_engine.proc.pid)
            return mine is not None and mine.state == "serving" and host is not None and host.state == "wedged"

        states, events = probe_until(trees, done, at_least_s=2.5)
        mine = states[boxed.pid]
        assert mine.endpoint == f"{boxed.address}:{port}" and mine.failures == 0
        assert boxed.address.startswith(f"172.29.{dockerd.subnet_octet}.")
        assert wedged_roots(events) == {host_engine.proc.pid}  # the host's engine is wedged; the container's never
        assert {r["path"] for r in boxed.seen()} == {"/v1/completions"}
        # The landing check is what proves it: a connection to the container lands in its namespace, not the host's.
        with socket.create_connection((boxed.address, port), timeout=2) as sock:
            ours = sock.getsockname()[:2]
            assert landed("/proc", boxed.pid, (boxed.address, port), ours)
            assert not landed("/proc", host_engine.proc.pid, (boxed.address, port), ours)


@pytest.mark.docker
def test_a_container_engine_with_no_published_port_is_probed_through_the_bridge(
    dockerd: Dockerd, tmp_path: Path
) -> None:
    """Nothing published, nothing on the host's port: before, every probe was refused at 127.0.0.1 and a healthy
    engine was wedged."""
    port = free_port()
    with container_engine(dockerd, tmp_path, "sw-probe-bridge", port) as boxed:
        trees = trees_of(boxed.pid)
        states, events = probe_until(
            trees, lambda s: boxed.pid in s and s[boxed.pid].state == "serving", at_least_s=1.5
        )
        assert states[boxed.pid].endpoint == f"{boxed.address}:{port}" and events == []
        assert boxed.seen()


@pytest.mark.docker
def test_a_container_engine_on_its_own_loopback_is_not_probed_and_says_why(dockerd: Dockerd, tmp_path: Path) -> None:
    """Bound to 127.0.0.1 inside, a serving engine on the host at the same port: nothing of the host can reach the
    container's loopback, so it is not_probed, and the host's engine never answers for it (before, it did)."""
    port = free_port()
    with (
        stand_in(tmp_path, "vllm", "serve", "/models/m", port=port) as host_engine,
        container_engine(dockerd, tmp_path, "sw-probe-loopback", port, bind="127.0.0.1") as boxed,
    ):
        trees = trees_of(host_engine.proc.pid, boxed.pid)

        def done(states: dict[int, EngineServing]) -> bool:
            mine, host = states.get(boxed.pid), states.get(host_engine.proc.pid)
            return mine is not None and mine.state == "not_probed" and host is not None and host.state == "serving"

        states, events = probe_until(trees, done, at_least_s=1.5)
        mine = states[boxed.pid]
        assert f"127.0.0.1:{port} in its own network namespace" in mine.error, mine.error
        assert mine.failures == 0 and events == [] and boxed.seen() == []


def test_status_and_engines_show_why_an_engine_is_not_probed() -> None:
    from sparkwatch.cli.engines import serving_text as engines_text
    from sparkwatch.tui.status_view import serving_text as status_text

    why = "it listens on 127.0.0.1:8000 in its own network namespace (a container's), out of the host's reach"
    assert status_text(EngineServing("vllm", 7, "0.0.0.0:8000", "not_probed", error=why)) == f"not probed: {why}"
    row = {"state": "not_probed", "endpoint": "0.0.0.0:8000", "latency_s": None, "error": why}
    assert engines_text(row) == f"serving: not probed, {why}"


def test_a_not_probed_engine_has_no_serving_series() -> None:
    """Absent, like one not listening: a 0 would read as failing."""
    from sparkwatch.core.model import Snapshot
    from sparkwatch.telemetry.exporter.collector import _serving_families

    snap = Snapshot(ts=0.0, serving=(EngineServing("vllm", 7, "0.0.0.0:8000", "not_probed", error="out of reach"),))
    assert list(_serving_families(snap)) == []
