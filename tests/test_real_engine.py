"""A real engine under sparkwatch: llama.cpp through llama-cpp-python's OpenAI-compatible server (`python -m
llama_cpp.server`), built from source on CPU, serving SmolLM2-135M-Instruct (tests/realengine.py; scripts/real-engine
builds it once into /var/tmp). Every line, socket, token and byte of KV cache below is the engine's own.

- launch → its boot phases from its own lines → `engine_ready` with the first real token (time to first token);
- the engine's own KV allocation (`--n_ctx 65536`: llama.cpp zeroes 1.6 GiB when the context is made) past a budget:
  the guard kills it, trigger `budget`, and launch exits 137 with the guard's line;
- SIGSTOP: the process lives, its socket accepts, no token comes: `engine_wedged` within the probe window, and
  `engine_serving_again` after SIGCONT; never killed, even with `kill_wedged_after_s`: llama-cpp-python's server
  serves no progress counters (no /metrics), so a wedge cannot be told from busy there;
- busy: clients keep its one model busy, the probe waits past its timeout; /metrics answers 404: shown wedged, with
  why, and never killed with `kill_wedged_after_s` set (issue 37);
- its GGUF header, read past its arrays, gives the plan its KV cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.checkpoint import gguf_metadata
from sparkwatch.telemetry.sources.completion import send_probe
from tests import realengine
from tests.conftest import require
from tests.daemon import free_port, scrape, sparkwatch_run, wait_for_event
from tests.launchbox import Box, box_for

pytestmark = [pytest.mark.real_engine, pytest.mark.slow]

FAST_PROBE = {
    "SPARKWATCH_PROBE_INTERVAL_S": "1",
    "SPARKWATCH_PROBE_RETRY_S": "0.5",
    "SPARKWATCH_PROBE_TIMEOUT_S": "1",
    "SPARKWATCH_PROBE_FAILURES_WEDGED": "2",
}


@pytest.fixture(scope="module")
def engine() -> realengine.RealEngine:
    found, why = realengine.find()
    require(found is not None, why)
    assert found is not None
    return found


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    yield from box_for(tmp_path)


def serving_value(port: int, pid: int) -> str | None:
    prefix = f'sparkwatch_engine_serving{{engine="llama.cpp",pid="{pid}"}} '
    return next((line[len(prefix) :] for line in scrape(port).splitlines() if line.startswith(prefix)), None)


def wait_until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def launch(box: Box, tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`sparkwatch launch` with its output in a file: the engine writes 216 KB to stderr as it boots, and a pipe
    nobody reads would stop launch (and the engine) when it fills."""
    err = tmp_path / "launch.err"
    cmd = [sys.executable, "-m", "sparkwatch", "launch", "--settle-timeout", "0", "--no-scope", *args]
    with open(err, "wb") as fh:
        return subprocess.Popen(cmd, env=box.env, stdout=subprocess.DEVNULL, stderr=fh), err


def start_engine(engine: realengine.RealEngine, port: int, tmp_path: Path, n_ctx: int = 512) -> subprocess.Popen[bytes]:
    with open(tmp_path / f"engine-{port}.log", "wb") as log:  # the child keeps its own copy of the fd
        return subprocess.Popen(engine.server(port, "--n_ctx", str(n_ctx)), stdout=log, stderr=log)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(30)


def test_the_real_models_header_gives_the_plan_its_kv_cache(engine: realengine.RealEngine) -> None:
    """The reader stopped at `general.languages arr[str,1]` (key 8): the plan said "KV cache unknown"."""
    meta = gguf_metadata(engine.model)
    assert meta["layers"] == 30 and meta["kv_heads"] == 3 and meta["hidden_size"] == 576 and meta["head_dim"] == 64


def test_launch_shows_the_real_boot_and_engine_ready_comes_with_the_first_token(
    engine: realengine.RealEngine, box: Box, tmp_path: Path
) -> None:
    port = free_port()
    with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as d:
        proc, err_path = launch(box, tmp_path, "--", *engine.server(port, "--n_ctx", "512"))
        try:
            ready = wait_for_event(d.events_path, "engine_ready", 120)
            answer = send_probe("127.0.0.1", port, timeout_s=10)  # it serves: a token from outside too
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    err = err_path.read_text(errors="replace")
    assert answer.outcome == "ok", answer
    for line in ("phase loading_weights", "phase profiling", "llama.cpp is ready after", "answered its first token"):
        assert line in err, (line, err[-3000:])
    ttft, to_ready, phases = ready["seconds_to_first_token"], ready["seconds_to_ready"], ready["phases"]
    assert isinstance(ttft, float) and isinstance(to_ready, float) and isinstance(phases, list), ready
    assert ttft >= to_ready > 0, ready  # the token came after the ready line
    assert [p["phase"] for p in phases] == ["starting", "loading_weights", "profiling", "ready"]
    started = wait_for_event(d.events_path, "engine_started")
    assert started["root_pid"] == ready["root_pid"]


def test_the_engines_own_kv_allocation_past_its_budget_is_killed(
    engine: realengine.RealEngine, box: Box, tmp_path: Path
) -> None:
    """`--n_ctx 65536`: llama.cpp zeroes its whole KV cache (1.6 GiB) when it makes the context; the budget, 600 MiB,
    is past the idle engine (about 230 MiB at n_ctx 2048) and far under that."""
    port = free_port()
    with sparkwatch_run(tmp_path, env={"XDG_RUNTIME_DIR": str(box.run_dir)}) as d:
        proc, err_path = launch(
            box, tmp_path, "--force", "--budget", "600MiB", "--", *engine.server(port, "--n_ctx", "65536")
        )
        proc.wait(180)
        kill = wait_for_event(d.events_path, "kill", 30)
    err = err_path.read_text(errors="replace")
    assert proc.returncode == 137, err[-3000:]
    assert kill["trigger"] == "budget", kill
    assert "the guard killed llama.cpp" in err and "trigger budget" in err, err[-2000:]
    assert "phase profiling" in err  # killed while the context (and its KV cache) was made


@pytest.mark.parametrize("kill_after", [None, 2.0])
def test_a_stopped_engine_is_wedged_and_serves_again_never_killed_without_counters(
    engine: realengine.RealEngine, tmp_path: Path, kill_after: float | None
) -> None:
    """SIGSTOP: the kernel still accepts connections on its socket, no token comes. Not killed: SIGCONT brings it
    back. Not even with kill_wedged_after_s: its counters cannot be read (it serves none; stopped, nothing answers),
    so its stall is never proven."""
    env = dict(FAST_PROBE)
    if kill_after is not None:
        env["SPARKWATCH_KILL_WEDGED_AFTER_S"] = str(kill_after)
    port = free_port()
    proc = start_engine(engine, port, tmp_path)
    try:
        with sparkwatch_run(tmp_path, env=env) as d:
            wait_until(lambda: serving_value(d.port, proc.pid) == "1.0", 120, "serving")
            stopped_at = time.monotonic()
            os.kill(proc.pid, signal.SIGSTOP)
            wedged = wait_for_event(d.events_path, "engine_wedged", 30)
            took = time.monotonic() - stopped_at
            assert wedged["root_pid"] == proc.pid and wedged["failures"] == 2
            assert wedged["error"] == "no answer within 1 s"
            # the probe window: the next probe (<= 1 s), two timeouts (1 s each), a retry (0.5 s), a cycle (1 s): 4.5 s,
            # with room for a loaded box
            assert took < 12.0, took
            assert serving_value(d.port, proc.pid) == "0.0" and wedged["killable"] is False
            time.sleep(1.0 if kill_after is None else kill_after + 3.0)
            assert proc.poll() is None
            os.kill(proc.pid, signal.SIGCONT)
            again = wait_for_event(d.events_path, "engine_serving_again", 30)
            wedged_s = again["wedged_s"]
            assert again["root_pid"] == proc.pid and isinstance(wedged_s, float) and wedged_s > 0, again
            wait_until(lambda: serving_value(d.port, proc.pid) == "1.0", 30, "serving again")
            assert "kill" not in [e["kind"] for e in read_events(d.events_path)]
    finally:
        stop(proc)


def test_a_busy_engine_that_serves_no_counters_is_never_killed_as_wedged(
    engine: realengine.RealEngine, tmp_path: Path
) -> None:
    """The issue's attack on the real engine: clients keep its one model busy (llama-cpp-python serves one completion
    at a time), the probe waits past its timeout again and again. Its /metrics answers 404: no counters tell busy from
    wedged, so kill_wedged_after_s is refused for it, with the reason, and it lives."""
    from tests.test_serving_probe import clients

    env = {**FAST_PROBE, "SPARKWATCH_KILL_WEDGED_AFTER_S": "1"}
    port = free_port()
    proc = start_engine(engine, port, tmp_path)
    try:
        with sparkwatch_run(tmp_path, env=env) as d:
            wait_until(lambda: serving_value(d.port, proc.pid) == "1.0", 120, "serving")
            # 256 tokens each, never ended early (SmolLM2's end tokens, <|endoftext|> 0 and <|im_end|> 2, biased
            # away: a story it ended after a few tokens left the slot free for the probe): seconds each at one CPU
            # thread, and the probe's 1 s runs out behind them
            with clients(port, 4, max_tokens=256, logit_bias={"0": -100, "2": -100}):
                wedged = wait_for_event(d.events_path, "engine_wedged", 60)
                assert wedged["root_pid"] == proc.pid and wedged["killable"] is False, wedged
                assert "serves no progress counters: a wedge cannot be told from busy" in str(wedged["summary"])
                time.sleep(4.0)  # kill_wedged_after_s 1 s, four times over
                prefix = f'sparkwatch_engine_progress_counters{{engine="llama.cpp",pid="{proc.pid}"}} '
                assert prefix + "0.0" in scrape(d.port).splitlines()
            assert proc.poll() is None
            assert "kill" not in [e["kind"] for e in read_events(d.events_path)]
    finally:
        stop(proc)


@pytest.mark.pressure
def test_the_engines_own_kv_allocation_under_the_floor_is_killed(engine: realengine.RealEngine, tmp_path: Path) -> None:
    """The floor, not a budget: 800 MiB under MemAvailable now, and the engine's own 1.6 GiB KV cache (n_ctx 65536,
    zeroed as the context is made) crosses it. The guard kills the engine, trigger floor or predicted."""
    from sparkwatch.core.units import GiB, MiB
    from tests.conftest import settled_available_bytes

    available = settled_available_bytes()
    if available < 4 * GiB:
        pytest.skip(f"only {available >> 20} MiB available; this test wants 4 GiB")
    floor = available - 800 * MiB
    port = free_port()
    with sparkwatch_run(tmp_path, env={"SPARKWATCH_FLOOR": f"{floor}B"}) as d:
        proc = start_engine(engine, port, tmp_path, n_ctx=65536)
        try:
            kill = wait_for_event(d.events_path, "kill", 120)
            assert proc.wait(30) == -signal.SIGKILL
        finally:
            stop(proc)
    assert kill["trigger"] in ("floor", "predicted"), kill
    victims = kill["victims"]
    assert isinstance(victims, list) and victims[0]["pid"] == proc.pid, kill
