"""Driver drift facts, read from files under a root: dpkg status, /lib/modules, /boot, grubenv, /proc, /dev, /run.

Everything is read relative to `root`, so the tests run this exact code on fixture trees built from real Ubuntu
package names and paths. A file that cannot be read becomes a None fact plus a line in `read_errors`: the verdict
says "unknown" rather than guessing. NVML is asked only through a callable the caller passes in (on the live root,
sources.nvml.probe_nvml).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from sparkwatch.core.model import DpkgPackage, DriverFacts, NvmlFacts

# A real dpkg status is 2-6 MB (3,000 packages); 64 MiB bounds a corrupt or hostile one.
_DPKG_MAX_BYTES = 64 << 20
_SMALL_MAX_BYTES = 64 << 10
_MODULE_NAMES = ("nvidia.ko", "nvidia.ko.zst", "nvidia.ko.xz", "nvidia.ko.gz")
# "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  580.95.05  Release Build  (dvs-builder@…)"
# "NVRM version: NVIDIA UNIX aarch64 Kernel Module  580.95.05  Sun Sep 28 …"
_NVRM_RE = re.compile(r"NVRM version:.*?Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")
_LIBML_RE = re.compile(r"^libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)*)$")
_KERNEL_NAME_RE = re.compile(r"^[0-9][A-Za-z0-9.+_~-]*$")


def _read_text(path: Path, limit: int, errors: list[str], required: bool = True) -> str | None:
    try:
        with path.open("rb") as fh:
            data = fh.read(limit + 1)
    except FileNotFoundError:
        if required:
            errors.append(f"{path}: missing")
        return None
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror or exc}")
        return None
    if len(data) > limit:
        errors.append(f"{path}: larger than {limit} bytes, read the first {limit}")
        data = data[:limit]
    return data.decode("utf-8", errors="replace")


def parse_dpkg_status(text: str) -> tuple[tuple[DpkgPackage, ...], str | None]:
    """Stanzas of a dpkg status text; see parse_dpkg_lines."""
    return parse_dpkg_lines(text.splitlines(keepends=True))


_DPKG_KEPT_FIELDS = frozenset({"Package", "Status", "Version"})


class _CleanStanza:
    """In the lines `parse_dpkg_lines` reads: a whole stanza the scan (`_dpkg_lines`) found clean and without nvidia."""


CLEAN_STANZA = _CleanStanza()


def parse_dpkg_lines(lines: Iterable[str | _CleanStanza]) -> tuple[tuple[DpkgPackage, ...], str | None]:
    """The nvidia packages of a dpkg status file, line by line, and a description of any damage (None when clean).

    Keeps going past damage: a torn last stanza or a garbled line loses that stanza, not the file. Line by line and
    keeping three fields a stanza, the peak memory is one line, not the 2-6 MB file three times over. A CLEAN_STANZA
    in `lines` stands for a whole stanza with nothing to keep and nothing wrong: it is counted, and costs nothing.
    """
    packages: list[DpkgPackage] = []
    problems: list[str] = []
    fields: dict[str, str] = {}
    key: str | None = None
    bad_lines = 0
    index = 0
    content = False
    ended_with_newline = True

    def finish(last: bool) -> None:
        nonlocal fields, key, bad_lines, index
        index += 1
        pkg = fields.get("Package")
        status = fields.get("Status")
        if bad_lines:
            problems.append(f"stanza {index}{f' ({pkg})' if pkg else ''}: {bad_lines} garbled lines")
        if not pkg or status is None:
            what = "truncated" if last and not ended_with_newline else "incomplete"
            problems.append(f"stanza {index}{f' ({pkg})' if pkg else ''}: {what}, no Package or Status field")
        elif "nvidia" in pkg:
            packages.append(DpkgPackage(name=pkg, version=fields.get("Version", ""), status=status))
        fields, key, bad_lines = {}, None, 0

    in_stanza = False
    for raw in lines:
        if isinstance(raw, _CleanStanza):  # always after a blank line (or first): no stanza is open
            index += 1
            content = ended_with_newline = True
            continue
        ended_with_newline = raw.endswith("\n")
        line = raw.rstrip("\r\n")
        if not line.strip():
            if in_stanza:
                finish(last=False)
                in_stanza = False
            continue
        in_stanza = content = True
        if line[0] in " \t":
            if key is None:
                bad_lines += 1
            continue  # continuation of a multi-line field (Description, Conffiles)
        name, sep, value = line.partition(":")
        if not sep or not name or " " in name:
            bad_lines += 1
            key = None
            continue
        key = name
        if name in _DPKG_KEPT_FIELDS:
            fields[name] = value.strip()
    if in_stanza:
        finish(last=True)
    if not packages and not problems and not content:
        problems.append("empty file")
    error = None
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        error = "; ".join(problems[:3]) + more
    return tuple(packages), error


def read_dpkg_status(path: Path, errors: list[str]) -> tuple[tuple[DpkgPackage, ...], str | None]:
    """The nvidia packages of a dpkg status file, parsed again only when the file changed.

    The drift check runs every minute and dpkg status is 2-6 MB on a Spark: reading and splitting it each time cost
    ~1 MiB of RSS a minute here (676 KB file, measured on the daemon) for a file that changes only when apt runs.
    """
    try:
        st = path.stat()
    except OSError:
        st = None
    key = None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _dpkg_cache.get(str(path))
    if key is not None and cached is not None and cached[0] == key:
        errors.extend(cached[2])
        return cached[1]
    read_errors: list[str] = []
    try:
        with path.open("rb") as fh:
            result = parse_dpkg_lines(_dpkg_lines(fh, _DPKG_MAX_BYTES, path, read_errors))
    except FileNotFoundError:
        errors.append(f"{path}: missing")
        return (), "dpkg status unreadable or missing"
    except OSError as exc:
        errors.append(f"{path}: {exc.strerror or exc}")
        return (), "dpkg status unreadable or missing"
    errors.extend(read_errors)
    if key is not None:
        _dpkg_cache[str(path)] = (key, result, tuple(read_errors))
    return result


# A stanza with nothing to keep and nothing wrong, as dpkg writes 3,000 of them: a Package field with a value, then
# fields of plain names and continuation lines that are not blank (bytes: a blank line, or one that str.strip()
# empties, never matches). Such a stanza without "nvidia" and with a Status field is one CLEAN_STANZA to the parser.
# A second Package field is left to the parser: the last one counts there, and an empty one makes the stanza incomplete
# (found by tests/test_drift.py's property test).
_CLEAN_STANZA_RE = re.compile(
    rb"Package:[ \t]*[!-~][^\n]*(?:\n(?:(?!Package:)[A-Za-z0-9][A-Za-z0-9_.-]*:[^\n]*|[ \t][^\n]*[!-~][^\n]*))*"
)
_DPKG_CHUNK_BYTES = 1 << 20


def _dpkg_lines(
    fh: BinaryIO, limit: int, path: Path, errors: list[str], chunk_bytes: int = _DPKG_CHUNK_BYTES
) -> Iterator[str | _CleanStanza]:
    """The file's lines as `_bounded_lines` gives them, except that each clean stanza without nvidia (and its blank
    line) is one CLEAN_STANZA: parsed line by line, a 700 KB dpkg status took 34 ms of `sparkwatch status`'s start
    here (2-6 MB on a Spark), where a regex over each stanza settles the 3,000 that hold nothing the check keeps. Read
    `chunk_bytes` at a time (the peak memory is a chunk, not the file); a file over `limit` is read as before."""
    try:
        size = os.fstat(fh.fileno()).st_size
    except (OSError, ValueError, io.UnsupportedOperation):
        size = limit + 1
    if size > limit:
        yield from _bounded_lines(fh, limit, path, errors)
        return
    carry = b""
    read = 0
    while True:
        chunk = fh.read(chunk_bytes)
        read += len(chunk)
        if read > limit:  # it grew while read
            errors.append(f"{path}: larger than {limit} bytes, read the first {limit}")
            chunk = b""
        buffer = carry + chunk
        end = buffer.rfind(b"\n\n") if chunk else -1
        if end < 0:
            if chunk:
                carry = buffer
                continue
            *lines, last = buffer.split(b"\n")  # the rest, as `for raw in fh` splits it: at b"\n" only
            yield from (line.decode("utf-8", errors="replace") + "\n" for line in lines)
            if last:
                yield last.decode("utf-8", errors="replace")
            return
        for part in buffer[:end].split(b"\n\n"):
            if b"nvidia" not in part and b"\nStatus:" in part and _CLEAN_STANZA_RE.fullmatch(part):
                yield CLEAN_STANZA
            else:
                yield from (line.decode("utf-8", errors="replace") + "\n" for line in part.split(b"\n"))
                yield "\n"
        carry = buffer[end + 2 :]


def _bounded_lines(fh: BinaryIO, limit: int, path: Path, errors: list[str]) -> Iterator[str]:
    read = 0
    for raw in fh:
        read += len(raw)
        if read > limit:
            errors.append(f"{path}: larger than {limit} bytes, read the first {limit}")
            return
        yield raw.decode("utf-8", errors="replace")


# path -> ((inode, size, mtime_ns), parsed, read errors); one entry per root read (the live root, or a fixture's)
_dpkg_cache: dict[str, tuple[tuple[int, int, int], tuple[tuple[DpkgPackage, ...], str | None], tuple[str, ...]]] = {}


def parse_nvrm_version(text: str) -> tuple[str | None, bool | None]:
    """(version, open) from /proc/driver/nvidia/version."""
    match = _NVRM_RE.search(text)
    if match is None:
        return None, None
    return match.group(1), "Open Kernel Module" in match.group(0)


def parse_grubenv(text: str) -> str | None:
    """next_entry (a one-shot boot) wins over saved_entry. grubenv is 1 KiB of key=value lines padded with '#'."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    for key in ("next_entry", "saved_entry"):
        if values.get(key):
            return values[key]
    return None


def _module_dirs(root: Path) -> list[Path]:
    # usr-merged Ubuntu has /lib -> usr/lib; a fixture may hold either.
    return [root / "lib" / "modules", root / "usr" / "lib" / "modules"]


def module_files(root: Path, kernel: str) -> tuple[str, ...]:
    """nvidia.ko[.zst] for one kernel: kernel/nvidia-<branch>[-open]/ (packages) and updates/dkms/ (DKMS)."""
    if not _KERNEL_NAME_RE.match(kernel):
        return ()
    found: set[str] = set()
    for base in _module_dirs(root):
        kdir = base / kernel
        try:
            subdirs = sorted(p.name for p in (kdir / "kernel").iterdir() if p.name.startswith("nvidia"))
        except OSError:
            subdirs = []
        candidates = [f"kernel/{d}/{m}" for d in subdirs for m in _MODULE_NAMES]
        candidates += [f"updates/dkms/{m}" for m in _MODULE_NAMES]
        for rel in candidates:
            path = kdir / rel
            try:
                if path.is_file() and path.stat().st_size > 0:
                    found.add(rel)
            except OSError:
                continue
    return tuple(sorted(found))


def _boot_kernels(root: Path, errors: list[str]) -> tuple[str, ...]:
    try:
        names = [p.name for p in (root / "boot").iterdir()]
    except FileNotFoundError:
        errors.append(f"{root / 'boot'}: missing")
        return ()
    except OSError as exc:
        errors.append(f"{root / 'boot'}: {exc.strerror or exc}")
        return ()
    kernels = [n.removeprefix("vmlinuz-") for n in names if n.startswith("vmlinuz-")]
    return tuple(sorted(k for k in kernels if _KERNEL_NAME_RE.match(k)))


def _library_versions(root: Path) -> tuple[str, ...]:
    versions: set[str] = set()
    for base in ("usr/lib", "usr/lib64", "lib"):
        libdir = root / base
        try:
            dirs = [libdir, *(p for p in libdir.iterdir() if p.is_dir() and "-linux-" in p.name)]
        except OSError:
            continue
        for d in dirs:
            try:
                names = [p.name for p in d.iterdir() if p.name.startswith("libnvidia-ml.so.")]
            except OSError:
                continue
            for name in names:
                match = _LIBML_RE.match(name)
                if match:
                    versions.add(match.group(1))
    return tuple(sorted(versions))


def _device_nodes(root: Path) -> tuple[str, ...]:
    try:
        return tuple(sorted(p.name for p in (root / "dev").iterdir() if p.name.startswith("nvidia")))
    except OSError:
        return ()


def read_driver_facts(root: Path, nvml_probe: Callable[[], NvmlFacts] | None = None) -> DriverFacts:
    """Read every drift fact under `root`. Never raises for a missing or damaged file: it is named in read_errors."""
    errors: list[str] = []
    osrelease = _read_text(root / "proc/sys/kernel/osrelease", _SMALL_MAX_BYTES, errors)
    running = osrelease.strip() if osrelease else None
    if running is not None and not _KERNEL_NAME_RE.match(running):
        errors.append(f"running kernel {running[:40]!r} is not a kernel release")
        running = None

    packages, dpkg_error = read_dpkg_status(root / "var/lib/dpkg/status", errors)

    boot = _boot_kernels(root, errors)
    grubenv = _read_text(root / "boot/grub/grubenv", _SMALL_MAX_BYTES, errors, required=False)
    grub_entry = parse_grubenv(grubenv) if grubenv else None

    kernels = {k for k in (running, *boot) if k}
    modules = {k: module_files(root, k) for k in sorted(kernels)}
    module_dirs = tuple(k for k in sorted(kernels) if any((base / k).is_dir() for base in _module_dirs(root)))

    nvrm = _read_text(root / "proc/driver/nvidia/version", _SMALL_MAX_BYTES, errors, required=False)
    loaded_version, loaded_open = parse_nvrm_version(nvrm) if nvrm else (None, None)
    if nvrm and loaded_version is None:
        errors.append("/proc/driver/nvidia/version: no NVRM version line")

    pkgs_text = _read_text(root / "run/reboot-required.pkgs", _SMALL_MAX_BYTES, errors, required=False)
    reboot_pkgs = tuple(dict.fromkeys(line.strip() for line in (pkgs_text or "").splitlines() if line.strip()))
    reboot_required = (root / "run/reboot-required").exists()

    return DriverFacts(
        running_kernel=running,
        packages=packages,
        dpkg_error=dpkg_error,
        module_files=modules,
        module_dirs=module_dirs,
        boot_kernels=boot,
        grub_entry=grub_entry,
        loaded_version=loaded_version,
        loaded_open=loaded_open,
        device_nodes=_device_nodes(root),
        library_versions=_library_versions(root),
        nvml=nvml_probe() if nvml_probe is not None else None,
        reboot_required=reboot_required,
        reboot_required_pkgs=reboot_pkgs,
        read_errors=tuple(errors),
    )
