"""How the previous boot ended: one class, the lines that say so, and what the pool and the engines were doing.

Pure: the caller (telemetry.postmortemtask, `sparkwatch postmortem`) reads the previous boot's journal, pstore, the
flight recorder and events.jsonl, and hands them over as `PreviousBoot`. `judge` returns exactly one of:

- `clean`: the journal's last two minutes hold an orderly shutdown: journald's "Journal stopped" (MESSAGE_ID
  d93fb3c9c24d451a97cea615ce59c00b, not followed by a new "Journal started"), a line of systemd-shutdown, PID 1's
  "Shutting down.", or shutdown.target reached; and pstore holds no panic of that boot. Each counts only from the
  process that really writes it (below, "Trusted sources").
- `kernel_oom`, `driver_no_memory`, `xid`, `sparkwatch_kill`: the last memory or GPU event within NEAR_END_S of the
  end decides (every one found is evidence). Kernel OOM-killer lines (mm/oom_kill.c: "invoked oom-killer:",
  "Out of memory: Killed process", "Memory cgroup out of memory: …", "oom-kill:constraint=…", "oom_reaper: reaped
  process"); NVRM allocation failures (`NV_ERR_NO_MEMORY`, "cannot allocate": core.driver.nvrm.parse_nvrm); an Xid that
  needs a GPU reset or a reboot (core.driver.nvrm.XID_CATALOGUE); the guard's own kill (events.jsonl, else its KILL line
  in the journal). Kernel lines count only from the kernel itself (journal transport `kernel`, identifier `kernel`):
  a process that logs "Out of memory" is not the OOM killer. pstore's panic text is searched the same way.
- `abrupt`: the boot has a journal (or a pstore dump) but no shutdown record and no such cause: a power loss, a
  hard reset, a panic with no memory or GPU line, or a wedge the kernel never logged (NVIDIA/open-gpu-kernel-modules
  #1358: a host that hung after NV_ERR_NO_MEMORY with no OOM kill, no panic and an empty pstore).
- `unknown`: nothing to judge by (no journal of that boot and no pstore dump), or only sparkwatch's own record of a
  daemon that was stopped in order.

Trusted sources. Any user can write any field that does not start with an underscore (`logger -t systemd-shutdown`,
`logger --journald` with MESSAGE_ID=, UNIT=, FILE=, SYSLOG_PID=1, or `systemd-cat -t …`), so a line is judged by the
fields journald itself adds from the sender's credentials, which no client can set (systemd.journal-fields(7)):
- the kernel: `_TRANSPORT=kernel` with facility 0 (LOG_KERN). /dev/kmsg is root's alone to write (mode 0644), and the
  kernel gives a line written into it facility LOG_USER unless the writer names another non-zero one
  (kernel/printk/printk.c devkmsg_write), so facility 0 is the kernel's own;
- PID 1: `_PID=1` and `_UID=0` through the journal, or `_TRANSPORT=kernel` with `SYSLOG_PID=1` and a non-kernel
  facility. systemd-shutdown is PID 1 after systemd execs it and logs only to /dev/kmsg (src/shutdown/shutdown.c
  takes PID 1's log target and forbids IPC, "as these logging daemons are either already dead or will die very
  soon"): journald, still running until that process's SIGTERM, reads its
  "systemd-shutdown[1]: …" lines back with identifier and SYSLOG_PID parsed from the text and no `_PID` or `_UID`
  (src/journal/journald-kmsg.c dev_kmsg_record passes no credentials). Only root can write such a line;
- journald: `_TRANSPORT=driver` (journald's own messages, server_driver_message, with its own credentials: `_UID=0`,
  `_COMM=systemd-journal`, its `_PID`);
- systemd-pstore: `_SYSTEMD_UNIT=systemd-pstore.service` and `_UID=0` (the unit comes from the sender's cgroup);
- sparkwatch's own KILL line: from a unit named sparkwatch.service (`_SYSTEMD_UNIT`, or `_SYSTEMD_USER_UNIT` for the
  user unit), over the native protocol or stderr (common.logs); events.jsonl stays the first record of a kill.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from sparkwatch.core.container import container_words
from sparkwatch.core.driver.nvrm import NvrmError, XidLine, parse_nvrm, xid_info
from sparkwatch.core.postmortem.flight import FlightSample, PoolTrend, pool_trend
from sparkwatch.core.timestamps import rfc3339
from sparkwatch.core.units import format_size


class BootEnd(StrEnum):
    CLEAN = "clean"
    KERNEL_OOM = "kernel_oom"
    DRIVER_NO_MEMORY = "driver_no_memory"
    XID = "xid"
    SPARKWATCH_KILL = "sparkwatch_kill"
    ABRUPT = "abrupt"
    UNKNOWN = "unknown"


# A cause line counts when it came this close to the end of the boot's record. A box that wedges on memory logs its
# last OOM or NVRM line seconds to minutes before it stops logging at all; ten minutes leaves room for the slow ones.
NEAR_END_S = 600.0
# An orderly shutdown's last lines reach the journal within seconds of its end (journald is stopped last).
CLEAN_TAIL_S = 120.0
# The recorder stopped this long before the journal ended: sparkwatch itself had stopped (or wedged) first.
SILENT_GAP_S = 30.0
EVIDENCE_MAX = 20

MSG_JOURNAL_STOPPED = "d93fb3c9c24d451a97cea615ce59c00b"  # systemd: catalog/systemd.catalog.in
MSG_JOURNAL_STARTED = "f77379a8490b408bbe5f6940505a777b"
MSG_UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"  # "Reached target …" / "Started …"
SHUTDOWN_UNITS = frozenset({"shutdown.target", "final.target", "poweroff.target", "reboot.target", "halt.target"})
SPARKWATCH_UNIT = "sparkwatch.service"  # cli.install_service: the user and the system unit have this name

_OOM = re.compile(
    r"invoked oom-killer: "
    r"|(?:^|: )(?:Out of memory|Memory cgroup out of memory): Kill(?:ed)? process \d+"
    r"|^Killed process \d+ \("
    r"|^oom-kill:constraint="
    r"|^oom_reaper: reaped process \d+"
    r"|Out of memory: (?:compulsory|system-wide) panic_on_oom"
)
_PANIC = re.compile(r"Kernel panic - not syncing: (.*)")
# pstore dmesg text: "<level>[ seconds.usec] " (kernel/printk/printk.c print_time with syslog=true), then an optional
# "[T1234]" caller id (CONFIG_PRINTK_CALLER).
_PRINTK_PREFIX = re.compile(r"^<\d+>\s*(?:\[\s*\d+\.\d+\]\s*)?(?:\[\s*[TC]\d+\]\s*)?")
_SPARKWATCH_KILL = "sparkwatch: KILL "
PANIC_REASONS = frozenset({"Panic", "Emergency"})  # kmsg_dump_reason_str(); an Oops alone may well be survived


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """One entry of the previous boot's journal (journalctl -o json), in the fields judged here."""

    t: float  # __REALTIME_TIMESTAMP, unix seconds
    message: str
    identifier: str = ""  # SYSLOG_IDENTIFIER
    transport: str = ""  # _TRANSPORT: kernel, journal, stdout, syslog, driver, audit
    message_id: str = ""
    unit: str = ""  # UNIT: what PID 1's message is about
    pid: int | None = None  # _PID
    facility: int | None = None  # SYSLOG_FACILITY
    uid: int | None = None  # _UID
    comm: str = ""  # _COMM
    syslog_pid: int | None = None  # SYSLOG_PID: what the writer says; trusted only over /dev/kmsg (root's alone)
    systemd_unit: str = ""  # _SYSTEMD_UNIT
    user_unit: str = ""  # _SYSTEMD_USER_UNIT

    @property
    def from_kernel(self) -> bool:
        """Printed by the kernel, not written into /dev/kmsg by a process (those get a facility and identifier)."""
        return self.transport == "kernel" and self.identifier in ("kernel", "") and self.facility in (None, 0)

    @property
    def from_pid1(self) -> bool:
        """PID 1 (systemd, or systemd-shutdown once systemd execs it): see "Trusted sources" above."""
        if self.transport == "kernel":
            return self.syslog_pid == 1 and self.facility not in (None, 0)
        return self.pid == 1 and self.uid == 0 and self.transport in ("journal", "syslog", "stdout")

    @property
    def from_journald(self) -> bool:
        return self.transport == "driver" and self.uid == 0 and self.comm == "systemd-journal" and self.pid is not None

    @property
    def from_sparkwatch_unit(self) -> bool:
        return self.transport in ("stdout", "journal") and SPARKWATCH_UNIT in (self.systemd_unit, self.user_unit)


@dataclass(frozen=True, slots=True)
class PstoreRecord:
    """A pstore file (fs/pstore/inode.c names them `<type>-<backend>-<id>`), from /sys/fs/pstore, from where
    systemd-pstore moved it, or from its journal entry."""

    name: str
    reason: str | None  # "Panic" in "Panic#1 Part1" (fs/pstore/platform.c pstore_dump); None: no such header
    t: float | None  # the file's mtime (the record's time where the backend keeps one)
    text: str
    source: str = ""  # where it was read


@dataclass(frozen=True, slots=True)
class SparkwatchEvent:
    """An event of that boot from events.jsonl, in the fields judged here."""

    t: float
    kind: str
    summary: str
    dry_run: bool = False
    page: bool = False  # an Xid a human must act on
    containers: tuple[str, ...] = ()  # a kill's containers in words, from its `containers` fields (event_containers)


def event_containers(fields: object) -> tuple[str, ...]:
    """The containers a kill event names (its `containers` entries: docs/contract.md), in the kill line's words:
    `container NAME (IMAGE PROJECT/SERVICE)` where the guard knew the names, `container <12 digits>` otherwise."""
    if not isinstance(fields, list):
        return ()
    out = []
    for entry in fields[:8]:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        name, image = entry.get("name"), entry.get("image")
        if isinstance(name, str) and isinstance(image, str):
            project, service = entry.get("compose_project"), entry.get("compose_service")
            out.append(
                container_words(
                    name,
                    image,
                    project if isinstance(project, str) else "",
                    service if isinstance(service, str) else "",
                )
            )
        else:
            out.append(f"container {entry['id'][:12]}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PreviousBoot:
    boot_id: str | None
    started_at: float | None = None
    journal: tuple[JournalEntry, ...] | None = None  # its last entries, oldest first; None: none could be read
    journal_note: str = ""  # how it was read, or why it could not be
    recorder_note: str = ""  # why the flight recorder's file was not read, where it was refused
    pstore: tuple[PstoreRecord, ...] = ()
    samples: tuple[FlightSample, ...] = ()  # the flight recorder of that boot, oldest first
    events: tuple[SparkwatchEvent, ...] = ()  # sparkwatch's events of that boot, oldest first


@dataclass(frozen=True, slots=True)
class EngineAtEnd:
    kind: str
    pid: int
    footprint_bytes: int | None  # RSS + GPU bytes at the guard's last scan; None: not measured
    phase: str | None  # the boot phase `sparkwatch launch` reported; None: not started by it


@dataclass(frozen=True, slots=True)
class Verdict:
    boot_class: BootEnd
    summary: str
    evidence: tuple[str, ...]
    boot_id: str | None
    ended_at: float | None  # the latest of the journal's end, the recorder's last sample and the last event
    journal_end_at: float | None
    last_sample_at: float | None
    sample_to_journal_end_s: float | None  # journal end - last sample (positive: the recorder stopped first)
    trend: PoolTrend | None
    engines: tuple[EngineAtEnd, ...]
    pstore: tuple[str, ...]  # the dumps of that boot, by name
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Cause:
    t: float
    klass: BootEnd
    line: str
    from_event: bool = False


def stamp(t: float) -> str:
    return rfc3339(t, ms=False)


def _entry_line(entry: JournalEntry) -> str:
    who = entry.identifier or entry.transport or "?"
    return f"{stamp(entry.t)} {who}: {entry.message}"


def line_cause(text: str) -> BootEnd | None:
    """The cause a kernel line names, if any: NVRM allocation failure, a fatal Xid, or the OOM killer."""
    nvrm = parse_nvrm(text)
    if isinstance(nvrm, NvrmError):
        return BootEnd.DRIVER_NO_MEMORY if nvrm.is_alloc_failure else None
    if isinstance(nvrm, XidLine):
        return BootEnd.XID if xid_info(nvrm).pages else None
    if _OOM.search(text):
        return BootEnd.KERNEL_OOM
    return None


def pstore_lines(record: PstoreRecord) -> list[str]:
    """The kernel lines of a dump, without their "<level>[ time] " prefix."""
    return [_PRINTK_PREFIX.sub("", line).strip() for line in record.text.splitlines()[1:] if line.strip()]


def panic_line(record: PstoreRecord) -> str | None:
    for line in pstore_lines(record):
        m = _PANIC.search(line)
        if m is not None:
            return line[m.start() :]
    return None


def is_panic(record: PstoreRecord) -> bool:
    return record.reason in PANIC_REASONS or panic_line(record) is not None


def _shutdown_marker(entries: Sequence[JournalEntry], end: float) -> JournalEntry | None:
    """The first orderly-shutdown line in the journal's last CLEAN_TAIL_S, unless journald started again after it."""
    marker: JournalEntry | None = None
    for entry in entries:
        if entry.t < end - CLEAN_TAIL_S:
            continue
        if entry.message_id == MSG_JOURNAL_STARTED and entry.from_journald:
            marker = None  # journald was restarted, not stopped for good
            continue
        if marker is not None:
            continue
        if (entry.message_id == MSG_JOURNAL_STOPPED and entry.from_journald) or (
            entry.from_pid1
            and (
                entry.identifier == "systemd-shutdown"
                or entry.message == "Shutting down."
                or (entry.message_id == MSG_UNIT_STARTED and entry.unit in SHUTDOWN_UNITS)
            )
        ):
            marker = entry
    return marker


def _journal_causes(entries: Sequence[JournalEntry], since: float) -> list[_Cause]:
    out: list[_Cause] = []
    for entry in entries:
        if entry.t < since:
            continue
        if entry.from_kernel:
            klass = line_cause(entry.message)
            if klass is not None:
                out.append(_Cause(entry.t, klass, _entry_line(entry)))
        elif entry.from_sparkwatch_unit and (
            entry.message.startswith(_SPARKWATCH_KILL) or f" {_SPARKWATCH_KILL}" in entry.message
        ):
            out.append(_Cause(entry.t, BootEnd.SPARKWATCH_KILL, _entry_line(entry)))
    return out


def _event_causes(events: Sequence[SparkwatchEvent], since: float) -> list[_Cause]:
    out: list[_Cause] = []
    for event in events:
        if event.t < since:
            continue
        klass = None
        if event.kind == "kill" and not event.dry_run:
            klass = BootEnd.SPARKWATCH_KILL
        elif event.kind == "driver_alloc_failed":
            klass = BootEnd.DRIVER_NO_MEMORY
        elif event.kind == "xid" and event.page:
            klass = BootEnd.XID
        if klass is not None:
            line = f"{stamp(event.t)} sparkwatch {event.kind}: {event.summary}"
            # named in the summary already (a record of this version), else from its fields
            missing = [c for c in event.containers if c.split(" (", 1)[0] not in event.summary]
            if missing:
                line += f" [{'; '.join(missing)}]"
            out.append(_Cause(event.t, klass, line, True))
    return out


def _pstore_causes(dumps: Sequence[PstoreRecord], at: float) -> list[_Cause]:
    """Causes in the dumps' text: after everything else (the dump is written as the kernel dies)."""
    out: list[_Cause] = []
    for i, record in enumerate(dumps):
        for j, line in enumerate(pstore_lines(record)):
            klass = line_cause(line)
            if klass is not None:
                out.append(_Cause(at + i + j * 1e-6, klass, f"pstore {record.name}: {line}"))
    return out


def _dedup_kills(causes: list[_Cause]) -> list[_Cause]:
    """A kill is in events.jsonl and as a KILL line in the journal: keep the event's words where both are there."""
    if not any(c.from_event and c.klass == BootEnd.SPARKWATCH_KILL for c in causes):
        return causes
    return [c for c in causes if c.from_event or c.klass != BootEnd.SPARKWATCH_KILL]


def engines_at_end(samples: Sequence[FlightSample]) -> tuple[EngineAtEnd, ...]:
    if not samples:
        return ()
    last = samples[-1]
    phases = {launched.pid: launched.phase for launched in last.launched}
    out = [EngineAtEnd(t.kind, t.root_pid, t.footprint_bytes, phases.pop(t.root_pid, None)) for t in last.trees]
    out += [EngineAtEnd(e.name, e.pid, None, e.phase) for e in last.launched if e.pid in phases]
    return tuple(out)


_SUMMARY = {
    BootEnd.KERNEL_OOM: "the kernel's OOM killer ran near the end",
    BootEnd.DRIVER_NO_MEMORY: "the NVIDIA driver failed to allocate memory (NV_ERR_NO_MEMORY) near the end",
    BootEnd.XID: "a GPU error that needs a reset or a reboot (Xid) near the end",
    BootEnd.SPARKWATCH_KILL: "sparkwatch's kill was the last memory event before the end",
}


def judge(boot: PreviousBoot) -> Verdict:
    journal = boot.journal
    journal_end = journal[-1].t if journal else None
    last_sample = boot.samples[-1].t if boot.samples else None
    ends = [t for t in (journal_end, last_sample, boot.events[-1].t if boot.events else None) if t is not None]
    ended_at = max(ends) if ends else None
    dumps = tuple(r for r in boot.pstore if r.name.startswith("dmesg") or r.reason is not None)
    panics = [r for r in dumps if is_panic(r)]
    notes: list[str] = []
    if boot.journal_note:
        notes.append(boot.journal_note)
    if boot.recorder_note:
        notes.append(boot.recorder_note)
    gap = None if journal_end is None or last_sample is None else round(journal_end - last_sample, 1)
    if gap is not None and gap > SILENT_GAP_S:
        notes.append(
            f"the flight recorder's last sample is {gap:.0f} s before the journal's end: sparkwatch had stopped "
            "(or wedged) before the box did"
        )
    if boot.samples and boot.samples[-1].stopping:
        notes.append(f"sparkwatch was stopped in order at {stamp(boot.samples[-1].t)}")

    def verdict(klass: BootEnd, summary: str, evidence: Sequence[str]) -> Verdict:
        return Verdict(
            boot_class=klass,
            summary=summary,
            evidence=tuple(evidence[-EVIDENCE_MAX:]),
            boot_id=boot.boot_id,
            ended_at=ended_at,
            journal_end_at=journal_end,
            last_sample_at=last_sample,
            sample_to_journal_end_s=gap,
            trend=pool_trend(boot.samples),
            engines=engines_at_end(boot.samples),
            pstore=tuple(r.name for r in dumps),
            notes=tuple(notes),
        )

    panic_evidence = [f"pstore {r.name}: {panic_line(r) or (r.reason or '') + ' record'}" for r in panics]
    causes: list[_Cause] = []
    if ended_at is not None:
        since = ended_at - NEAR_END_S
        causes = _journal_causes(journal or (), since) + _event_causes(boot.events, since)
        causes = _dedup_kills(causes)
    causes += _pstore_causes(panics, (ended_at or 0.0) + 1.0)
    causes.sort(key=lambda c: c.t)
    marker = _shutdown_marker(journal, journal_end) if journal and journal_end is not None else None
    if marker is not None and not panics:
        before = [c.line for c in causes if c.t <= marker.t]
        if before:
            notes.append(f"before the shutdown: {before[-1]}")
        return verdict(BootEnd.CLEAN, f"an orderly shutdown ({marker.message})", [_entry_line(marker)])
    if not journal and not panics:
        if boot.samples and boot.samples[-1].stopping:
            return verdict(BootEnd.UNKNOWN, "no journal of that boot; sparkwatch was stopped in order", [])
        if not causes:
            what = "no journal of that boot and no pstore dump" + (
                "; the flight recorder alone cannot tell a clean end from an abrupt one" if boot.samples else ""
            )
            return verdict(BootEnd.UNKNOWN, what, [])
    if causes:
        last = causes[-1]
        summary = _SUMMARY[last.klass]
        if panics:
            summary += f", then a kernel panic ({panics[0].name})"
        return verdict(last.klass, summary, [*(c.line for c in causes), *panic_evidence])
    if panics:
        return verdict(
            BootEnd.ABRUPT,
            f"a kernel panic with no memory or GPU line ({panic_line(panics[0]) or panics[0].name})",
            panic_evidence,
        )
    tail = [_entry_line(e) for e in (journal or ())[-3:]]
    return verdict(
        BootEnd.ABRUPT,
        "no shutdown record and no cause in the log: a power loss, a hard reset, or a wedge the kernel never logged",
        tail,
    )


def describe(verdict: Verdict) -> str:
    """One sentence: the class, the summary, and the pool's last minute when the recorder has it."""
    text = f"previous boot ended: {verdict.boot_class} ({verdict.summary})"
    if verdict.trend is not None:
        text += f"; last minute: {verdict.trend.words}"
    if verdict.engines:
        names = ", ".join(
            f"{e.kind} pid {e.pid}"
            + (f" {format_size(e.footprint_bytes)}" if e.footprint_bytes is not None else "")
            + (f" [{e.phase}]" if e.phase else "")
            for e in verdict.engines
        )
        text += f"; engines: {names}"
    return text


def verdict_fields(verdict: Verdict) -> dict[str, object]:
    """The verdict as the `previous_boot` event's fields and `sparkwatch postmortem --json` (docs/contract.md)."""
    trend = verdict.trend
    return {
        "class": verdict.boot_class,
        "verdict": verdict.summary,
        "evidence": list(verdict.evidence),
        "boot_id": verdict.boot_id,
        "ended_at": verdict.ended_at,
        "journal_end_at": verdict.journal_end_at,
        "last_sample_at": verdict.last_sample_at,
        "sample_to_journal_end_s": verdict.sample_to_journal_end_s,
        "trend": None
        if trend is None
        else {
            "span_s": trend.span_s,
            "samples": trend.samples,
            "first_available_bytes": trend.first_available_bytes,
            "last_available_bytes": trend.last_available_bytes,
            "min_available_bytes": trend.min_available_bytes,
            "change_bytes_per_s": round(trend.change_bytes_per_s, 1),
            "last_fill_rate_bytes_per_s": trend.last_fill_rate_bytes_per_s,
            "words": trend.words,
        },
        "engines": [
            {"kind": e.kind, "pid": e.pid, "footprint_bytes": e.footprint_bytes, "phase": e.phase}
            for e in verdict.engines
        ],
        "pstore": list(verdict.pstore),
        "notes": list(verdict.notes),
    }
