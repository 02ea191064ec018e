"""What a killed engine left in /dev/shm, and which of it may go (wait-settled, launch, doctor, telemetry).

A SIGKILLed engine runs no cleanup: its named shared memory stays in /dev/shm, a tmpfs whose pages count against
MemAvailable (on a Spark, the whole unified pool) until someone unlinks them or the box reboots. With Docker's
`--ipc=host` a container's engine writes the host's /dev/shm, and `docker kill` leaves the same files there. Each
emergency kill can thus shrink the pool a little more.

An orphan is a regular file there that no live process maps or holds open (a process with only an fd open holds it:
it may map it again). `--fix` removes an orphan only when all of these hold:
- the scan is certain: every live process was read. A user who is not root cannot read other users' /proc entries,
  and any of those processes may hold any file; then the files are named, "uncertain", and nothing is removed;
- the caller owns the file, or is root (the kernel's own rule for the sticky /dev/shm);
- its name is one the engines give their segments (ENGINE_PREFIXES). An orphan of another program is named and left:
  a database's persistent segment or a program's lock file may be unmapped by design, and only its owner knows;
- it is still an orphan at a second scan right before the unlink (the caller's job, cli/shmleft.py).

Pure: the scan comes in as data (telemetry/sources/shmfiles.py reads it).
"""

from __future__ import annotations

from collections.abc import Sequence

from sparkwatch.core.model import ShmFile, ShmLeft, ShmScan
from sparkwatch.core.redact import safe_text
from sparkwatch.core.units import format_size
from sparkwatch.core.words import plural

# The names engines give their shared memory, and whose they are. Only these are ever removed.
ENGINE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("psm_", "Python's multiprocessing.shared_memory: vLLM's shm_broadcast message queues, SGLang's"),
    ("sem.mp-", "Python's multiprocessing semaphores (sem_open; glibc keeps them as sem.<name>)"),
    ("nccl-", "NCCL's shared-memory transport between the ranks of one node"),
    ("torch_", "PyTorch's tensors shared between processes (torch_<pid>_<n>)"),
    ("vllm", "vLLM's own named segments"),
    ("sglang", "SGLang's own named segments"),
)
NAMED_MAX = 5  # files a one-line summary names; the rest are counted (doctor's detail lists them all)


def judge(scan: ShmScan, euid: int) -> ShmLeft:
    """The files no process holds, as `euid` scanned them. Uncertain when a process of another user could not be read
    by a caller who is not root, or /proc does not show every process.

    Root reads every process's fds and maps (CAP_SYS_PTRACE); a read that fails for root anyway is a process with
    capabilities root lacks here (a VM's or sandbox's own init), which no engine or Docker container is: skipped.
    A caller's own process that cannot be read is shown as root's by /proc (non-dumpable), so it counts too."""
    orphans = tuple(sorted((f for f in scan.files if f.key not in scan.used), key=lambda f: (-f.held_bytes, f.name)))
    why = []
    if scan.unreadable and euid != 0:
        uids = sorted(set(scan.unreadable))
        owners = ", ".join(str(uid) for uid in uids[:3]) + (", …" if len(uids) > 3 else "")
        why.append(f"{plural(len(scan.unreadable), 'process')} of uid {owners} could not be read (root can)")
    if scan.partial_table:
        why.append("this /proc does not show every process (another PID namespace, or hidepid)")
    return ShmLeft(orphans, certain=not why, why_uncertain="; ".join(why))


def engine_named(name: str) -> bool:
    return name.startswith(tuple(prefix for prefix, _whose in ENGINE_PREFIXES))


def kept_why(file: ShmFile, left: ShmLeft, euid: int) -> str | None:
    """Why `--fix` leaves this orphan (None: it removes it)."""
    if not left.certain:
        return "uncertain"
    if euid != 0 and file.uid != euid:
        return f"uid {file.uid}'s"
    if not engine_named(file.name):
        return "not an engine's name"
    return None


def removable(left: ShmLeft, euid: int) -> tuple[ShmFile, ...]:
    return tuple(f for f in left.orphans if kept_why(f, left, euid) is None)


def fix_command(left: ShmLeft, euid: int, command: str) -> tuple[str, str] | None:
    """(the command line, what it does) that removes the engine-named orphans; None when none would go. Root's
    where this user may not (another user's files, or an uncertain scan: root reads every process)."""
    prefixes = ", ".join(prefix for prefix, _whose in ENGINE_PREFIXES)
    if removable(left, euid):
        return f"{command} --fix", f"removes the ones named like an engine's ({prefixes})"
    if euid != 0 and any(engine_named(f.name) for f in left.orphans):
        return f"sudo {command} --fix", "reads every process, and removes the ones named like an engine's"
    return None


def shown_name(name: str) -> str:
    """A file name as a terminal may print it: undecodable bytes (kept by os as surrogates) and controls replaced."""
    return safe_text(name.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))


def file_line(file: ShmFile, left: ShmLeft, euid: int) -> str:
    """`psm_1a2b: 1.0 GiB, uid 0 (removable)`: one orphan, for doctor's detail."""
    kept = kept_why(file, left, euid)
    return f"{shown_name(file.name)}: {format_size(file.held_bytes)}, uid {file.uid} ({kept or 'removable'})"


def summary(left: ShmLeft, where: str) -> str:
    """One line: `/dev/shm: 2 files no process holds, 1.0 GiB out of the pool: psm_1a2b (1.0 GiB), sem.mp-x (4.0 KiB)`.
    `where`: the directory as the reader knows it. Empty of orphans: says so."""
    if not left.orphans:
        return f"{where}: no file left without a process"
    holds = "no process holds" if left.certain else "no readable process holds"
    named = ", ".join(f"{shown_name(f.name)} ({format_size(f.held_bytes)})" for f in left.orphans[:NAMED_MAX])
    more = len(left.orphans) - NAMED_MAX
    named += f" and {more} more" if more > 0 else ""
    line = (
        f"{where}: {plural(len(left.orphans), 'file')} {holds}, {format_size(left.held_bytes)} out of the pool: {named}"
    )
    return line if left.certain else f"{line} (uncertain: {left.why_uncertain})"


def removed_line(removed: Sequence[ShmFile], where: str) -> str:
    """`removed 2 files from /dev/shm (psm_1a2b, sem.mp-x): 1.0 GiB back in the pool`."""
    if not removed:
        return f"nothing in {where} to remove"
    names = ", ".join(shown_name(f.name) for f in removed[:NAMED_MAX])
    names += f" and {len(removed) - NAMED_MAX} more" if len(removed) > NAMED_MAX else ""
    back = format_size(sum(f.held_bytes for f in removed))
    return f"removed {plural(len(removed), 'file')} from {where} ({names}): {back} back in the pool"
