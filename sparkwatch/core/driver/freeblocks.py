"""Free memory by buddy order (/proc/buddyinfo): how much of MemAvailable comes in blocks big enough for the GPU
driver's 2 MiB and 64 KiB allocations.

Pure: the buddyinfo text and the page size come in as data. Its own module, apart from the kernel log's NVRM
lines (core.driver.nvrm): telemetry, status and launch's plan read it every cycle and need nothing else of the
driver's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MIN_BLOCKS_BYTES: Mapping[str, int] = {"2MiB": 2 << 20, "64KiB": 64 << 10}


class BuddyinfoError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class BuddyZone:
    node: int
    zone: str
    free_blocks: tuple[int, ...]  # free_blocks[order]: free blocks of 2**order pages


def parse_buddyinfo(data: bytes) -> tuple[BuddyZone, ...]:
    """`Node 0, zone   Normal   272  153 …`: one line per zone, one count per order (11 orders on 4 KiB-page x86
    kernels, 14 on 64 KiB-page arm64 ones: the count of columns is the kernel's, never assumed)."""
    zones = []
    for line in data.decode("ascii", "replace").splitlines():
        if not line.strip():
            continue
        head, sep, counts = line.partition("zone")
        parts = counts.split()
        node = head.replace("Node", "").replace(",", "").strip()
        if not sep or not node.isdigit() or len(parts) < 2 or not all(p.isdigit() for p in parts[1:]):
            raise BuddyinfoError(f"buddyinfo: garbled line {line[:80]!r}")
        zones.append(BuddyZone(int(node), parts[0], tuple(int(p) for p in parts[1:])))
    if not zones:
        raise BuddyinfoError("buddyinfo: no zones")
    return tuple(zones)


def free_bytes_in_blocks(zones: Sequence[BuddyZone], page_size_bytes: int, min_block_bytes: int) -> int:
    """Bytes free in blocks of at least `min_block_bytes`, from the page size the kernel uses (4 KiB or 64 KiB):
    with 64 KiB pages every order-0 block already counts toward the 64 KiB figure."""
    total = 0
    for zone in zones:
        for order, count in enumerate(zone.free_blocks):
            block = page_size_bytes << order
            if block >= min_block_bytes:
                total += count * block
    return total


def contiguous_free(zones: Sequence[BuddyZone], page_size_bytes: int) -> dict[str, int]:
    """{"2MiB": bytes, "64KiB": bytes}: the labels of sparkwatch_memory_free_contiguous_bytes."""
    return {label: free_bytes_in_blocks(zones, page_size_bytes, size) for label, size in MIN_BLOCKS_BYTES.items()}
