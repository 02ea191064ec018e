"""What another user can forge in the state dir: a root daemon must not trust a state dir, outbox or event file that
is not its own, and never deliver a spool file it did not write (common.durable's ownership rule).

Issue 20: a root daemon accepted a state dir (and its outbox/) another user had made 0777; that user's planted spool
files were delivered, signed with the real HMAC key, and a forged kill event landed in events.jsonl. Here the other
user is real: `nobody` (uid 65534) creates the directories and plants the files through setpriv, in a scratch
directory under /tmp that it may enter. Root only (skipped otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import make_event, read_events
from sparkwatch.common.spool import alert_payload
from sparkwatch.core.eventkinds import EventKind
from tests.daemon import free_port, sparkwatch_run
from tests.receiver import Receiver, wait_until

NOBODY = 65534
SECRET = "forgery-test-secret"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to act as another user"
)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory `nobody` may create things in (pytest's tmp_path lies under a 0700 directory of root's)."""
    path = Path(tempfile.mkdtemp(prefix="sw-forge-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


def as_nobody(script: str, *args: str) -> None:
    """Run a shell script as uid/gid 65534 with no supplementary groups, as another local user would."""
    cmd = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", script, "sh", *args]
    subprocess.run(cmd, check=True, timeout=30)


def forged_kill() -> dict[str, object]:
    return alert_payload(make_event(EventKind.KILL, "Killed vllm (forged by another user)", {"engine": "vllm"}))


def plant(directory: Path, name: str, payload: dict[str, object]) -> None:
    """`nobody` writes a spool file: valid JSON under a valid event id, as the outbox's own protocol names them."""
    source = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        (source / "body").write_text(json.dumps(payload))
        source.chmod(0o755)
        (source / "body").chmod(0o644)
        as_nobody('cp "$1" "$2"', str(source / "body"), str(directory / name))
    finally:
        shutil.rmtree(source)


def run_env(state: Path, receiver: Receiver, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        SPARKWATCH_STATE_DIR=str(state),
        SPARKWATCH_WEBHOOK_URL=receiver.url_base + "/hook",
        SPARKWATCH_WEBHOOK_SECRET=SECRET,
        SPARKWATCH_LISTEN=f"127.0.0.1:{free_port()}",
        SPARKWATCH_ANCESTOR_PID=str(os.getpid()),
        SPARKWATCH_MLOCK="false",
        SPARKWATCH_KERNEL_LOG_PATH=str(tmp_path / "no-kmsg"),
        XDG_CONFIG_HOME=str(tmp_path / "xdg"),
    )
    return env


def refused_at_start(env: dict[str, str], receiver: Receiver) -> str:
    """`sparkwatch run` must exit 2 with one line; a daemon that starts instead is stopped after 20 s (and fails)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkwatch", "run"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        delivered = [d.payload.get("summary") for d in receiver.deliveries]
        raise AssertionError(f"the daemon started; delivered {delivered}; stderr:\n{err}") from None
    assert proc.returncode == 2, (proc.returncode, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert receiver.deliveries == []
    return err


def test_a_state_dir_another_user_made_0777_is_refused_at_start(
    scratch: Path, receiver: Receiver, tmp_path: Path
) -> None:
    state = scratch / "state"
    as_nobody('umask 000; mkdir -m 777 "$1" "$1/outbox"', str(state))
    planted = forged_kill()
    plant(state / "outbox", f"{planted['id']}.json", planted)
    err = refused_at_start(run_env(state, receiver, tmp_path), receiver)
    assert err.startswith(f"sparkwatch: error: {state}: is owned by uid {NOBODY}, not by this daemon's user (uid 0)")
    assert not (state / "events.jsonl").exists()


def test_an_outbox_another_user_owns_is_refused_at_start(scratch: Path, receiver: Receiver, tmp_path: Path) -> None:
    state = scratch / "state"
    state.mkdir(mode=0o755)  # root's own
    outbox = state / "outbox"
    outbox.mkdir()
    os.chown(outbox, NOBODY, NOBODY)  # as if it had been left over from another user's daemon
    planted = forged_kill()
    plant(outbox, f"{planted['id']}.json", planted)
    err = refused_at_start(run_env(state, receiver, tmp_path), receiver)
    assert f"{outbox}: is owned by uid {NOBODY}" in err


def test_a_world_writable_state_dir_of_our_own_is_refused_at_start(
    scratch: Path, receiver: Receiver, tmp_path: Path
) -> None:
    state = scratch / "state"
    state.mkdir()
    state.chmod(0o777)
    err = refused_at_start(run_env(state, receiver, tmp_path), receiver)
    assert f"{state}: is writable by others (mode 0777)" in err
    assert (state.stat().st_mode & 0o777) == 0o777  # left as found: the owner decides what to keep


def test_an_events_file_another_user_wrote_is_refused_at_start(
    scratch: Path, receiver: Receiver, tmp_path: Path
) -> None:
    state = scratch / "state"
    state.mkdir(mode=0o755)
    events = state / "events.jsonl"
    events.write_text(json.dumps({k: v for k, v in forged_kill().items() if k != "text"}) + "\n")
    os.chown(events, NOBODY, NOBODY)
    err = refused_at_start(run_env(state, receiver, tmp_path), receiver)
    assert f"{events}: is owned by uid {NOBODY}" in err
    events.chmod(0o644)
    os.chown(events, 0, 0)
    events.chmod(0o622)  # ours, but others may append to it
    err = refused_at_start(run_env(state, receiver, tmp_path), receiver)
    assert f"{events}: is writable by others (mode 0622)" in err


def test_spool_files_the_daemon_did_not_write_are_never_delivered(
    scratch: Path, receiver: Receiver, tmp_path: Path
) -> None:
    """The state dir and outbox are the daemon's own; two spool files in the outbox are not (another user's, as
    after a `mv` by an admin, or planted while the directory was open): a deliverable one and a `.pending-` one, which
    the old crash recovery would also have written into events.jsonl as a kill. Neither leaves, neither is recorded;
    the daemon's own alert still goes out."""
    state = scratch / "state"
    outbox = state / "outbox"
    outbox.mkdir(parents=True)
    state.chmod(0o711)  # open for the planting only
    outbox.chmod(0o777)
    deliverable, pending = forged_kill(), forged_kill()
    plant(outbox, f"{deliverable['id']}.json", deliverable)
    plant(outbox, f".pending-{pending['id']}.json", pending)
    outbox.chmod(0o700)
    state.chmod(0o700)
    ours = alert_payload(make_event(EventKind.KILL, "Killed vllm (the daemon's own record)", {"engine": "vllm"}))
    (outbox / f"{ours['id']}.json").write_text(json.dumps(ours))
    (outbox / f"{ours['id']}.json").chmod(0o600)
    env = {
        "SPARKWATCH_STATE_DIR": str(state),
        "SPARKWATCH_WEBHOOK_URL": receiver.url_base + "/hook",
        "SPARKWATCH_WEBHOOK_SECRET": SECRET,
        "SPARKWATCH_MLOCK": "false",
    }
    with sparkwatch_run(tmp_path, env=env) as d:
        assert wait_until(lambda: str(ours["id"]) in receiver.ids(), timeout_s=30), d.stderr_lines
        assert wait_until(lambda: any("quarantined spool file" in line for line in d.stderr_lines), 10)
        time.sleep(1.0)  # the worker had its chance to send anything else it loaded
    ids = receiver.ids()
    assert str(deliverable["id"]) not in ids and str(pending["id"]) not in ids
    assert all(d.signature_ok(SECRET.encode()) for d in receiver.deliveries)
    recorded = [e["id"] for e in read_events(state / "events.jsonl")]
    assert str(pending["id"]) not in recorded and str(deliverable["id"]) not in recorded
    assert sorted(p.name for p in outbox.iterdir() if p.is_file()) == []  # ours delivered, theirs moved to bad/
    assert len(list((outbox / "bad").iterdir())) == 2


@contextlib.contextmanager
def daemon_from_file(tmp_path: Path, cfg: Path) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`sparkwatch run --config cfg` with state_dir taken from the file (tests.daemon pins it in the environment,
    which a reload's validator inherits unchanged)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        SPARKWATCH_ANCESTOR_PID=str(os.getpid()),
        SPARKWATCH_LISTEN=f"127.0.0.1:{free_port()}",
        SPARKWATCH_KERNEL_LOG_PATH=str(tmp_path / "no-kmsg"),
        SPARKWATCH_MLOCK="false",
        XDG_CONFIG_HOME=str(tmp_path / "xdg"),
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkwatch", "run", "--config", str(cfg)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: any("telemetry running" in line for line in lines), 30), lines
        yield proc, lines
    finally:
        proc.terminate()
        proc.wait(10)
        reader.join(5)
        if proc.stderr is not None:
            proc.stderr.close()


def test_a_reload_to_a_foreign_state_dir_is_refused(scratch: Path, tmp_path: Path) -> None:
    foreign = scratch / "foreign"
    as_nobody('mkdir -m 755 "$1"', str(foreign))
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "own-state"}"\n')
    with daemon_from_file(tmp_path, cfg) as (proc, lines):
        cfg.write_text(f'state_dir = "{foreign}"\n')
        proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: any("reload: config error" in line for line in lines), 30), lines
        line = next(line for line in lines if "reload: config error" in line)
        assert f"{foreign}: is owned by uid {NOBODY}" in line and "keeping the running config" in line, line
        assert proc.poll() is None
