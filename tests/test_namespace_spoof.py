"""Protection by executable holds only in the initial namespaces (core.engines.identity.protected_by_system).

Issue 20: as a non-root user, `unshare -Urm sh -c 'mount --bind /usr/bin/python3 /usr/bin/systemd-cat && exec
/usr/bin/systemd-cat engine.py'` makes /proc/PID/exe read /usr/bin/systemd-cat: the engine vanished from
`engines --all` and could never be killed. Here that user is real (`nobody`, uid 65534, through setpriv), the
namespaces are real (unshare), the engine is a real python3 whose title is VLLM::EngineCore (bash's `exec -a`), and
the guard that kills it is a real daemon. Root only; skipped where user namespaces are disabled.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.core.engines.identity import EngineRules, Scope, find_engine_trees, is_protected
from tests.conftest import floor_that_fires_at_once
from tests.daemon import sparkwatch_run, wait_for_event
from tests.receiver import wait_until

SPOOFED = "/usr/bin/systemd-cat"
TITLE = "VLLM::EngineCore"
SPOOF = f"mount --bind /usr/bin/python3 {SPOOFED} && exec -a {TITLE} {SPOOFED} -c 'import time; time.sleep(120)'"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("setpriv", "unshare", "bash")),
    reason="needs root, setpriv, unshare and bash to act as an unprivileged user",
)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def spoofed_engine() -> Iterator[subprocess.Popen[bytes]]:
    """An engine of `nobody`'s whose /proc/PID/exe reads /usr/bin/systemd-cat. The same pid all the way down:
    setpriv, unshare (no --fork: user and mount namespaces need none) and bash each exec the next."""
    if not Path(SPOOFED).is_file() or not Path("/usr/bin/python3").exists():
        pytest.skip(f"needs {SPOOFED} and /usr/bin/python3 to stage the spoof")
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "unshare", "-Urm", "bash", "-c", SPOOF]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    titled = wait_until(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(TITLE.encode()), 10)
    if not titled:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        pytest.skip(f"unprivileged user and mount namespaces unavailable here: {err.decode(errors='replace')[-200:]}")
    yield proc
    if proc.poll() is None:
        proc.kill()  # the process this test started
    proc.communicate(timeout=10)


def test_the_spoof_is_real_and_the_scanner_sees_through_it(spoofed_engine: subprocess.Popen[bytes]) -> None:
    proc = ProcScanner().read_proc(spoofed_engine.pid)
    assert proc is not None and proc.uid == 65534
    assert proc.exe == SPOOFED  # what the kernel shows: the bind mount works
    assert proc.outside_initial_ns
    rules = EngineRules.build()
    assert not is_protected(proc, rules)
    scan = ProcScanner().scan().procs
    trees = find_engine_trees(scan, rules, Scope(self_pid=os.getpid(), own_uid=0, ancestor_pid=os.getpid()))
    assert [(t.kind, t.root.pid) for t in trees] == [("vllm", spoofed_engine.pid)]


def test_engines_lists_the_spoofed_engine(spoofed_engine: subprocess.Popen[bytes], tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(SPARKWATCH_ANCESTOR_PID=str(os.getpid()), XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    res = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "engines", "--json", "--window", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    roots = [e["root_pid"] for e in json.loads(res.stdout)["engines"]]
    assert roots == [spoofed_engine.pid]


def test_the_guard_kills_the_spoofed_engine(spoofed_engine: subprocess.Popen[bytes], tmp_path: Path) -> None:
    env = {
        "SPARKWATCH_FLOOR": f"{floor_that_fires_at_once()}B",
        "SPARKWATCH_REARM_HEADROOM": "1MiB",
        "SPARKWATCH_MLOCK": "false",
    }
    with sparkwatch_run(tmp_path, env=env) as d:
        assert wait_until(lambda: spoofed_engine.poll() is not None, 30), d.stderr_lines[-10:]
        kill = wait_for_event(d.events_path, "kill")
    assert spoofed_engine.returncode == -signal.SIGKILL
    victims = kill["victims"]
    assert isinstance(victims, list) and spoofed_engine.pid in [v["pid"] for v in victims]


def test_a_protected_binary_in_the_initial_namespaces_stays_protected(tmp_path: Path) -> None:
    """The control: a real tmux server, started here, in this box's own namespaces."""
    tmux = shutil.which("tmux")
    if tmux is None or not tmux.startswith("/usr/"):
        pytest.skip("needs tmux in /usr")
    socket_name = f"sw-ns-{os.getpid()}"
    server = 0
    subprocess.run([tmux, "-L", socket_name, "-f", "/dev/null", "new-session", "-d", "sleep 120"], check=True)
    try:
        out = subprocess.run(
            [tmux, "-L", socket_name, "display-message", "-p", "#{pid}"], capture_output=True, text=True, check=True
        )
        server = int(out.stdout.strip())
        proc = ProcScanner().read_proc(server)
        assert proc is not None and proc.exe is not None and proc.exe.endswith("/tmux")
        assert not proc.outside_initial_ns
        assert is_protected(proc, EngineRules.build())
    finally:
        subprocess.run([tmux, "-L", socket_name, "kill-server"], check=False)
        deadline = time.monotonic() + 5
        while server and time.monotonic() < deadline and alive(server):
            time.sleep(0.05)
