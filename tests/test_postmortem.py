"""The verdict on the previous boot, from real journal files (systemd-journal-remote, two boots, read by journalctl
--directory), pstore dumps, the flight recorder and events.jsonl. The daemon's side: tests/test_postmortem_daemon.py."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, make_event
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.postmortem.flight import FlightSample
from sparkwatch.core.postmortem.verdict import BootEnd, PreviousBoot, Verdict, judge
from sparkwatch.core.units import GiB
from sparkwatch.telemetry.sources.prevboot import Boot as JournalBoot
from sparkwatch.telemetry.sources.prevboot import JournalReader, gather
from tests.conftest import require, require_tool
from tests.helpers import journal_fixture as jf


@pytest.fixture
def tools() -> None:
    require(jf.journal_remote() is not None, "systemd-journal-remote is not installed (apt packages: .ci/run)")
    require_tool("journalctl")


def verdict_of(tmp_path: Path, boots: jf.TwoBoots, root: Path | None = None, state: Path | None = None) -> Verdict:
    gathered = gather(
        state_dir=state or tmp_path / "state",
        root=root or tmp_path / "root",
        running_boot_id=None,
        boot_started_at=None,
        journal_dir=boots.directory,
    )
    return judge(gathered.boot)


def with_tail(lines: Sequence[jf.Fields], quiet_s: float) -> list[jf.Fields]:
    """`lines`, then ordinary activity for `quiet_s` (entries are STEP_S apart)."""
    return [*lines, *(jf.ACTIVITY * int(quiet_s / jf.STEP_S))]


# --- the fixtures are what they claim


def test_the_fixture_is_a_real_journal_of_two_boots(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.NVRM_NO_MEMORY)
    listed = subprocess.run(
        ["journalctl", "--directory", str(boots.directory), "--list-boots", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [b["boot_id"] for b in json.loads(listed.stdout)] == [boots.previous_boot, boots.current_boot]
    last = subprocess.run(
        ["journalctl", "-q", "--directory", str(boots.directory), "-b", "-1", "-n", "1", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    entry = json.loads(last.stdout)
    assert entry["_BOOT_ID"] == boots.previous_boot and "NV_ERR_NO_MEMORY" in entry["MESSAGE"]
    assert (
        subprocess.run(["journalctl", "--directory", str(boots.directory), "--verify"], capture_output=True).returncode
        == 0
    )


# --- one class per ending, from the real files


@pytest.mark.parametrize(
    ("ending", "klass", "evidence"),
    [
        (jf.CLEAN, BootEnd.CLEAN, "Reached target shutdown.target"),
        (jf.OOM, BootEnd.KERNEL_OOM, "Out of memory: Killed process 20311 (python3)"),
        (jf.NVRM_NO_MEMORY, BootEnd.DRIVER_NO_MEMORY, "[NV_ERR_NO_MEMORY] (0x00000051)"),
        (jf.XID_79, BootEnd.XID, "NVRM: Xid (PCI:000f:01:00): 79"),
        (jf.SPARKWATCH_KILL, BootEnd.SPARKWATCH_KILL, "sparkwatch: KILL vllm tree root=4242"),
        ([], BootEnd.ABRUPT, "sparkwatch: re-armed"),  # the journal just stops: its last lines are the evidence
        (jf.XID_31, BootEnd.ABRUPT, "Xid (PCI:000f:01:00): 31"),  # an application's MMU fault is no cause
        (jf.APP_OOM, BootEnd.ABRUPT, "CUDA out of memory"),  # a process's words are not the OOM killer's
        ([*jf.SPARKWATCH_KILL, *jf.OOM], BootEnd.KERNEL_OOM, "sparkwatch: KILL"),  # the last memory event decides
        ([*jf.OOM, *jf.SPARKWATCH_KILL], BootEnd.SPARKWATCH_KILL, "invoked oom-killer"),
        ([*jf.NVRM_NO_MEMORY, *jf.XID_31], BootEnd.DRIVER_NO_MEMORY, "NV_ERR_NO_MEMORY"),
        ([*jf.OOM, *jf.CLEAN], BootEnd.CLEAN, "Reached target shutdown.target"),  # shut down in order after all
        (with_tail(jf.OOM, 700), BootEnd.ABRUPT, "re-armed"),  # an OOM kill long survived is not how it ended
        (with_tail(jf.NVRM_NO_MEMORY, 500), BootEnd.DRIVER_NO_MEMORY, "NV_ERR_NO_MEMORY"),  # near enough
        # journald restarted (an upgrade), then the box died: the "Journal stopped" was not the end
        ([jf.CLEAN[-1], jf.boot_start()[1], *jf.ACTIVITY], BootEnd.ABRUPT, "re-armed"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_each_ending_gets_its_class(
    tools: None, tmp_path: Path, ending: list[jf.Fields], klass: BootEnd, evidence: str
) -> None:
    boots = jf.two_boots(tmp_path / "journal", ending)
    verdict = verdict_of(tmp_path, boots)
    assert verdict.boot_class == klass, verdict
    assert any(evidence in line for line in verdict.evidence), verdict.evidence
    assert verdict.boot_id == boots.previous_boot
    assert verdict.journal_end_at == pytest.approx(boots.previous_end)


def test_the_current_boot_is_never_judged_and_no_previous_one_is_unknown(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.OOM, only_current=True)
    verdict = verdict_of(tmp_path, boots)
    assert verdict.boot_class == BootEnd.UNKNOWN and verdict.evidence == ()
    assert any("no previous boot" in note for note in verdict.notes)


def test_a_clean_shutdown_after_an_oom_names_it_in_a_note(tools: None, tmp_path: Path) -> None:
    verdict = verdict_of(tmp_path, jf.two_boots(tmp_path / "journal", [*jf.OOM, *jf.CLEAN]))
    assert verdict.boot_class == BootEnd.CLEAN
    assert any("before the shutdown" in n and "oom_reaper: reaped process 20311" in n for n in verdict.notes)


# --- pstore


def write_dump(directory: Path, name: str, text: str, mtime: float) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(text)
    os.utime(path, (mtime, mtime))
    return path


def test_a_panic_in_pstore_is_abrupt_with_the_panic_line(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", [])
    root = tmp_path / "root"
    text = jf.pstore_text(jf.PANIC_KMSG, 301.5)
    write_dump(root / "sys/fs/pstore", "dmesg-ramoops-0", text, boots.previous_end + 2)
    write_dump(root / "sys/fs/pstore", "console-ramoops-0", "[  301.5] console text\n", boots.previous_end + 2)
    verdict = verdict_of(tmp_path, boots, root=root)
    assert verdict.boot_class == BootEnd.ABRUPT
    assert verdict.evidence == ("pstore dmesg-ramoops-0: Kernel panic - not syncing: sysrq triggered crash",)
    assert "kernel panic" in verdict.summary and verdict.pstore == ("dmesg-ramoops-0",)


def test_a_panic_on_oom_dump_is_a_kernel_oom(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", [])
    root = tmp_path / "root"
    write_dump(
        root / "sys/fs/pstore", "dmesg-ramoops-0", jf.pstore_text(jf.PANIC_ON_OOM_KMSG, 88.0), boots.previous_end
    )
    verdict = verdict_of(tmp_path, boots, root=root)
    assert verdict.boot_class == BootEnd.KERNEL_OOM
    assert "pstore dmesg-ramoops-0: python3 invoked oom-killer" in verdict.evidence[0]
    assert "then a kernel panic" in verdict.summary


def test_a_dump_moved_by_systemd_pstore_is_found_in_the_current_boots_journal(tools: None, tmp_path: Path) -> None:
    """Debian's systemd-pstore.service moves the files out of /sys/fs/pstore early in the next boot and logs each one
    with its text: the verdict reads it there when the files are gone."""
    text = jf.pstore_text(jf.PANIC_KMSG, 301.5)
    boots = jf.two_boots(
        tmp_path / "journal", [], current_extra=[jf.pstore_moved_entry("dmesg-efi_pstore-176363291101001", text)]
    )
    verdict = verdict_of(tmp_path, boots)
    assert verdict.boot_class == BootEnd.ABRUPT
    assert verdict.pstore == ("dmesg-efi_pstore-176363291101001",)
    assert "sysrq triggered crash" in verdict.evidence[0]


def test_old_dumps_and_an_oops_do_not_make_a_clean_boot_a_panic(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.CLEAN)
    root = tmp_path / "root"
    moved = root / "var/lib/systemd/pstore"
    write_dump(moved / "1700000000", "dmesg-efi-170000000001001", jf.pstore_text(jf.PANIC_KMSG, 5.0), jf.T0 - 86400)
    oops = [(4, "Oops: Internal error: Oops: 0000000096000004 [#1] PREEMPT SMP")]
    write_dump(root / "sys/fs/pstore", "dmesg-ramoops-0", jf.pstore_text(oops, 40.0, "Oops"), jf.T0 + 10)
    verdict = verdict_of(tmp_path, boots, root=root)
    assert verdict.boot_class == BootEnd.CLEAN
    assert verdict.pstore == ("dmesg-ramoops-0",)  # the older boot's dump is not this one's


# --- the flight recorder and events.jsonl


def test_the_recorder_gives_the_last_minute_and_how_long_sparkwatch_was_silent(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", jf.NVRM_NO_MEMORY)
    state = tmp_path / "state"
    jf.write_ring(state, boots.previous_boot, boots.previous_end - 700)
    verdict = verdict_of(tmp_path, boots, state=state)
    assert verdict.boot_class == BootEnd.DRIVER_NO_MEMORY
    assert verdict.last_sample_at == pytest.approx(boots.previous_end - 700)
    assert verdict.sample_to_journal_end_s == pytest.approx(700)
    assert any("700 s before the journal's end" in note for note in verdict.notes)
    assert verdict.trend is not None and verdict.trend.samples == 61
    assert verdict.trend.change_bytes_per_s == pytest.approx(-GiB / 2, rel=0.05)
    assert "draining" in verdict.trend.words
    assert [(e.kind, e.pid, e.footprint_bytes) for e in verdict.engines] == [("vllm", 4242, 65 * GiB)]


def test_a_ring_of_another_boot_is_not_this_ones(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", [])
    state = tmp_path / "state"
    jf.write_ring(state, "c" * 32, boots.previous_end, name="recorder.ring")
    gathered = gather(
        state_dir=state,
        root=tmp_path / "root",
        running_boot_id="c" * 32,
        boot_started_at=None,
        journal_dir=boots.directory,
    )
    assert gathered.ring is None and gathered.boot.samples == ()


def test_the_guards_kill_event_near_the_end_is_sparkwatch_kill(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", [])
    state = tmp_path / "state"
    log = EventLog(state / "events.jsonl")
    log.append(
        make_event(
            EventKind.KILL, "Killed vllm (root pid 4242, 9 processes)", {"dry_run": False}, ts=boots.previous_end - 10
        )
    )
    log.append(make_event(EventKind.KILL, "Would have killed vllm", {"dry_run": True}, ts=boots.previous_end - 5))
    verdict = verdict_of(tmp_path, boots, state=state)
    assert verdict.boot_class == BootEnd.SPARKWATCH_KILL
    assert len(verdict.evidence) == 1 and "sparkwatch kill: Killed vllm (root pid 4242" in verdict.evidence[0]


def test_without_a_journal_a_clean_stop_of_sparkwatch_is_still_unknown() -> None:
    sample = FlightSample(1000.0, 50 * GiB, 40 * GiB, GiB, 0, 0.0, 1.0, False, "watch", 0, stopping=True)
    verdict = judge(PreviousBoot(boot_id="d" * 32, samples=(sample,)))
    assert verdict.boot_class == BootEnd.UNKNOWN
    assert verdict.last_sample_at == 1000.0 and "stopped in order" in verdict.summary


def test_an_older_journalctl_without_json_boot_lists_is_read_from_its_table(tools: None, tmp_path: Path) -> None:
    boots = jf.two_boots(tmp_path / "journal", [])
    listed = JournalReader(directory=boots.directory)._boots_from_table()
    assert [b.boot_id for b in listed] == [boots.previous_boot, boots.current_boot]


def test_on_a_live_journal_the_previous_boot_is_the_one_before_the_running_one() -> None:
    """`journalctl -b -1` would name the boot before the last in the files; while this boot has no entries yet that
    is the boot before the previous one. The running boot id decides instead."""
    a, b, c = (JournalBoot(x * 32, None, None) for x in "abc")
    live = JournalReader(running_boot_id="c" * 32)
    assert live.previous_and_current([a, b, c]) == (b, c)
    assert live.previous_and_current([a, b]) == (b, None)  # this boot not flushed yet: the last listed is previous
    assert JournalReader(running_boot_id="a" * 32).previous_and_current([a]) == (None, a)  # a first boot
    assert JournalReader(directory=Path("/x")).previous_and_current([a, b, c]) == (b, c)  # -b -1 semantics
