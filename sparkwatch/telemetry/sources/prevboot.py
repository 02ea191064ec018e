"""What is left of the previous boot: its journal (journalctl), pstore dumps, the flight recorder and events.jsonl.

The journal. `journalctl -b -1` names the boot before the *last boot in the journal files*, and `-b 0` the running
kernel's boot: on a live system whose current boot is not in the files yet (journald not flushed, volatile storage)
`-b -1` silently means the boot before the previous one. So the boots are listed (`--list-boots -o json`), the
previous one is the entry before the running boot id (/proc/sys/kernel/random/boot_id), or the last entry when the
running boot is not listed, and it is then read by its explicit id. With `--directory DIR` (a journal copied from
another box, a test's fixture) or `--root`, the last boot in the files stands for the current one, as journalctl
itself takes it. journalctl prints a value that is not valid UTF-8 as an array of bytes, and one over 4096 bytes as
null without `--all`: both are handled.

The tail is taken per source: the last TAIL_ENTRIES of the kernel (`_TRANSPORT=kernel`), of PID 1 (`_PID=1`), of
journald (`_TRANSPORT=driver`), of systemd-pstore's unit and of sparkwatch's own unit, and the last TAIL_ENTRIES of
everything (the user lines), merged by cursor. Any user can write thousands of lines a second (`logger`): one tail of
the whole boot let 5,001 of them after an OOM kill push the kernel's lines out of it. Which source a line really came
from is judged by the fields journald adds itself (core.postmortem.verdict, "Trusted sources"); the matches here only
make sure each source's last lines are read.

pstore (fs/pstore/inode.c): files named `<type>-<backend>-<id>` (`dmesg-ramoops-0`, `dmesg-efi-171455765701001`)
whose text starts with `<reason>#<count> Part<n>` (fs/pstore/platform.c pstore_dump: `Panic#1 Part1`). They are read
from <root>/sys/fs/pstore, from <root>/var/lib/systemd/pstore (where systemd-pstore.service moves them early in the
next boot: Debian enables it by default, systemd's pstore.conf Storage=external), and from systemd-pstore's journal
entries of the current boot (`PStore <name> moved to <dest>`, with the file's text in FILE=): only those of
systemd-pstore.service running as root, since any user can log SYSLOG_IDENTIFIER=systemd-pstore with a FILE= of
their choosing (`logger --journald`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparkwatch.common.durable import StateFileError, read_regular
from sparkwatch.common.eventlog import read_events
from sparkwatch.common.flightrec import RingContents, read_ring, recorder_paths
from sparkwatch.common.sources.boot import normalize_boot_id
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.postmortem.verdict import (
    SPARKWATCH_UNIT,
    JournalEntry,
    PreviousBoot,
    PstoreRecord,
    SparkwatchEvent,
    event_containers,
)
from sparkwatch.core.timestamps import parse_rfc3339

JOURNALCTL_TIMEOUT_S = 60.0  # a big journal on a slow disk takes seconds; this runs off the guard, once per boot
TAIL_ENTRIES = 5000  # each source's last entries of the previous boot: its last minutes, whatever it logged before
FIELDS = (
    "MESSAGE,SYSLOG_IDENTIFIER,_TRANSPORT,MESSAGE_ID,UNIT,_PID,SYSLOG_FACILITY,_UID,_COMM,SYSLOG_PID,_SYSTEMD_UNIT,"
    "_SYSTEMD_USER_UNIT"
)
PSTORE_UNIT = "systemd-pstore.service"
# Each source's tail (journalctl matches: fields ANDed). The trusted sources first; () is every line, users' included.
SOURCES: tuple[tuple[str, ...], ...] = (
    ("_TRANSPORT=kernel",),
    ("_PID=1",),
    ("_TRANSPORT=driver",),
    (f"_SYSTEMD_UNIT={PSTORE_UNIT}",),
    (f"_SYSTEMD_UNIT={SPARKWATCH_UNIT}",),
    (f"_SYSTEMD_USER_UNIT={SPARKWATCH_UNIT}",),
    (),
)
LINE_MAX_BYTES = 1 << 16  # one JSON line of journalctl; longer ones are skipped
PSTORE_DIRS = ("sys/fs/pstore", "var/lib/systemd/pstore")
PSTORE_FILE_MAX_BYTES = 256 << 10  # a dump is a few KiB (ramoops record_size, EFI variables of 1-2 KiB)
PSTORE_FILES_MAX = 64
PSTORE_DEPTH_MAX = 3  # systemd-pstore: <dir>/<id>/<file> (252), <dir>/<timestamp>/<nnn>/<file> (253+)
UNKNOWN_WINDOW_S = 86400.0  # without the previous boot's start, a moved dump counts when it is this recent
EVENTS_READ = 2000  # the last events of events.jsonl looked at
_HEADER = re.compile(r"^(\w+)#(\d+) Part(\d+)")
_MOVED = re.compile(r"^PStore (\S+) moved to (\S+)")


@dataclass(frozen=True, slots=True)
class Boot:
    boot_id: str
    first_s: float | None
    last_s: float | None


@dataclass
class JournalReader:
    """journalctl against the system journal (`directory` and `root` None), a journal directory, or a root."""

    directory: Path | None = None
    root: Path | None = None
    running_boot_id: str | None = None
    journalctl: str = "journalctl"
    notes: list[str] = field(default_factory=list)

    @property
    def live(self) -> bool:
        return self.directory is None and self.root is None

    def _args(self) -> list[str]:
        if self.directory is not None:
            return ["--directory", str(self.directory)]
        if self.root is not None:
            return ["--root", str(self.root)]
        return []

    def _run(self, *args: str) -> str | None:
        exe = shutil.which(self.journalctl)
        if exe is None:
            self.notes.append("journalctl not found: no journal to read")
            return None
        cmd = [exe, "-q", "--no-pager", *self._args(), *args]
        env = {**os.environ, "SYSTEMD_PAGER": "cat", "SYSTEMD_COLORS": "0", "LC_ALL": "C.UTF-8"}
        try:
            done = subprocess.run(
                cmd, capture_output=True, timeout=JOURNALCTL_TIMEOUT_S, stdin=subprocess.DEVNULL, env=env
            )
        except subprocess.TimeoutExpired:
            self.notes.append(f"journalctl did not answer within {JOURNALCTL_TIMEOUT_S:.0f} s")
            return None
        except OSError as exc:
            self.notes.append(f"journalctl could not run: {exc.strerror or exc}")
            return None
        if done.returncode != 0:
            err = done.stderr.decode(errors="replace").strip().splitlines()
            self.notes.append(f"journalctl exited {done.returncode}: {err[-1] if err else ''}".strip())
            return None
        return done.stdout.decode("utf-8", errors="replace")

    def boots(self) -> list[Boot]:
        out = self._run("--list-boots", "-o", "json")
        if not out or not out.strip():
            return []  # no journal files at all: journalctl prints nothing, not []
        try:
            data = json.loads(out)
        except ValueError:
            return self._boots_from_table()  # an older journalctl ignores -o for --list-boots
        boots = []
        for item in data if isinstance(data, list) else []:
            if not isinstance(item, dict):
                continue
            boot_id = normalize_boot_id(str(item.get("boot_id", "")))
            if boot_id is not None:
                boots.append(Boot(boot_id, _usec(item.get("first_entry")), _usec(item.get("last_entry"))))
        return boots

    def _boots_from_table(self) -> list[Boot]:
        """`--list-boots` as a table (" -1 <boot id> <first> <last>"): the ids, in order, without times."""
        out = self._run("--list-boots") or ""
        boots = []
        for line in out.splitlines():
            parts = line.split()
            boot_id = normalize_boot_id(parts[1]) if len(parts) > 1 else None
            if boot_id is not None:
                boots.append(Boot(boot_id, None, None))
        return boots

    def previous_and_current(self, boots: Sequence[Boot]) -> tuple[Boot | None, Boot | None]:
        """(the previous boot, the current one as the journal has it) by the rule in the module's docstring."""
        if not boots:
            return None, None
        if self.live:
            ids = [b.boot_id for b in boots]
            if self.running_boot_id in ids:
                at = ids.index(self.running_boot_id)
                return (boots[at - 1] if at > 0 else None), boots[at]
            return boots[-1], None  # this boot is not in the files yet: the last one listed came before it
        return (boots[-2] if len(boots) > 1 else None), boots[-1]

    def entries(self, boot_id: str) -> list[JournalEntry]:
        """The boot's last entries, TAIL_ENTRIES per source (SOURCES), each entry once, oldest first."""
        seen: dict[str, JournalEntry] = {}
        for matches in SOURCES:
            out = self._run(
                "-b", boot_id, "-o", "json", "--all", "-n", str(TAIL_ENTRIES), f"--output-fields={FIELDS}", *matches
            )
            for line in (out or "").splitlines():
                if len(line) > LINE_MAX_BYTES:
                    continue
                keyed = _entry(line)
                if keyed is not None:
                    seen.setdefault(keyed[0], keyed[1])
        return sorted(seen.values(), key=lambda e: e.t)

    def pstore_moves(self, current: Boot | None) -> list[PstoreRecord]:
        """systemd-pstore's entries in the current boot: the dumps it moved, with their text."""
        which = current.boot_id if current is not None else ("0" if self.live else None)
        if which is None:
            return []
        out = self._run("-b", which, f"_SYSTEMD_UNIT={PSTORE_UNIT}", "_UID=0", "-o", "json", "--all")
        records = []
        for line in (out or "").splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if not isinstance(item, dict):
                continue
            if _text(item.get("_SYSTEMD_UNIT")) != PSTORE_UNIT or _int(item.get("_UID")) != 0:
                continue  # the match again, on what came back: never a user's entry
            m = _MOVED.match(_text(item.get("MESSAGE")))
            text = _text(item.get("FILE"))
            if m is None or not text:
                continue
            header = _HEADER.match(text)
            records.append(
                PstoreRecord(
                    m.group(1),
                    header.group(1) if header else None,
                    _usec(item.get("__REALTIME_TIMESTAMP")),
                    text,
                    f"journal ({m.group(2)})",
                )
            )
        return records


def _usec(value: object) -> float | None:
    if isinstance(value, int):
        return value / 1e6
    if isinstance(value, str) and value.isdigit():
        return int(value) / 1e6
    return None


def _text(value: object) -> str:
    """A journal JSON value: a string, an array of bytes (not UTF-8, or control characters), or null (too long)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(b, int) and 0 <= b < 256 for b in value):
        return bytes(value).decode("utf-8", errors="replace")
    return ""


def _int(value: object) -> int | None:
    text = _text(value)
    return int(text) if text.isdigit() else None


def _entry(line: str) -> tuple[str, JournalEntry] | None:
    """(the entry's cursor, the entry): journalctl prints __CURSOR whatever --output-fields says."""
    try:
        item = json.loads(line)
    except ValueError:
        return None
    if not isinstance(item, dict):
        return None
    t = _usec(item.get("__REALTIME_TIMESTAMP"))
    cursor = _text(item.get("__CURSOR"))
    if t is None or not cursor:
        return None
    return cursor, JournalEntry(
        t=t,
        message=_text(item.get("MESSAGE")),
        identifier=_text(item.get("SYSLOG_IDENTIFIER")),
        transport=_text(item.get("_TRANSPORT")),
        message_id=_text(item.get("MESSAGE_ID")),
        unit=_text(item.get("UNIT")),
        pid=_int(item.get("_PID")),
        facility=_int(item.get("SYSLOG_FACILITY")),
        uid=_int(item.get("_UID")),
        comm=_text(item.get("_COMM")),
        syslog_pid=_int(item.get("SYSLOG_PID")),
        systemd_unit=_text(item.get("_SYSTEMD_UNIT")),
        user_unit=_text(item.get("_SYSTEMD_USER_UNIT")),
    )


# --- pstore


def read_pstore(root: Path, since: float | None, until: float | None) -> list[PstoreRecord]:
    """Dumps from the previous boot: in /sys/fs/pstore those not newer than this boot's start (`until`), in
    /var/lib/systemd/pstore those not older than the previous boot's start (`since`), which also keeps the dumps
    systemd-pstore moved early in this boot (the move may give them a new mtime)."""
    out: list[PstoreRecord] = []
    for rel in PSTORE_DIRS:
        base = root / rel
        moved = rel != PSTORE_DIRS[0]
        for path in _files(base):
            if len(out) >= PSTORE_FILES_MAX:
                return out
            try:
                mtime = os.stat(path, follow_symlinks=False).st_mtime
                data = read_regular(path, PSTORE_FILE_MAX_BYTES)
            except (OSError, StateFileError):
                continue
            if moved and since is not None and mtime < since:
                continue  # an older boot's dump: systemd-pstore keeps them all
            if not moved and until is not None and mtime > until + 60:
                continue  # written in this boot (an Oops it survived)
            text = data.decode("utf-8", errors="replace")
            header = _HEADER.match(text)
            out.append(PstoreRecord(path.name, header.group(1) if header else None, mtime, text, str(path)))
    return out


def _files(base: Path, depth: int = 0) -> list[Path]:
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    out: list[Path] = []
    for name in names:
        path = base / name
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and depth < PSTORE_DEPTH_MAX:
            out += _files(path, depth + 1)
        elif stat.S_ISREG(st.st_mode) and name != "dmesg.txt":  # systemd's concatenation of the parts: a copy
            out.append(path)
    return out


def merge_pstore(*groups: Sequence[PstoreRecord]) -> tuple[PstoreRecord, ...]:
    """One record per name, the first source that has it winning (files before journal copies)."""
    seen: dict[str, PstoreRecord] = {}
    for group in groups:
        for record in group:
            seen.setdefault(record.name, record)
    return tuple(seen.values())


# --- sparkwatch's own record


def pick_ring(
    state_dir: Path, previous_id: str | None, running_id: str | None, notes: list[str] | None = None
) -> RingContents | None:
    """The previous boot's flight recorder: the ring whose boot id is the previous boot's, else the newest that is
    not this boot's (the guard moves another boot's ring aside as it starts; before that it is still the main one).
    A file refused as it is read (a header that does not fit the file, a symlink) adds one line to `notes`."""
    rings = []
    for path in recorder_paths(state_dir):
        try:
            ring = read_ring(path)
        except StateFileError as exc:
            if notes is not None:
                notes.append(f"flight recorder {exc.filename}: {exc.strerror}")
            ring = None
        except OSError:
            ring = None
        if ring is not None and ring.samples:
            rings.append(ring)
    for ring in rings:
        if previous_id is not None and ring.boot_id == previous_id:
            return ring
    others = [r for r in rings if r.boot_id != (running_id or "") and r.boot_id]
    return max(others, key=lambda r: r.last_sample_at or 0.0) if others else None


def boot_events(events_path: Path, since: float | None, until: float | None) -> tuple[SparkwatchEvent, ...]:
    out = []
    try:
        raw = read_events(events_path, EVENTS_READ)
    except (OSError, StateFileError):
        return ()
    for item in raw:
        t = _ts(item.get("ts"))
        kind = str(item.get("kind"))
        if t is None or kind == EventKind.PREVIOUS_BOOT:
            continue
        if (since is not None and t < since) or (until is not None and t > until):
            continue
        out.append(
            SparkwatchEvent(
                t,
                kind,
                str(item.get("summary", "")),
                item.get("dry_run") is True,
                item.get("page") is True,
                event_containers(item.get("containers")),
            )
        )
    return tuple(out)


def _ts(value: object) -> float | None:
    return parse_rfc3339(value) if isinstance(value, str) else None


@dataclass(frozen=True, slots=True)
class Gathered:
    boot: PreviousBoot
    running_boot_id: str | None
    ring: RingContents | None


def gather(
    *,
    state_dir: Path,
    root: Path,
    running_boot_id: str | None,
    boot_started_at: float | None,
    journal_dir: Path | None = None,
    journalctl: str = "journalctl",
) -> Gathered:
    """Everything about the previous boot, read once. Never raises for a missing or unreadable source: what could
    not be read is said in the journal note."""
    reader = JournalReader(
        directory=journal_dir,
        root=root if journal_dir is None and str(root) != "/" else None,
        running_boot_id=running_boot_id,
        journalctl=journalctl,
    )
    boots = reader.boots()
    previous, current = reader.previous_and_current(boots)
    entries = reader.entries(previous.boot_id) if previous is not None else []
    started = previous.first_s if previous is not None else None
    # The current boot's start: from /proc/stat on the live system, else from the journal that stands for it.
    until = boot_started_at if reader.live or current is None else current.first_s
    since = started if started is not None else (None if until is None else until - UNKNOWN_WINDOW_S)
    pstore = merge_pstore(read_pstore(root, since, until), reader.pstore_moves(current))
    ring_notes: list[str] = []
    ring = pick_ring(state_dir, previous.boot_id if previous is not None else None, running_boot_id, ring_notes)
    samples = tuple(s for s in ring.samples if until is None or s.t <= until) if ring is not None else ()
    events = boot_events(state_dir / "events.jsonl", since, until)
    where = "the system journal" if reader.live else f"journal {journal_dir or reader.root}"
    if previous is None:
        note = f"no previous boot in {where}" + (f" ({'; '.join(reader.notes)})" if reader.notes else "")
    elif not entries:
        note = f"boot {previous.boot_id} in {where} has no readable entries" + (
            f" ({'; '.join(reader.notes)})" if reader.notes else ""
        )
    elif not any(e.transport == "kernel" for e in entries):
        note = f"{where} shows no kernel lines of that boot: run as root or in the systemd-journal group to see them"
    else:
        note = ""
    sys_pstore = root / PSTORE_DIRS[0]
    if sys_pstore.is_dir() and not os.access(sys_pstore, os.R_OK | os.X_OK):
        note = "; ".join(n for n in (note, f"{sys_pstore} is not readable by this user (root only)") if n)
    boot = PreviousBoot(
        boot_id=previous.boot_id if previous is not None else (ring.boot_id if ring is not None else None),
        started_at=started,
        journal=tuple(entries) if entries else None,
        journal_note=note,
        recorder_note="; ".join(ring_notes),
        pstore=pstore,
        samples=samples,
        events=events,
    )
    return Gathered(boot, running_boot_id, ring)
