"""Remote text is inert (issue 37): a string from Ray's state API or an engine's process title reaches a terminal with
its control characters cut and its rich markup printed as written.

A forged Ray state is served by a real HTTP server on loopback at the dashboard's state API paths, with escape
sequences (clear screen, an OSC 8 hyperlink, CSI 0x9b, BEL, backspace, a bidi override) and rich markup in every
string it controls; the engines are real processes titled the same way with setproctitle; `sparkwatch engines` runs
as a real command on a pseudo-terminal (colour on) and on a pipe.
"""

from __future__ import annotations

import fcntl
import http.server
import io
import json
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.table import Table
from rich.text import Text

from sparkwatch.core.redact import safe_text
from sparkwatch.telemetry.sources.raystate import RayStateSource
from sparkwatch.tui.console import emit
from tests.conftest import Spawner, wait_until
from tests.helpers.engine_tree import staged_engine

# What a forger writes: erase the screen, home the cursor, a hyperlink (OSC 8), CSI as the one C1 byte, BEL,
# backspace over what came before, a right-to-left override; and rich markup and an emoji code.
EVIL = (
    "\x1b[2J\x1b[H\x1b]8;;http://evil.example\x07\x9b2J\x08\x08\u202egnp.exe "
    "[red]RED[/red] [link=http://evil]L[/link] :fire:"
)
NODE_A = "a" * 56  # a node id as Ray writes them (hex); the forged one carries the sequences
NODE_EVIL = "b" * 8 + EVIL
# Every control character safe_text cuts, and rich's own colour sequences (on a terminal) that the check allows.
CONTROL = re.compile("[\x00-\x09\x0b\x0c\x0e-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
RICH_SGR = re.compile(r"\x1b\[[0-9;]*m")


def _rows(rows: list[dict[str, object]]) -> bytes:
    return json.dumps({"result": True, "data": {"result": {"result": rows}}}).encode()


FORGED = {
    "nodes": _rows(
        [
            {"node_id": NODE_A, "node_ip": "10.0.0.1", "state": "ALIVE"},
            {"node_id": NODE_EVIL, "node_ip": "10.0.0.2" + EVIL, "state": "ALIVE"},
        ]
    ),
    "jobs": _rows(
        [
            {
                "job_id": "01000000" + EVIL,
                "status": "RUNNING",
                "driver_info": {"pid": "4242", "node_ip_address": "10.0.0.1"},
            }
        ]
    ),
    "actors": _rows(
        [
            {
                "actor_id": "a1",
                "class_name": "RayWorkerWrapper" + EVIL,
                "state": "ALIVE" + EVIL,
                "job_id": "01000000" + EVIL,
                "node_id": NODE_A,
                "pid": 4343,
                "placement_group_id": "pg1" + EVIL,
            },
            {
                "actor_id": "a2",
                "class_name": "RayWorkerWrapper",
                "state": "ALIVE",
                "job_id": "01000000" + EVIL,
                "node_id": NODE_EVIL,
                "pid": 4444,
                "placement_group_id": "pg1" + EVIL,
            },
        ]
    ),
    "placement_groups": _rows(
        [
            {
                "placement_group_id": "pg1" + EVIL,
                "creator_job_id": "01000000" + EVIL,
                "state": "CREATED",
                "bundles": [{"node_id": NODE_A}, {"node_id": NODE_EVIL}],
            }
        ]
    ),
}


class _ForgedState(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        name = path.removeprefix("/api/v0/")
        body = FORGED.get(name) if path.startswith("/api/v0/") else None
        self.send_response(200 if body is not None else 404)
        body = body or b"{}"
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def forged_dashboard() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ForgedState)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from _strings(getattr(value, name))


def _assert_inert(out: str) -> None:
    """No control character but line ends (and, on a terminal, rich's own colours); the markup as written."""
    plain = RICH_SGR.sub("", out).replace("\r\n", "\n")
    assert not CONTROL.findall(plain), [line for line in plain.splitlines() if CONTROL.search(line)]
    assert "[red]RED[/red]" in plain and "[link=http://evil]L[/link]" in plain and ":fire:" in plain
    assert "\U0001f525" not in plain  # no emoji made of :fire:


def test_ray_state_strings_are_cleaned_as_they_are_parsed(forged_dashboard: str) -> None:
    source = RayStateSource(forged_dashboard)
    try:
        state = source.poll()
    finally:
        source.close()
    strings = list(_strings(state))
    assert any("RayWorkerWrapper" in s and "[red]RED[/red]" in s for s in strings)  # the forged text is there
    assert [s for s in strings if s != safe_text(s)] == []
    (pg,) = state.placement_groups
    assert pg.node_ids == (NODE_A, safe_text(NODE_EVIL))  # a bundle's node id too


def test_a_view_prints_markup_as_written_and_no_escape_on_a_terminal_or_a_pipe() -> None:
    """tui.console is the terminal's last line of defence: a str cell is never markup, and text rich is handed with
    an escape sequence in it (here a Text built past every source's cleaning) prints it as `?`."""
    table = Table()
    table.add_column("NAME")
    table.add_row("[red]RED[/red] [link=http://evil]L[/link] :fire:")
    table.add_row(Text("title" + EVIL))
    pipe = io.StringIO()
    emit(table, pipe)
    _assert_inert(pipe.getvalue())
    master, slave = pty.openpty()
    try:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 300, 0, 0))
        with open(slave, "w", closefd=False) as tty:
            emit(table, tty)
        os.close(slave)
        slave = -1
        out = _read_all(master)
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    assert "\x1b[" in out  # a terminal: rich drew its colours
    _assert_inert(out)


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _fake_raylet(spawner: Spawner, tmp_path: Path) -> subprocess.Popen[bytes]:
    """A process this test started, at Ray's raylet path (comm `raylet`), naming this node's id as a raylet does."""
    exe = tmp_path / "ray" / "core" / "src" / "ray" / "raylet" / "raylet"
    exe.parent.mkdir(parents=True)
    shutil.copy(os.path.realpath(sys.executable), exe)
    raylet = spawner.popen(
        [str(exe), "-c", "import time; time.sleep(120)", f"--node_id={NODE_A}", "--node_ip_address=10.0.0.1"]
    )
    assert wait_until(lambda: f"--node_id={NODE_A}".encode() in Path(f"/proc/{raylet.pid}/cmdline").read_bytes(), 10)
    return raylet


def _engines_on_a_terminal(env: dict[str, str]) -> str:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 400, 0, 0))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparkwatch", "engines", "--no-probe", "--window", "0"],
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            env=env,
        )
        os.close(slave)
        slave = -1
        out = _read_all(master)
        assert proc.wait(60) == 0, out
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)
    return out


def test_engines_prints_forged_ray_state_and_titles_inert(
    spawner: Spawner, tmp_path: Path, forged_dashboard: str
) -> None:
    _fake_raylet(spawner, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env |= {"SPARKWATCH_ANCESTOR_PID": str(os.getpid()), "SPARKWATCH_RAY_DASHBOARD_URL": forged_dashboard}
    with staged_engine(title="VLLM::EngineCore " + EVIL, children=("VLLM::Worker_TP0 " + EVIL,), env=env):
        on_tty = _engines_on_a_terminal(env)
        piped, as_json = (
            subprocess.run(
                [sys.executable, "-m", "sparkwatch", "engines", *flags, "--no-probe", "--window", "0"],
                capture_output=True, text=True, env=env, timeout=60, check=True,
            ).stdout
            for flags in ((), ("--json",))
        )  # fmt: skip
    for out in (on_tty, piped):
        assert "Groups over Ray" in out and "RayWorkerWrapper" in out and "VLLM::EngineCore" in out, out
        _assert_inert(out)
    assert "\x1b]8;" not in on_tty  # no hyperlink of the forger's (nor of rich's markup)
    doc = json.loads(as_json)
    assert doc["groups"] and doc["engines"]
    assert [s for s in _strings(doc) if CONTROL.search(s)] == []
