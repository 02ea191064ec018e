"""Every command docs/troubleshooting.md gives, held to what it says it finds.

The commands are read from the doc's `sh` code blocks (so the list cannot drift from the doc: a command added there
and not here fails `test_every_command_in_the_doc_is_checked`). Each `sparkwatch` command runs verbatim, pipes and
redirections included, through bash, against the state dir of a real daemon that recorded a real kill (a fake engine
tree of this test's over its budget: the daemon is armed and confined to this test's processes), while that daemon
runs. (A dry run records `would_kill`, which the doc's kill commands rightly do not find.) The others read what this
machine cannot have (journald, an NVIDIA driver, pstore, sudo, earlyoom beside sparkwatch): each is parsed by bash,
and where it leans on what sparkwatch writes (the journal fields of a kill, the KILL line), that is checked against
the same real kill.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkwatch.common.systemd import journal_fields
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.model import Event
from tests.conftest import ROOT, Spawner, pids_in
from tests.daemon import RunningDaemon, sparkwatch_run, wait_for_event

DOC = ROOT / "docs" / "troubleshooting.md"


def strip_comment(line: str) -> str:
    """The line up to a shell comment: a `#` at a word's start, outside quotes."""
    quote = ""
    for i, char in enumerate(line):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def doc_commands() -> list[str]:
    """Each command line of the doc's `sh` blocks, comments dropped, in the doc's order."""
    out: list[str] = []
    for block in re.findall(r"^```sh\n(.*?)^```", DOC.read_text(), re.S | re.M):
        for line in block.splitlines():
            command = strip_comment(line.strip())
            if command and command not in out:
                out.append(command)
    return out


def documented_classes() -> set[str]:
    """The postmortem classes the doc's table lists."""
    section = DOC.read_text().split("The class is exactly one of:", 1)[1].split("With it come", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, re.M))


# What each sparkwatch command must find: (its result, the directory it ran in, the kill it must show).
Check = Callable[[subprocess.CompletedProcess[str], Path, dict[str, Any]], None]


def _events_lines(done: subprocess.CompletedProcess[str], _cwd: Path, kill: dict[str, Any]) -> None:
    # "the last 20 events, one line each, local time": the kill among them, one line, its summary.
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if kill["summary"] in x]
    assert " kill " in line or "kill" in line.split(kill["summary"])[0]


def _events_system(done: subprocess.CompletedProcess[str], cwd: Path, kill: dict[str, Any]) -> None:
    # "the system unit's record (/var/lib/sparkwatch/events.jsonl)": here under SPARKWATCH_ROOT (see ENV).
    assert "the system unit's events" in done.stderr and "/var/lib/sparkwatch/events.jsonl" in done.stderr
    _events_lines(done, cwd, kill)


def _grep_kill(done: subprocess.CompletedProcess[str], _cwd: Path, kill: dict[str, Any]) -> None:
    assert done.returncode == 0, (done.stdout, done.stderr)  # grep found it
    (line,) = done.stdout.splitlines()
    assert json.loads(line)["id"] == kill["id"]


def _status_guard(done: subprocess.CompletedProcess[str], _cwd: Path, kill: dict[str, Any]) -> None:
    # "is a guard running now: armed, or in dry run?": the running daemon, armed.
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    assert line.startswith(f"GUARD      guard pid {kill['guard_pid']} (") and ", armed, " in line, line


def _postmortem_text(text: str) -> None:
    first = text.splitlines()[0]
    assert first.startswith("previous boot "), text
    assert first.rsplit(": ", 1)[1] in documented_classes(), first
    assert "the last minute" in text


def _postmortem(done: subprocess.CompletedProcess[str], _cwd: Path, _kill: dict[str, Any]) -> None:
    assert done.returncode == 0, done.stderr
    _postmortem_text(done.stdout)


def _postmortem_json(data: dict[str, Any]) -> None:
    assert data["class"] in documented_classes()
    assert {"evidence", "trend", "engines", "verdict"} <= set(data)


def _postmortem_json_out(done: subprocess.CompletedProcess[str], _cwd: Path, _kill: dict[str, Any]) -> None:
    assert done.returncode == 0, done.stderr
    _postmortem_json(json.loads(done.stdout))


def _postmortem_json_file(done: subprocess.CompletedProcess[str], cwd: Path, _kill: dict[str, Any]) -> None:
    assert done.returncode == 0 and done.stdout == "", done.stderr
    _postmortem_json(json.loads((cwd / "postmortem.json").read_text()))


def _postmortem_txt_file(done: subprocess.CompletedProcess[str], cwd: Path, _kill: dict[str, Any]) -> None:
    assert done.returncode == 0 and done.stdout == "", done.stderr
    _postmortem_text((cwd / "postmortem.txt").read_text())


def _events_file(done: subprocess.CompletedProcess[str], cwd: Path, kill: dict[str, Any]) -> None:
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in (cwd / "events.jsonl").read_text().splitlines()]
    assert kill["id"] in {e["id"] for e in events} and len(events) <= 50


def _doctor_file(done: subprocess.CompletedProcess[str], cwd: Path, _kill: dict[str, Any]) -> None:
    assert done.returncode in (0, 1), done.stderr  # 1: a check fails on this machine
    checks = {c["id"]: c for c in json.loads((cwd / "doctor.json").read_text())["checks"]}
    # "driver, kernel, next-boot modules, swap, MAX_JOBS", and the running guard (armed: ok).
    assert {"driver-modules", "next-boot-modules", "swap", "max-jobs", "kernel-log", "guard"} <= set(checks)
    assert checks["guard"]["status"] == "ok" and "armed" in checks["guard"]["summary"]


SPARKWATCH: dict[str, Check] = {
    "sparkwatch events": _events_lines,
    "sparkwatch events --system": _events_system,
    'sparkwatch events -n 200 --json | grep \'"kind": "kill"\'': _grep_kill,
    "sparkwatch status --once | grep '^GUARD'": _status_guard,
    "sparkwatch postmortem": _postmortem,
    "sparkwatch postmortem --json": _postmortem_json_out,
    "sparkwatch postmortem --json > postmortem.json": _postmortem_json_file,
    "sparkwatch postmortem > postmortem.txt": _postmortem_txt_file,
    "sparkwatch events -n 50 --json > events.jsonl": _events_file,
    "sparkwatch doctor --json > doctor.json": _doctor_file,
}

# Read what this machine cannot have (no journald, no NVIDIA driver or pstore, no sudo in a test, earlyoom not to be
# started beside the suite): parsed by bash; what they lean on of sparkwatch's is checked in the test below.
ELSEWHERE: dict[str, str] = {
    "journalctl --user -u sparkwatch | grep KILL": "journald: the daemon's KILL line",
    "journalctl --user SPARKWATCH_EVENT=kill": "journald: a kill's structured fields",
    "journalctl --user SPARKWATCH_VICTIM_PID=1234": "journald: a kill's victim pids",
    "journalctl -k | grep -E 'Out of memory|oom-kill|NVRM'": "the kernel's own lines",
    "sudo journalctl -b -1 -k -o short-precise > kernel-previous-boot.txt": "sudo, the previous boot's journal",
    "sudo journalctl -b -1 -u sparkwatch -o short-precise > sparkwatch-previous-boot.txt": "sudo, journald",
    "sudo ls -la /sys/fs/pstore /var/lib/systemd/pstore": "sudo, pstore",
    "cat /proc/driver/nvidia/version; uname -r; cat /etc/dgx-release 2>/dev/null": "an NVIDIA driver, DGX OS",
    "sudo nvidia-bug-report.sh": "sudo, NVIDIA's driver tools",
    "earlyoom -M 4194304,2097152 --avoid '^(VLLM::|vllm|sglang|trtllm|llama-server)' -r 60": "a second OOM killer",
}


def test_every_command_in_the_doc_is_checked() -> None:
    commands = doc_commands()
    assert len(commands) == len(SPARKWATCH) + len(ELSEWHERE)
    assert set(commands) == set(SPARKWATCH) | set(ELSEWHERE), set(commands) ^ (set(SPARKWATCH) | set(ELSEWHERE))
    for command in commands:  # each is valid shell as written
        parsed = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, check=False)
        assert parsed.returncode == 0, (command, parsed.stderr)


def _record_a_kill(tmp_path: Path, spawner: Spawner, daemon: RunningDaemon) -> dict[str, Any]:
    """A fake engine tree grows to 480 MiB, past its 64 MiB budget and the 256 MiB margin: killed, trigger budget."""
    pidfile = tmp_path / "tree.pids"
    spawner.engine("--title", "VLLM::EngineCore_sw-troubleshoot", "--hog-rate-mib", "160", "--hog-limit-mib", "480",
                   pidfile=pidfile, wait_for=2)  # fmt: skip
    kill: dict[str, Any] = wait_for_event(daemon.events_path, "kill", timeout_s=60)
    assert kill["dry_run"] is False and kill["trigger"] == "budget"
    assert {v["pid"] for v in kill["victims"]} == set(pids_in(pidfile))
    return kill


def test_each_sparkwatch_command_finds_what_the_doc_says(tmp_path: Path, spawner: Spawner) -> None:
    # The state dir is where the system unit keeps it under a root (SPARKWATCH_ROOT): the same real record answers
    # `events` (this user's) and `events --system` (the system unit's).
    root = tmp_path / "root"
    state = root / "var" / "lib" / "sparkwatch"
    budgets = json.dumps(["64MiB=sw-troubleshoot"])
    env = {"SPARKWATCH_STATE_DIR": str(state), "SPARKWATCH_ENGINE_BUDGETS": budgets}
    with sparkwatch_run(tmp_path, env=env) as daemon:  # armed, confined to this test's processes (tests/daemon.py)
        daemon.state_dir = state  # the helper's is tmp_path/state; the env above moved it
        kill = {**_record_a_kill(tmp_path, spawner, daemon), "guard_pid": daemon.proc.pid}
        base = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
        base.update(
            PATH=f"{Path(sys.executable).parent}:{base.get('PATH', '')}",  # `sparkwatch` as installed in this venv
            SPARKWATCH_STATE_DIR=str(state),
            XDG_RUNTIME_DIR=str(tmp_path / "run"),  # the daemon's (tests/daemon.py): where it publishes guard.json
            XDG_CONFIG_HOME=str(tmp_path / "xdg"),
            TZ="UTC",
        )
        for command, check in SPARKWATCH.items():
            cwd = tmp_path / f"cwd-{abs(hash(command))}"
            cwd.mkdir()
            env_here = dict(base)
            if "--system" in command:  # the system unit's state dir, under this root; no state_dir of the user's
                env_here["SPARKWATCH_ROOT"] = str(root)
                del env_here["SPARKWATCH_STATE_DIR"]
            done = subprocess.run(
                ["bash", "-o", "pipefail", "-c", command],
                cwd=cwd,
                env=env_here,
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            try:
                check(done, cwd, kill)
            except AssertionError as exc:
                why = f"{command!r}: {exc}\n--- stdout:\n{done.stdout}\n--- stderr:\n{done.stderr}"
                raise AssertionError(why) from None
        # What the journal commands rely on: the kill as the guard journals it (common.systemd.journal_fields),
        # and its KILL line on stderr, which the journal keeps.
        fields = journal_fields(
            Event(
                id=kill["id"],
                ts=kill["ts"],
                kind=EventKind(kill["kind"]),
                node=kill["node"],
                summary=kill["summary"],
                fields={k: v for k, v in kill.items() if k not in ("id", "ts", "kind", "node", "summary")},
            )
        )
        assert ("SPARKWATCH_EVENT", "kill") in fields
        victims = {int(v) for k, v in fields if k == "SPARKWATCH_VICTIM_PID"}
        assert victims == {v["pid"] for v in kill["victims"]}
        assert any("sparkwatch: KILL " in line for line in daemon.stderr_lines), daemon.stderr_lines
