"""The flight recorder's file: a preallocated ring of fixed-size records that a crash at any instant leaves readable.

Layout of `<state_dir>/recorder.ring` (little-endian):
- a 4096-byte header: magic `SWFLIGHT`, format version, slot size, capacity (slots), the boot id that created the
  file (32 hex digits), when it was created, and a CRC-32 of all that;
- `capacity` slots of SLOT_BYTES each: magic `SWR1`, payload length, flags, sequence number (from 1), CRC-32 of the
  slot's first 16 bytes and the payload, then the payload padded with zeros. Record `seq` lives in slot
  `(seq - 1) % capacity`: the ring overwrites its oldest record.
- The payload is one `core.postmortem.flight.FlightSample` in fixed binary fields (`_SAMPLE`, then `_TREE` per tree and
  `_LAUNCHED` per launched engine; -1 or NaN where a value is None), not JSON: on the bench VM a cold `json.dumps`
  of one sample cost ~130 µs of CPU, struct.pack ~10 µs (bench/RESULTS-recorder.md), and the writer runs cold once a
  second.

Why this survives a crash:
- The file is written whole (zeros) once, fsynced and renamed into place, so later writes overwrite allocated
  blocks: they never need a new block (a full disk cannot fail them) and never change the file's size.
- A record is one pwrite of one slot; slots are aligned inside 4 KiB pages and never straddle one. A process killed
  (SIGKILL) mid-write leaves the page cache holding the old slot or the new one: the kernel finishes or refuses the
  copy, and the page survives the process. A power loss can tear a slot (a disk writes 512-byte sectors): its CRC then
  fails and the reader skips that one record, never the ring.
- The reader orders records by sequence number, not by slot, so where the writer stopped does not matter.

A new boot starts a new file: the writer moves a file created in another boot to `recorder.prev.ring` before it
writes, so the previous boot's last minutes stay put for the postmortem (core.postmortem.verdict) however long the new
boot runs. A restart within the same boot continues the same file after its highest sequence number.

Stdlib only (zlib for the CRC: no OpenSSL in the guard). Nothing here decides when to write or sync: guard.recorder.
"""

from __future__ import annotations

import errno
import math
import os
import stat
import struct
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from sparkwatch.common.durable import StateFileError, fsync_dir, open_regular, private_dir
from sparkwatch.core.postmortem.flight import FlightSample, LaunchedEngine, TreeFootprint

RING_NAME = "recorder.ring"
PREV_NAME = "recorder.prev.ring"
VERSION = 1
HEADER_BYTES = 4096
SLOT_BYTES = 512  # 8 to a 4 KiB page: a slot never straddles one
_HEAD = struct.Struct("<8sHHII32sd")
_HEAD_CRC = struct.Struct("<I")
_SLOT = struct.Struct("<4sHHQ")
_SLOT_CRC = struct.Struct("<I")
SLOT_HEAD_BYTES = _SLOT.size + _SLOT_CRC.size
PAYLOAD_MAX_BYTES = SLOT_BYTES - SLOT_HEAD_BYTES
HEAD_MAGIC = b"SWFLIGHT"
SLOT_MAGIC = b"SWR1"
FLAG_STOPPING = 1
# t, available, free, cached, shmem, fill rate, interval, flags (near_floor, stopping), guard phase, kills, free in
# 2 MiB and 64 KiB blocks, PSI some and full, engines, trees' age, GPU bytes, tree count, launched count.
_SAMPLE = struct.Struct("<d4qddB12sI4qidqBB")
_TREE = struct.Struct("<16siq")  # kind, root pid, footprint
_LAUNCHED = struct.Struct("<24si16s")  # name, pid, phase
TREES_MAX = 6
LAUNCHED_MAX = 4
_NEAR, _STOPPING = 1, 2
assert _SAMPLE.size + TREES_MAX * _TREE.size + LAUNCHED_MAX * _LAUNCHED.size <= SLOT_BYTES - 20, (
    "a slot holds any sample"
)
# Near the floor the guard samples at its own rate (down to 50 ms): on top of one slot a second for the window, the
# ring keeps room for a minute at 20 samples a second.
FAST_RESERVE_SLOTS = 1200
_OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW
_READ_CHUNK_SLOTS = 128  # the reader holds 64 KiB at a time, never the whole file


def ring_capacity(window_s: float) -> int:
    """Slots for `window_s` of one-a-second samples plus the near-floor reserve; 0: the recorder is off."""
    if window_s <= 0:
        return 0
    return int(window_s) + FAST_RESERVE_SLOTS


def ring_bytes(capacity: int) -> int:
    return HEADER_BYTES + capacity * SLOT_BYTES


@dataclass(frozen=True, slots=True)
class RingHeader:
    slot_bytes: int
    capacity: int
    boot_id: str  # "" when the writer did not know its boot
    created_at: float


def encode_header(header: RingHeader) -> bytes:
    head = _HEAD.pack(
        HEAD_MAGIC,
        VERSION,
        0,
        header.slot_bytes,
        header.capacity,
        header.boot_id.encode("ascii").ljust(32, b"\0")[:32],
        header.created_at,
    )
    return (head + _HEAD_CRC.pack(zlib.crc32(head))).ljust(HEADER_BYTES, b"\0")


def decode_header(data: bytes) -> RingHeader | None:
    """The header, or None for anything that is not one of ours (another version, a torn or foreign file)."""
    size = _HEAD.size + _HEAD_CRC.size
    if len(data) < size:
        return None
    head = data[: _HEAD.size]
    (crc,) = _HEAD_CRC.unpack_from(data, _HEAD.size)
    if zlib.crc32(head) != crc:
        return None
    magic, version, _pad, slot_bytes, capacity, boot, created_at = _HEAD.unpack(head)
    if magic != HEAD_MAGIC or version != VERSION or slot_bytes != SLOT_BYTES or capacity <= 0:
        return None
    return RingHeader(slot_bytes, capacity, boot.rstrip(b"\0").decode("ascii", "replace"), created_at)


def _opt(value: int | None) -> int:
    return -1 if value is None else value


def _unopt(value: int) -> int | None:
    return None if value < 0 else value


def _text(data: bytes) -> str:
    return data.rstrip(b"\0").decode("utf-8", "replace")


def encode_sample(sample: FlightSample) -> bytes:
    """The sample's fixed binary form; past TREES_MAX trees (the smallest: they come biggest first) and LAUNCHED_MAX
    launched engines are left out, and names are cut to their field."""
    trees, launched = sample.trees[:TREES_MAX], sample.launched[:LAUNCHED_MAX]
    parts = [
        _SAMPLE.pack(
            sample.t,
            sample.available_bytes,
            sample.free_bytes,
            sample.cached_bytes,
            sample.shmem_bytes,
            sample.fill_rate_bytes_per_s,
            sample.interval_s,
            (_NEAR if sample.near_floor else 0) | (_STOPPING if sample.stopping else 0),
            sample.guard_phase.encode(),
            sample.kills,
            _opt(sample.free_2mib_bytes),
            _opt(sample.free_64kib_bytes),
            _opt(sample.psi_some_us),
            _opt(sample.psi_full_us),
            _opt(sample.engines),
            math.nan if sample.trees_age_s is None else sample.trees_age_s,
            _opt(sample.gpu_bytes),
            len(trees),
            len(launched),
        )
    ]
    parts += [_TREE.pack(t.kind.encode(), t.root_pid, _opt(t.footprint_bytes)) for t in trees]
    parts += [_LAUNCHED.pack(e.name.encode(), e.pid, e.phase.encode()) for e in launched]
    return b"".join(parts)


def decode_sample(payload: bytes) -> FlightSample:
    """Raises struct.error or ValueError for a payload that is not a sample."""
    (t, avail, free, cached, shmem, rate, interval, flags, phase, kills, f2m, f64k, some, full, engines, age, gpu,
     n_trees, n_launched) = _SAMPLE.unpack_from(payload)  # fmt: skip
    at = _SAMPLE.size
    trees = []
    for _ in range(n_trees):
        kind, pid, footprint = _TREE.unpack_from(payload, at)
        trees.append(TreeFootprint(_text(kind), pid, _unopt(footprint)))
        at += _TREE.size
    launched = []
    for _ in range(n_launched):
        name, pid, engine_phase = _LAUNCHED.unpack_from(payload, at)
        launched.append(LaunchedEngine(_text(name), pid, _text(engine_phase)))
        at += _LAUNCHED.size
    if at != len(payload):
        raise ValueError(f"sample payload of {len(payload)} bytes, {at} expected")
    return FlightSample(
        t=t,
        available_bytes=avail,
        free_bytes=free,
        cached_bytes=cached,
        shmem_bytes=shmem,
        fill_rate_bytes_per_s=rate,
        interval_s=interval,
        near_floor=bool(flags & _NEAR),
        guard_phase=_text(phase),
        kills=kills,
        free_2mib_bytes=_unopt(f2m),
        free_64kib_bytes=_unopt(f64k),
        psi_some_us=_unopt(some),
        psi_full_us=_unopt(full),
        engines=_unopt(engines),
        trees=tuple(trees),
        trees_age_s=None if math.isnan(age) else age,
        gpu_bytes=_unopt(gpu),
        launched=tuple(launched),
        stopping=bool(flags & _STOPPING),
    )


def encode_slot(seq: int, sample: FlightSample) -> bytes:
    payload = encode_sample(sample)
    head = _SLOT.pack(SLOT_MAGIC, len(payload), FLAG_STOPPING if sample.stopping else 0, seq)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return (head + _SLOT_CRC.pack(crc) + payload).ljust(SLOT_BYTES, b"\0")


def decode_slot(data: bytes) -> tuple[int, FlightSample] | None:
    """(seq, sample) of one slot; None for an empty, torn or foreign one."""
    if len(data) < SLOT_HEAD_BYTES or data[:4] != SLOT_MAGIC:
        return None
    _magic, length, _flags, seq = _SLOT.unpack_from(data)
    (crc,) = _SLOT_CRC.unpack_from(data, _SLOT.size)
    if length > PAYLOAD_MAX_BYTES or seq <= 0:
        return None
    payload = data[SLOT_HEAD_BYTES : SLOT_HEAD_BYTES + length]
    if zlib.crc32(payload, zlib.crc32(data[: _SLOT.size])) != crc:
        return None
    try:
        return seq, decode_sample(payload)
    except (struct.error, ValueError):
        return None


class RingWriter:
    """Writes samples into the ring. Not thread-safe: one writer thread (guard.recorder) owns it. Raises OSError."""

    def __init__(self, path: Path, capacity: int, boot_id: str | None) -> None:
        if capacity <= 0:
            raise ValueError("a ring needs at least one slot")
        self.path = path
        self.prev_path = path.with_name(PREV_NAME)
        self.capacity = capacity
        self.boot_id = boot_id or ""
        self.fd = -1
        self.next_seq = 1
        self.rotated = False  # this open() moved another boot's file aside

    def open(self) -> None:
        """Continue this boot's ring, or move another boot's aside and start a new one."""
        private_dir(self.path.parent)
        header, fd = self._existing()
        if fd >= 0 and header is not None and header.capacity == self.capacity and header.boot_id == self.boot_id:
            self.fd = fd
            self.next_seq = self._last_seq() + 1
            return
        if fd >= 0:
            os.close(fd)
        if header is not None and header.boot_id != self.boot_id:
            os.replace(self.path, self.prev_path)  # the previous boot's record, for the postmortem
            fsync_dir(self.path.parent)
            self.rotated = True
        self._create()

    def _existing(self) -> tuple[RingHeader | None, int]:
        try:
            fd = os.open(self.path, os.O_RDWR | _OPEN_FLAGS)
        except FileNotFoundError:
            return None, -1
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateFileError(errno.ELOOP, "is a symlink; refused", str(self.path)) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise StateFileError(errno.EINVAL, "is not a regular file", str(self.path))
        header = decode_header(os.pread(fd, HEADER_BYTES, 0))
        if header is not None and st.st_size < ring_bytes(header.capacity):
            header = replace(header, capacity=-1)  # truncated: never continue it (its boot id still says whose)
        return header, fd

    def _create(self) -> None:
        tmp = self.path.with_name(f".tmp-{self.path.name}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | _OPEN_FLAGS, 0o600)
        try:
            os.pwrite(fd, encode_header(RingHeader(SLOT_BYTES, self.capacity, self.boot_id, time.time())), 0)
            zeros = bytes(SLOT_BYTES * _READ_CHUNK_SLOTS)
            offset = HEADER_BYTES
            end = ring_bytes(self.capacity)
            while offset < end:  # written, not just allocated: later slot writes are pure overwrites
                offset += os.pwrite(fd, zeros[: end - offset], offset)
            os.fsync(fd)
            os.rename(tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError:
            os.close(fd)
            try:
                tmp.unlink()
            except OSError:
                pass
            raise
        self.fd = fd
        self.next_seq = 1

    def _last_seq(self) -> int:
        last = 0
        for seq, _sample in _slots(self.fd, self.capacity):
            last = max(last, seq)
        return last

    def write(self, sample: FlightSample) -> int:
        """One record; returns its sequence number. Raises OSError (the caller counts it and keeps going)."""
        seq = self.next_seq
        slot = encode_slot(seq, sample)
        os.pwrite(self.fd, slot, HEADER_BYTES + ((seq - 1) % self.capacity) * SLOT_BYTES)
        self.next_seq = seq + 1
        return seq

    def sync(self) -> None:
        """Make what was written survive a power loss: the data only (the size never changes)."""
        os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _slots(fd: int, capacity: int) -> list[tuple[int, FlightSample]]:
    out: list[tuple[int, FlightSample]] = []
    for first in range(0, capacity, _READ_CHUNK_SLOTS):
        count = min(_READ_CHUNK_SLOTS, capacity - first)
        chunk = os.pread(fd, count * SLOT_BYTES, HEADER_BYTES + first * SLOT_BYTES)
        for i in range(len(chunk) // SLOT_BYTES):
            record = decode_slot(chunk[i * SLOT_BYTES : (i + 1) * SLOT_BYTES])
            if record is not None:
                out.append(record)
    return out


@dataclass(frozen=True, slots=True)
class RingContents:
    path: str
    boot_id: str
    created_at: float
    capacity: int
    samples: tuple[FlightSample, ...]  # oldest first (by sequence number)
    last_seq: int

    @property
    def last_sample_at(self) -> float | None:
        return self.samples[-1].t if self.samples else None


def read_ring(path: Path) -> RingContents | None:
    """What a ring file holds; None when there is none or it is not one of ours. Raises StateFileError for a
    symlink, FIFO or directory planted there, and for a header whose slots do not fit the file (checked first, from
    fstat: nothing past the header is read)."""
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    try:
        header = decode_header(os.pread(fd, HEADER_BYTES, 0))
        if header is None:
            return None
        size = os.fstat(fd).st_size
        if size < ring_bytes(header.capacity):
            # Held against the file before a slot is read: a header claiming 2^32-1 slots over a 4 KiB file cost 40 s
            # of empty preads (2^25 chunks) before this check.
            raise StateFileError(
                errno.EINVAL,
                f"its header claims {header.capacity} slots of {header.slot_bytes} bytes "
                f"({ring_bytes(header.capacity)} bytes with the header), but the file has {size} bytes: not a ring "
                "this recorder wrote whole (truncated or forged); not read",
                str(path),
            )
        records = sorted(_slots(fd, header.capacity), key=lambda r: r[0])
    finally:
        os.close(fd)
    return RingContents(
        path=str(path),
        boot_id=header.boot_id,
        created_at=header.created_at,
        capacity=header.capacity,
        samples=tuple(sample for _seq, sample in records),
        last_seq=records[-1][0] if records else 0,
    )


def recorder_paths(state_dir: Path) -> tuple[Path, Path]:
    """(this boot's ring, the previous boot's)."""
    return state_dir / RING_NAME, state_dir / PREV_NAME
