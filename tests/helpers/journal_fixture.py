"""Real systemd journal files holding two boots, built at test time from journal export text.

The export format (https://systemd.io/JOURNAL_EXPORT_FORMATS/): `NAME=value\\n` per field, or for a value with a
newline `NAME\\n<uint64 LE length><bytes>\\n`; an empty line ends an entry. `systemd-journal-remote` (Debian package
systemd-journal-remote) turns it into a journal file that `journalctl --directory DIR -b -1` reads as the previous
boot. What it needs, found by trying (systemd 252):
- `__REALTIME_TIMESTAMP` in every entry (without it: "Entry is invalid, ignoring.", and exit status 0) and
  `_BOOT_ID` as 32 lowercase hex digits (dashes, or none at all, and `--list-boots` finds no boot);
- each boot's entries together, boots in order, realtime increasing: interleaved boots drop one from the list;
- an output name ending in `.journal`, written fresh (it appends to an existing file);
- `SYSTEMD_JOURNAL_COMPACT=0 SYSTEMD_JOURNAL_KEYED_HASH=0 --compress=no` so an older journalctl reads it too.

The lines are the kernel's and systemd's own formats: mm/oom_kill.c (dump_header, dump_oom_summary,
__oom_kill_process, oom_reaper), NVRM lines as NVIDIA/open-gpu-kernel-modules#848 and #892 quote them, the Xid format
of the NVIDIA driver (`NVRM: Xid (PCI:…): <code>, pid=…, name=…, <text>`), a systemd 252 shutdown (PID 1's
"Shutting down.", systemd-shutdown's lines through /dev/kmsg, journald's "Journal stopped" with its catalog
MESSAGE_ID), and fs/pstore/platform.c's `Panic#1 Part1` header over printk's `<level>[seconds] text` lines.

Each entry carries the fields journald itself adds for its source, as systemd 252 writes them, since the verdict
trusts only those (core.postmortem.verdict, "Trusted sources"): a client's entry gets `_PID`, `_UID`, `_GID`, `_COMM`,
`_EXE`, `_CMDLINE` and the `_SYSTEMD_*` fields of its cgroup from the socket's credentials (journald-context.c);
journald's own lines (`_TRANSPORT=driver`) get its own; a line read back from /dev/kmsg gets none of them, only
`SYSLOG_IDENTIFIER` and `SYSLOG_PID` parsed from its "ident[pid]: " text (journald-kmsg.c dev_kmsg_record). A user's
forgeries are what `logger` (util-linux: /dev/log, `_TRANSPORT=syslog`, facility user, `--id=N` sets SYSLOG_PID),
`logger --journald` (any non-underscore field, `_TRANSPORT=journal`) and `systemd-cat` (`_TRANSPORT=stdout`, it execs
`cat` without a command) really produce.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkwatch.common.flightrec import RingWriter
from sparkwatch.core.postmortem.flight import FlightSample, TreeFootprint
from sparkwatch.core.units import GiB

JOURNAL_REMOTE = ("/lib/systemd/systemd-journal-remote", "/usr/lib/systemd/systemd-journal-remote")
MACHINE_ID = "5c1e7a0b9d8f4e2a8b6c4d2e0f1a3b5c"
HOST = "spark-a"
T0 = 1_763_632_800.0  # 2025-11-20 10:00:00 UTC: the previous boot starts here
STEP_S = 5.0
GAP_S = 90.0  # between the previous boot's last entry and the current boot's first

MSG_JOURNAL_STARTED = "f77379a8490b408bbe5f6940505a777b"
MSG_JOURNAL_STOPPED = "d93fb3c9c24d451a97cea615ce59c00b"
MSG_POWERING_DOWN = "98268866d1d54a499c4e98921d93bc40"
MSG_UNIT_STARTED = "39f53479d3a045ac8e11786248231fbf"

Fields = Mapping[str, str | int | bytes]
# Not a journal field (no field name has "@"): the seconds from this entry to the next, as text, where not STEP_S.
STEP_KEY = "@step_s"
USER_UID = 1000


def journal_remote() -> str | None:
    for path in JOURNAL_REMOTE:
        if os.access(path, os.X_OK):
            return path
    return None


def encode_field(name: str, value: str | int | bytes) -> bytes:
    data = value if isinstance(value, bytes) else str(value).encode()
    if any(c < 0x20 and c != 0x09 for c in data):
        return name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
    return name.encode() + b"=" + data + b"\n"


def encode_entry(fields: Fields) -> bytes:
    items = sorted(fields.items(), key=lambda kv: not kv[0].startswith("__"))
    return b"".join(encode_field(k, v) for k, v in items) + b"\n"


def kernel(message: str, priority: int = 6) -> dict[str, str | int | bytes]:
    return {
        "MESSAGE": message,
        "PRIORITY": priority,
        "_TRANSPORT": "kernel",
        "SYSLOG_IDENTIFIER": "kernel",
        "SYSLOG_FACILITY": 0,
    }


def pid1(message: str, **extra: str | int) -> dict[str, str | int | bytes]:
    return {
        "MESSAGE": message,
        "PRIORITY": 6,
        "_TRANSPORT": "journal",
        "SYSLOG_IDENTIFIER": "systemd",
        "SYSLOG_FACILITY": 3,
        "CODE_FILE": "src/core/unit.c",
        "_PID": 1,
        "_UID": 0,
        "_GID": 0,
        "_COMM": "systemd",
        "_EXE": "/usr/lib/systemd/systemd",
        "_CMDLINE": "/sbin/init splash",
        "_SYSTEMD_CGROUP": "/init.scope",
        "_SYSTEMD_UNIT": "init.scope",
        "_SYSTEMD_SLICE": "-.slice",
        **extra,
    }


def service(
    ident: str, pid: int, message: str, transport: str = "journal", **extra: str | int | bytes
) -> dict[str, str | int | bytes]:
    """A line of a system service that runs as root (`<ident>.service`)."""
    return {
        "MESSAGE": message,
        "PRIORITY": 6,
        "_TRANSPORT": transport,
        "SYSLOG_IDENTIFIER": ident,
        "SYSLOG_FACILITY": 3,
        "_PID": pid,
        "_UID": 0,
        "_GID": 0,
        "_COMM": ident[:15],
        "_EXE": f"/usr/lib/systemd/{ident}",
        "_CMDLINE": f"/lib/systemd/{ident}",
        "_SYSTEMD_CGROUP": f"/system.slice/{ident}.service",
        "_SYSTEMD_UNIT": f"{ident}.service",
        "_SYSTEMD_SLICE": "system.slice",
        **extra,
    }


def _session(pid: int, comm: str, exe: str, cmdline: str, uid: int) -> dict[str, str | int | bytes]:
    """What journald adds for a process in a user's login session (an ssh shell's session-3.scope)."""
    return {
        "_PID": pid,
        "_UID": uid,
        "_GID": uid,
        "_COMM": comm,
        "_EXE": exe,
        "_CMDLINE": cmdline,
        "_AUDIT_LOGINUID": uid,
        "_AUDIT_SESSION": 3,
        "_SYSTEMD_CGROUP": f"/user.slice/user-{uid}.slice/session-3.scope",
        "_SYSTEMD_SESSION": 3,
        "_SYSTEMD_UNIT": "session-3.scope",
        "_SYSTEMD_SLICE": f"user-{uid}.slice",
        "_SYSTEMD_OWNER_UID": uid,
    }


def user_process(comm: str, pid: int, message: str, uid: int = USER_UID) -> dict[str, str | int | bytes]:
    """A user's program's output in the journal (a user unit's stdout)."""
    return {
        "MESSAGE": message,
        "PRIORITY": 6,
        "_TRANSPORT": "stdout",
        "SYSLOG_IDENTIFIER": comm,
        "SYSLOG_FACILITY": 3,
        **_session(pid, comm[:15], f"/usr/bin/{comm}", comm, uid),
    }


def logger(
    message: str, tag: str, *, pid: int = 20900, uid: int = USER_UID, syslog_pid: int | None = None
) -> dict[str, str | int | bytes]:
    """util-linux `logger -t TAG [--id=N] MESSAGE` as a user: RFC 3164 over /dev/log, facility user, notice."""
    fields: dict[str, str | int | bytes] = {
        "MESSAGE": message,
        "PRIORITY": 5,
        "SYSLOG_FACILITY": 1,
        "SYSLOG_IDENTIFIER": tag,
        "SYSLOG_TIMESTAMP": "Nov 20 10:10:00 ",
        "_TRANSPORT": "syslog",
        **_session(pid, "logger", "/usr/bin/logger", f"logger -t {tag} {message}", uid),
    }
    if syslog_pid is not None:
        fields["SYSLOG_PID"] = syslog_pid
    return fields


def logger_journald(fields: Fields, *, pid: int = 20901, uid: int = USER_UID) -> dict[str, str | int | bytes]:
    """util-linux `logger --journald=FILE` as a user: FILE's NAME=value lines as they are (sd_journal_sendv), any
    field a client may set, over the native protocol."""
    return {**fields, "_TRANSPORT": "journal", **_session(pid, "logger", "/usr/bin/logger", "logger --journald", uid)}


def systemd_cat(message: str, tag: str, *, pid: int = 20902, uid: int = USER_UID) -> dict[str, str | int | bytes]:
    """`echo MESSAGE | systemd-cat -t TAG` as a user: a stdout stream; with no command, systemd-cat execs `cat`."""
    return {
        "MESSAGE": message,
        "PRIORITY": 6,
        "SYSLOG_IDENTIFIER": tag,
        "_TRANSPORT": "stdout",
        "_STREAM_ID": "5f0c8f7a3c9e4f1b9d2e6a7b8c9d0e1f",
        **_session(pid, "cat", "/usr/bin/cat", "cat", uid),
    }


def sparkwatch_line(message: str, priority: int = 6) -> dict[str, str | int | bytes]:
    """The guard's log line as a user unit (sparkwatch.service under user@1000.service): common.logs sends it over
    journald's native protocol."""
    return {
        "MESSAGE": message,
        "PRIORITY": priority,
        "SYSLOG_IDENTIFIER": "sparkwatch",
        "SPARKWATCH_PROCESS": "guard",
        "CODE_FILE": "/home/spark/.venv/lib/python3.12/site-packages/sparkwatch/guard/killer.py",
        "_TRANSPORT": "journal",
        "_PID": 1042,
        "_UID": USER_UID,
        "_GID": USER_UID,
        "_COMM": "sparkwatch",
        "_EXE": "/usr/bin/python3.12",
        "_CMDLINE": "/home/spark/.venv/bin/python3 /home/spark/.venv/bin/sparkwatch run",
        "_SYSTEMD_CGROUP": f"/user.slice/user-{USER_UID}.slice/user@{USER_UID}.service/app.slice/sparkwatch.service",
        "_SYSTEMD_UNIT": f"user@{USER_UID}.service",
        "_SYSTEMD_USER_UNIT": "sparkwatch.service",
        "_SYSTEMD_SLICE": f"user-{USER_UID}.slice",
        "_SYSTEMD_USER_SLICE": "app.slice",
        "_SYSTEMD_OWNER_UID": USER_UID,
    }


def via_kmsg(ident: str, pid: int, message: str) -> dict[str, str | int | bytes]:
    """A process's line written to /dev/kmsg (systemd-shutdown): kernel transport, but its own facility and name."""
    return {
        "MESSAGE": message,
        "PRIORITY": 6,
        "_TRANSPORT": "kernel",
        "SYSLOG_FACILITY": 3,
        "SYSLOG_IDENTIFIER": ident,
        "SYSLOG_PID": pid,
    }


def boot_start(journald_pid: int = 301) -> list[Fields]:
    return [
        kernel("Linux version 6.11.0-1016-nvidia (buildd@bos03-arm64-012) #16-Ubuntu SMP PREEMPT_DYNAMIC", 5),
        service("systemd-journald", journald_pid, "Journal started", "driver", MESSAGE_ID=MSG_JOURNAL_STARTED),
        pid1(
            "Reached target multi-user.target - Multi-User System.",
            MESSAGE_ID=MSG_UNIT_STARTED,
            UNIT="multi-user.target",
        ),
        kernel("NVRM: loading NVIDIA UNIX Open Kernel Module for aarch64  580.95.05"),
        sparkwatch_line("sparkwatch: running: floor 8192 MiB, metrics on 127.0.0.1:9847"),
    ]


# --- what ends a boot

OOM = [
    kernel(
        "python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0", 4
    ),
    kernel(
        "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,"
        "task_memcg=/user.slice/user-1000.slice/session-3.scope,task=python3,pid=20311,uid=1000"
    ),
    kernel(
        "Out of memory: Killed process 20311 (python3) total-vm:98765432kB, anon-rss:61234567kB, "
        "file-rss:10240kB, shmem-rss:0kB, UID:1000 pgtables:121212kB oom_score_adj:0",
        3,
    ),
    kernel("oom_reaper: reaped process 20311 (python3), now anon-rss:0kB, file-rss:0kB, shmem-rss:0kB"),
]
NVRM_NO_MEMORY = [
    kernel(
        "NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from "
        "_memdescAllocInternal(pMemDesc) @ mem_desc.c:1353",
        4,
    ),
    kernel(
        "NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned "
        "from status @ kernel_gsp.c:4615",
        4,
    ),
]
XID_79 = [
    kernel("NVRM: GPU at PCI:000f:01:00: GPU-3f2a1b0c-9d8e-7f6a-5b4c-3d2e1f0a9b8c", 4),
    kernel("NVRM: Xid (PCI:000f:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", 4),
    kernel("NVRM: GPU 000f:01:00.0: GPU has fallen off the bus.", 3),
]
XID_31 = [  # an application's MMU fault: the GPU carries on, not a cause
    kernel(
        "NVRM: Xid (PCI:000f:01:00): 31, pid=20311, name=python3, Ch 00000008, intr 00000000. MMU Fault: "
        "ENGINE GRAPHICS GPCCLIENT_T1_8 faulted @ 0x7f3a_1c000000. Fault is of type FAULT_PDE "
        "ACCESS_TYPE_VIRT_WRITE",
        4,
    ),
]
SPARKWATCH_KILL = [
    sparkwatch_line(
        "sparkwatch: KILL vllm tree root=4242 (9 processes): MemAvailable 4726 MiB <= floor "
        "8192 MiB [grew 6.2 GiB in 4.0 s]",
        3,
    ),
]
APP_OOM = [  # a process saying "out of memory" is not the kernel's OOM killer
    user_process("python3", 20311, "torch.OutOfMemoryError: CUDA out of memory. Out of memory: Killed process 1 (x)"),
]
# A systemd 252 poweroff, each line from the process that writes it: PID 1 through the journal, systemd-shutdown
# (PID 1 after systemd execs it) through /dev/kmsg until its SIGTERM stops journald, journald itself last.
CLEAN = [
    service("systemd-logind", 612, "System is powering down.", MESSAGE_ID=MSG_POWERING_DOWN),
    pid1("Stopping sparkwatch.service - sparkwatch...", UNIT="sparkwatch.service"),
    pid1("Reached target shutdown.target - System Shutdown.", MESSAGE_ID=MSG_UNIT_STARTED, UNIT="shutdown.target"),
    pid1("Shutting down."),
    via_kmsg("systemd-shutdown", 1, "Syncing filesystems and block devices."),
    via_kmsg("systemd-shutdown", 1, "Sending SIGTERM to remaining processes..."),
    service("systemd-journald", 301, "Received SIGTERM from PID 1 (systemd-shutdown).", "driver"),
    service("systemd-journald", 301, "Journal stopped", "driver", MESSAGE_ID=MSG_JOURNAL_STOPPED),
]
ACTIVITY = [sparkwatch_line("sparkwatch: re-armed: MemAvailable 61234 MiB")]

PANIC_KMSG = (
    (6, "sysrq: Trigger a crash"),
    (0, "Kernel panic - not syncing: sysrq triggered crash"),
    (4, "CPU: 3 PID: 20555 Comm: bash Tainted: P           OE      6.11.0-1016-nvidia #16-Ubuntu"),
    (4, "Call trace:"),
    (4, " panic+0x118/0x2ed"),
)
PANIC_ON_OOM_KMSG = (
    (4, "python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0"),
    (0, "Kernel panic - not syncing: Out of memory: system-wide panic_on_oom is enabled"),
)


def pstore_text(lines: Sequence[tuple[int, str]], base_s: float, reason: str = "Panic") -> str:
    """fs/pstore/platform.c pstore_dump: "<reason>#<count> Part<n>\\n", then kmsg_dump_get_buffer(syslog=true)."""
    body = [f"{reason}#1 Part1"]
    for i, (level, text) in enumerate(lines):
        body.append(f"<{level}>[{base_s + i * 1e-5:12.6f}] {text}")
    return "\n".join(body) + "\n"


@dataclass(frozen=True)
class TwoBoots:
    directory: Path  # journalctl --directory
    previous_boot: str
    current_boot: str
    previous_end: float  # realtime of the previous boot's last entry
    current_start: float


def build_export(boots: Sequence[tuple[str, float, Sequence[Fields]]]) -> bytes:
    out = []
    for boot_id, start, lines in boots:
        t, mono = start, 1.0
        for item in lines:
            fields: dict[str, str | int | bytes] = {
                "__REALTIME_TIMESTAMP": int(t * 1e6),
                "__MONOTONIC_TIMESTAMP": int(mono * 1e6),
                "_BOOT_ID": boot_id,
                "_MACHINE_ID": MACHINE_ID,
                "_HOSTNAME": HOST,
                **item,
            }
            step = float(fields.pop(STEP_KEY, STEP_S))
            out.append(encode_entry(fields))
            t += step
            mono += step
    return b"".join(out)


def write_journal(directory: Path, export: bytes) -> None:
    tool = journal_remote()
    assert tool is not None, "systemd-journal-remote is not installed"
    if directory.exists():
        shutil.rmtree(directory)  # journal-remote appends to an existing file
    directory.mkdir(parents=True)
    env = {**os.environ, "SYSTEMD_JOURNAL_COMPACT": "0", "SYSTEMD_JOURNAL_KEYED_HASH": "0"}
    done = subprocess.run(
        [tool, "--compress=no", f"--output={directory / 'system.journal'}", "-"],
        input=export,
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0 and b"invalid" not in done.stderr, done.stderr.decode(errors="replace")


def two_boots(
    directory: Path,
    ending: Sequence[Fields],
    *,
    current_extra: Sequence[Fields] = (),
    previous_boot: str | None = None,
    current_boot: str | None = None,
    only_current: bool = False,
) -> TwoBoots:
    """A journal of two boots: the previous one starts normally, then `ending`; the current one starts GAP_S later
    (with `current_extra` after its first lines, e.g. systemd-pstore's). `only_current`: the previous boot left nothing
    in the journal (volatile storage)."""
    prev = previous_boot or uuid.uuid4().hex
    cur = current_boot or uuid.uuid4().hex
    prev_lines = [*boot_start(), *ACTIVITY, *ending]
    prev_end = T0 + sum(float(item.get(STEP_KEY, STEP_S)) for item in prev_lines[:-1])
    cur_start = prev_end + GAP_S
    cur_lines = [*boot_start(298), *current_extra]
    boots = [(cur, cur_start, cur_lines)] if only_current else [(prev, T0, prev_lines), (cur, cur_start, cur_lines)]
    write_journal(directory, build_export(boots))
    return TwoBoots(directory, prev, cur, prev_end, cur_start)


def pstore_moved_entry(name: str, text: str) -> Fields:
    """systemd-pstore's journal entry for a dump it moved (src/pstore/pstore.c: MESSAGE and the text in FILE=)."""
    return service("systemd-pstore", 280, f"PStore {name} moved to /var/lib/systemd/pstore/{name}", FILE=text.encode())


def write_ring(state: Path, boot_id: str, end: float, name: str = "recorder.prev.ring") -> list[FlightSample]:
    """A flight recorder ring of `boot_id` whose last of 91 one-a-second samples is at `end`: MemAvailable draining
    0.5 GiB/s, one vllm tree growing. Renamed to `name` (recorder.prev.ring: as the guard leaves it at a new boot)."""
    samples = [
        FlightSample(
            t=end - 90 + i,
            available_bytes=(60 - i // 2) * GiB,
            free_bytes=(60 - i // 2) * GiB // 2,
            cached_bytes=3 * GiB,
            shmem_bytes=GiB,
            fill_rate_bytes_per_s=GiB / 2,
            interval_s=0.1,
            near_floor=i > 60,
            guard_phase="watch",
            kills=0,
            engines=1,
            trees=(TreeFootprint("vllm", 4242, (20 + i // 2) * GiB),),
            trees_age_s=0.5,
        )
        for i in range(91)
    ]
    state.mkdir(parents=True, exist_ok=True)
    writer = RingWriter(state / "recorder.ring", 100, boot_id)
    writer.open()
    for s in samples:
        writer.write(s)
    writer.close()
    if name != "recorder.ring":
        (state / "recorder.ring").rename(state / name)
    return samples
