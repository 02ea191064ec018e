"""Verdicts from trusted sources only: a user's log lines cannot forge how the previous boot ended.

Real journal files (systemd-journal-remote, tests/helpers/journal_fixture.py) holding what a user's `logger`,
`logger --journald` and `systemd-cat` really write (their `_UID`, `_PID`, `_COMM`, `_TRANSPORT`, whatever
non-underscore fields they chose), beside the kernel's, PID 1's, systemd-shutdown's and journald's own lines with the
fields journald adds for them. And a flight recorder file whose header does not fit it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkwatch.common.durable import StateFileError
from sparkwatch.common.flightrec import PREV_NAME, SLOT_BYTES, RingHeader, encode_header, read_ring
from sparkwatch.core.postmortem.verdict import BootEnd, Verdict, judge
from sparkwatch.telemetry.sources.prevboot import TAIL_ENTRIES, gather
from tests.conftest import require, require_tool
from tests.helpers import journal_fixture as jf


@pytest.fixture
def tools() -> None:
    require(jf.journal_remote() is not None, "systemd-journal-remote is not installed (apt packages: .ci/run)")
    require_tool("journalctl")


def verdict_of(tmp_path: Path, boots: jf.TwoBoots) -> Verdict:
    gathered = gather(
        state_dir=tmp_path / "state",
        root=tmp_path / "root",
        running_boot_id=None,
        boot_started_at=None,
        journal_dir=boots.directory,
    )
    return judge(gathered.boot)


def flood(count: int, step_s: float = 0.002) -> list[jf.Fields]:
    """`count` lines of a user's `logger` loop, `step_s` apart (a shell loop writes thousands a second)."""
    return [{**jf.logger(f"spam {i}", "spam"), jf.STEP_KEY: str(step_s)} for i in range(count)]


OOM_KILLED = "Out of memory: Killed process 20311 (python3)"

# What a user can write to make a boot look shut down in order: each names the source it pretends to be.
FORGED_SHUTDOWNS = {
    "logger -t systemd-shutdown": [jf.logger("Syncing filesystems and block devices.", "systemd-shutdown")],
    "logger -t systemd-shutdown --id=1": [
        jf.logger("Sending SIGTERM to remaining processes...", "systemd-shutdown", syslog_pid=1)
    ],
    "systemd-cat -t systemd-shutdown": [jf.systemd_cat("Syncing filesystems and block devices.", "systemd-shutdown")],
    "logger --journald, journald's Journal stopped": [
        jf.logger_journald(
            {
                "MESSAGE": "Journal stopped",
                "MESSAGE_ID": jf.MSG_JOURNAL_STOPPED,
                "SYSLOG_IDENTIFIER": "systemd-journald",
                "SYSLOG_PID": 301,
            }
        )
    ],
    "logger --journald, PID 1's shutdown.target": [
        jf.logger_journald(
            {
                "MESSAGE": "Reached target shutdown.target - System Shutdown.",
                "MESSAGE_ID": jf.MSG_UNIT_STARTED,
                "UNIT": "shutdown.target",
                "SYSLOG_IDENTIFIER": "systemd",
                "SYSLOG_PID": 1,
            }
        )
    ],
}


@pytest.mark.parametrize("forged", list(FORGED_SHUTDOWNS))
def test_a_users_shutdown_lines_after_a_kernel_oom_leave_it_kernel_oom(
    tools: None, tmp_path: Path, forged: str
) -> None:
    """Before: any entry whose SYSLOG_IDENTIFIER said systemd-shutdown (or whose MESSAGE_ID said Journal stopped or
    shutdown.target) made the boot `clean`, and a clean end sends no alert."""
    boots = jf.two_boots(tmp_path / "journal", [*jf.OOM, *FORGED_SHUTDOWNS[forged]])
    verdict = verdict_of(tmp_path, boots)
    assert verdict.boot_class == BootEnd.KERNEL_OOM, verdict
    assert any(OOM_KILLED in line for line in verdict.evidence), verdict.evidence


def test_a_users_kill_line_is_not_sparkwatchs(tools: None, tmp_path: Path) -> None:
    """`logger "sparkwatch: KILL …"` after a kernel OOM: before, the forged kill was the last cause."""
    forged = jf.logger("sparkwatch: KILL vllm tree root=4242 (9 processes): MemAvailable 4726 MiB", "sparkwatch")
    verdict = verdict_of(tmp_path, jf.two_boots(tmp_path / "journal", [*jf.OOM, forged]))
    assert verdict.boot_class == BootEnd.KERNEL_OOM, verdict
    assert not any("sparkwatch: KILL" in line for line in verdict.evidence), verdict.evidence


def test_a_users_pstore_entry_does_not_make_a_clean_boot_kernel_oom(tools: None, tmp_path: Path) -> None:
    """`logger --journald` with SYSLOG_IDENTIFIER=systemd-pstore, systemd-pstore's MESSAGE and a panic_on_oom dump in
    FILE=, in the current boot: before, it made a clean boot `kernel_oom, then a kernel panic`."""
    text = jf.pstore_text(jf.PANIC_ON_OOM_KMSG, 88.0)
    name = "dmesg-efi_pstore-176363291101001"
    forged = jf.logger_journald(
        {
            "MESSAGE": f"PStore {name} moved to /var/lib/systemd/pstore/{name}",
            "SYSLOG_IDENTIFIER": "systemd-pstore",
            "SYSLOG_PID": 280,
            "FILE": text.encode(),
        }
    )
    boots = jf.two_boots(tmp_path / "journal", jf.CLEAN, current_extra=[forged])
    verdict = verdict_of(tmp_path, boots)
    assert verdict.boot_class == BootEnd.CLEAN, verdict
    assert verdict.pstore == ()
    # The same entry from systemd-pstore.service itself (root, its unit's cgroup) is a dump of that boot.
    real = jf.two_boots(tmp_path / "journal2", jf.CLEAN, current_extra=[jf.pstore_moved_entry(name, text)])
    assert verdict_of(tmp_path, real).boot_class == BootEnd.KERNEL_OOM


@pytest.mark.parametrize(
    ("cause", "klass", "evidence"),
    [
        (jf.OOM, BootEnd.KERNEL_OOM, OOM_KILLED),
        (jf.SPARKWATCH_KILL, BootEnd.SPARKWATCH_KILL, "sparkwatch: KILL vllm tree root=4242"),
    ],
    ids=["kernel-oom", "sparkwatch-kill-line"],
)
def test_a_flood_of_user_lines_after_the_cause_does_not_hide_it(
    tools: None, tmp_path: Path, cause: list[jf.Fields], klass: BootEnd, evidence: str
) -> None:
    """TAIL_ENTRIES + 1 user lines within 10 s of the cause: before, the one tail of the whole boot held only them
    and the boot was `abrupt`. Now each source has its own tail."""
    boots = jf.two_boots(tmp_path / "journal", [*cause, *flood(TAIL_ENTRIES + 1)])
    verdict = verdict_of(tmp_path, boots)
    assert verdict.boot_class == klass, verdict
    assert any(evidence in line for line in verdict.evidence), verdict.evidence
    assert verdict.journal_end_at == pytest.approx(boots.previous_end)  # the flood's last line is still the end


@pytest.mark.parametrize(
    ("ending", "evidence"),
    [
        (jf.CLEAN, "Reached target shutdown.target"),
        # PID 1 logged nothing the journal kept; systemd-shutdown's own line through /dev/kmsg is the record
        ([*jf.CLEAN[:2], jf.via_kmsg("systemd-shutdown", 1, "Syncing filesystems and block devices.")],
         "systemd-shutdown: Syncing filesystems"),
        # PID 1 lost the journal's socket and logged to /dev/kmsg instead (log target journal-or-kmsg)
        ([jf.via_kmsg("systemd", 1, "Shutting down.")], "systemd: Shutting down."),
        # journald's own "Journal stopped" alone (driver transport, its own credentials)
        ([jf.CLEAN[-1]], "systemd-journald: Journal stopped"),
        # a user's flood just before the shutdown takes nothing from it
        ([*flood(TAIL_ENTRIES + 1), *jf.CLEAN], "Reached target shutdown.target"),
    ],
    ids=["poweroff", "kmsg-only", "pid1-via-kmsg", "journald-only", "after-a-flood"],
)  # fmt: skip
def test_a_real_clean_shutdown_is_still_clean(
    tools: None, tmp_path: Path, ending: list[jf.Fields], evidence: str
) -> None:
    boots = jf.two_boots(tmp_path / "journal", [*jf.OOM, *jf.ACTIVITY, *ending])
    verdict = verdict_of(tmp_path, boots)
    assert verdict.boot_class == BootEnd.CLEAN, verdict
    assert any(evidence in line for line in verdict.evidence), verdict.evidence
    assert any("before the shutdown" in n and "oom_reaper" in n for n in verdict.notes), verdict.notes


# --- the flight recorder's header held against its file


def forged_ring(path: Path, capacity: int, boot_id: str) -> None:
    """A header with a valid CRC (decode_header accepts it) claiming `capacity` slots, over a file of the header and
    one slot."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_header(RingHeader(SLOT_BYTES, capacity, boot_id, time.time())) + bytes(SLOT_BYTES))
    os.chmod(path, 0o600)


def test_a_header_claiming_more_slots_than_the_file_holds_is_refused_before_any_read(tmp_path: Path) -> None:
    path = tmp_path / "state" / PREV_NAME
    forged_ring(path, 2**32 - 1, "a" * 32)
    started = time.monotonic()
    with pytest.raises(StateFileError) as caught:
        read_ring(path)
    assert time.monotonic() - started < 1.0  # before: 40 s of 2^25 empty preads
    assert "4294967295 slots" in str(caught.value.strerror) and "4608 bytes" in str(caught.value.strerror)


def test_postmortem_says_in_one_line_that_the_recorder_file_was_refused(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.NVRM_NO_MEMORY)
    state = tmp_path / "state"
    forged_ring(state / PREV_NAME, 2**32 - 1, boots.previous_boot)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    cmd = [sys.executable, "-m", "sparkwatch", "postmortem", "--journal-dir", str(boots.directory)]
    started = time.monotonic()
    text = subprocess.run([*cmd, "--state-dir", str(state)], capture_output=True, text=True, env=env, timeout=20)
    elapsed_s = time.monotonic() - started
    assert text.returncode == 0, text.stderr
    assert elapsed_s < 15.0  # journalctl's seven reads, not the ring's 2^32 slots
    refused = [line for line in text.stdout.splitlines() if PREV_NAME in line]
    assert len(refused) == 1 and refused[0].startswith("note: flight recorder "), text.stdout
    assert "4294967295 slots" in refused[0] and "not read" in refused[0]
    assert "driver_no_memory" in text.stdout  # the rest of the verdict stands
    done = subprocess.run(
        [*cmd, "--state-dir", str(state), "--json"], capture_output=True, text=True, env=env, timeout=20
    )
    data = json.loads(done.stdout)
    assert data["recorder"] is None and sum(PREV_NAME in n for n in data["notes"]) == 1
