"""The drift verdict on fixture roots built from real package names and paths (tests/driverroot.py)."""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from sparkwatch.core.driver import drift
from sparkwatch.core.model import Check, DpkgPackage, DriverFacts, DriverReport, NvmlFacts
from sparkwatch.telemetry.sources.driverfacts import (
    parse_dpkg_status,
    parse_grubenv,
    parse_nvrm_version,
    read_driver_facts,
)
from tests import driverroot as fx
from tests.driverroot import DRIVER, NEW_KERNEL, NEWER_DRIVER, OLD_KERNEL, DriverRoot, Pkg


def judge_root(root: DriverRoot) -> tuple[DriverFacts, DriverReport]:
    facts = read_driver_facts(root.write())
    return facts, drift.judge(facts)


def checks_by_id(root: DriverRoot) -> dict[str, Check]:
    facts, report = judge_root(root)
    return {c.id: c for c in drift.driver_checks(report, facts, nvml_asked=False)}


def test_stranded_after_6_11_to_6_17_update(tmp_path: Path) -> None:
    facts, report = judge_root(fx.stranded_after_update(tmp_path / "r"))
    assert facts.running_kernel == OLD_KERNEL
    assert facts.module_files[OLD_KERNEL] == ()
    assert facts.module_files[NEW_KERNEL] == ("kernel/nvidia-580-open/nvidia.ko.zst",)
    assert report.verdict == "stranded"
    assert report.stranded and report.loaded is False
    assert report.next_boot_kernel == NEW_KERNEL and report.next_boot_ok is True
    assert report.reboot_required and f"linux-image-{NEW_KERNEL}" in report.reboot_required_pkgs
    checks = checks_by_id(fx.stranded_after_update(tmp_path / "r"))
    mod = checks["driver-modules"]
    assert mod.status == "fail"
    assert OLD_KERNEL in mod.summary and f"linux-modules-nvidia-580-open-{NEW_KERNEL}" in mod.summary
    assert mod.fix is not None
    fix_lines = mod.fix.splitlines()
    # the exact commands, in order: upgrade, reboot, then confirm the kernel and the GPU
    order = [
        next(i for i, line in enumerate(fix_lines) if line.startswith(cmd))
        for cmd in ("sudo apt full-upgrade", "sudo reboot", "uname -r", "nvidia-smi")
    ]
    assert order == sorted(order)
    assert checks["driver-loaded"].status == "fail"
    assert checks["next-boot-modules"].status == "ok"
    assert checks["reboot-required"].status == "warn"


def test_installed_package_without_module_file_is_still_stranded(tmp_path: Path) -> None:
    root = fx.healthy(tmp_path / "r")
    root.modules = {}  # dpkg says installed, the files are gone (a half-finished removal)
    _, report = judge_root(root)
    assert report.verdict == "stranded"
    assert any("is installed but no nvidia.ko" in f for f in report.findings)


def test_will_strand_on_reboot(tmp_path: Path) -> None:
    _, report = judge_root(fx.will_strand(tmp_path / "r"))
    assert report.verdict == "will_strand"
    assert not report.stranded and report.loaded is True
    assert report.next_boot_kernel == NEW_KERNEL and report.next_boot_ok is False
    checks = checks_by_id(fx.will_strand(tmp_path / "r"))
    nb = checks["next-boot-modules"]
    assert nb.status == "fail" and "do not reboot" in nb.summary
    assert nb.fix is not None
    assert f"sudo apt install linux-modules-nvidia-580-open-{NEW_KERNEL}" in nb.fix
    assert "sudo apt full-upgrade" in nb.fix
    assert checks["driver-modules"].status == "ok"
    assert "fix next-boot-modules first" in checks["reboot-required"].summary


def test_grubenv_saved_entry_pins_the_old_kernel(tmp_path: Path) -> None:
    root = fx.will_strand(tmp_path / "r")
    root.grubenv = {"saved_entry": f"gnulinux-advanced-1234>gnulinux-{OLD_KERNEL}-advanced-1234"}
    _, report = judge_root(root)
    assert report.next_boot_kernel == OLD_KERNEL
    assert report.verdict == "reboot_pending"  # 6.17 lacks modules, but GRUB boots 6.11, which has them
    root.grubenv = {
        "saved_entry": f"gnulinux-{OLD_KERNEL}-advanced-1234",
        "next_entry": f"gnulinux-{NEW_KERNEL}-advanced",
    }
    _, report = judge_root(root)
    assert report.next_boot_kernel == NEW_KERNEL  # a one-shot next_entry wins
    assert report.verdict == "will_strand"


def test_dkms_healthy(tmp_path: Path) -> None:
    _, report = judge_root(fx.dkms_healthy(tmp_path / "r"))
    assert report.verdict == "ok", report.findings
    assert report.dkms and report.running_modules == ("updates/dkms/nvidia.ko.zst",)
    assert report.module_version == DRIVER and report.library_version == DRIVER
    checks = checks_by_id(fx.dkms_healthy(tmp_path / "r"))
    assert "DKMS" in checks["driver-modules"].summary
    assert all(c.status in ("ok", "skip") for c in checks.values()), checks


def test_dkms_missing_for_next_kernel_suggests_autoinstall(tmp_path: Path) -> None:
    root = fx.dkms_healthy(tmp_path / "r")
    root.running = OLD_KERNEL
    root.modules.pop(NEW_KERNEL)
    checks = checks_by_id(root)
    nb = checks["next-boot-modules"]
    assert nb.status == "fail" and nb.fix is not None and f"sudo dkms autoinstall -k {NEW_KERNEL}" in nb.fix


@pytest.mark.parametrize(
    ("branch", "open_", "subdir"),
    [
        ("580", True, "nvidia-580-open"),
        ("580", False, "nvidia-580"),
        (None, True, "nvidia-open"),  # newer branches drop the number from names
        (None, False, "nvidia"),
    ],
)
def test_open_and_proprietary_with_and_without_branch(
    tmp_path: Path, branch: str | None, open_: bool, subdir: str
) -> None:
    root = fx.healthy(tmp_path / "r", branch=branch, open_=open_)
    facts, report = judge_root(root)
    assert report.verdict == "ok", report.findings
    assert report.running_modules == (f"kernel/{subdir}/nvidia.ko.zst",)
    assert report.open_modules is open_
    assert facts.loaded_open is open_
    # and the same naming is used to name the package a new kernel needs
    root.boot.append("6.17.0-1031-nvidia")
    _, report = judge_root(root)
    assert report.verdict == "will_strand"
    checks = checks_by_id(root)
    variant = "-".join(p for p in (branch, "open" if open_ else None) if p)
    want = f"linux-modules-nvidia-{variant + '-' if variant else ''}6.17.0-1031-nvidia"
    assert checks["next-boot-modules"].fix is not None and f"sudo apt install {want}" in checks["next-boot-modules"].fix


def test_server_branch_names_parse() -> None:
    m = drift.PER_KERNEL_RE.match("linux-modules-nvidia-580-server-open-6.8.0-1015-nvidia")
    assert m is not None and m["branch"] == "580" and m["server"] and m["open"] and m["kernel"] == "6.8.0-1015-nvidia"
    assert drift.PER_KERNEL_RE.match("linux-modules-nvidia-580-open-nvidia") is None  # a metapackage
    assert drift.META_RE.match("linux-modules-nvidia-580-open-nvidia-hwe-24.04") is not None
    assert drift.SIGNATURES_RE.match(f"linux-signatures-nvidia-{NEW_KERNEL}") is not None
    assert drift.DKMS_RE.match("nvidia-dkms-open") and drift.DKMS_RE.match("nvidia-dkms-580-server-open")
    assert drift.DKMS_RE.match("nvidia-dkms-580")


def test_version_mismatch(tmp_path: Path) -> None:
    facts, report = judge_root(fx.version_mismatch(tmp_path / "r"))
    assert facts.library_versions == (NEWER_DRIVER,)
    assert report.verdict == "version_mismatch"
    assert report.loaded_version == DRIVER and report.library_version == NEWER_DRIVER
    check = checks_by_id(fx.version_mismatch(tmp_path / "r"))["driver-version-match"]
    assert check.status == "fail" and check.fix is not None and "sudo reboot" in check.fix


def test_nvml_error_codes(tmp_path: Path) -> None:
    facts = read_driver_facts(fx.healthy(tmp_path / "r").write())
    mismatch = drift.judge(replace(facts, nvml=NvmlFacts(error_code=18, error="Driver/library version mismatch")))
    assert mismatch.verdict == "version_mismatch"
    no_proc = replace(facts, loaded_version=None, nvml=NvmlFacts(error_code=9, error="Driver Not Loaded"))
    assert drift.judge(no_proc).verdict == "not_loaded"
    good = drift.judge(replace(facts, nvml=NvmlFacts(library_version="12.580.95.05", driver_version=DRIVER)))
    assert good.verdict == "ok" and good.library_version == DRIVER
    checks = {
        c.id: c for c in drift.driver_checks(mismatch, replace(facts, nvml=NvmlFacts(error_code=18, error="x")), True)
    }
    assert checks["driver-loaded"].status == "fail"


def test_reboot_pending_alone_is_a_warning(tmp_path: Path) -> None:
    root = fx.healthy(tmp_path / "r")
    root.reboot_pkgs = ["linux-base"]
    _, report = judge_root(root)
    assert report.verdict == "reboot_pending"
    checks = checks_by_id(root)
    assert checks["reboot-required"].status == "warn" and "linux-base" in checks["reboot-required"].summary
    assert not any(c.status == "fail" for c in checks.values())


def test_truncated_dpkg_status(tmp_path: Path) -> None:
    root = fx.healthy(tmp_path / "r")
    full = root.dpkg_status().encode()
    cut = full.rindex(b"Package: linux-modules-nvidia-580-open-nvidia")
    root.dpkg_raw = full[: cut + 30]  # torn mid-stanza, as a full disk during apt leaves it
    facts, report = judge_root(root)
    assert facts.dpkg_error is not None and "truncated" in facts.dpkg_error
    assert report.verdict == "ok"  # the module file and the per-kernel stanza before the tear still count
    assert any("dpkg status" in f for f in report.findings)


def test_corrupt_dpkg_status(tmp_path: Path) -> None:
    root = fx.stranded_after_update(tmp_path / "r")
    root.dpkg_raw = b"\x00\xffPK\x03\x04 this is a zip file, not a status file\n\n\x89PNG\r\n"
    facts, report = judge_root(root)
    assert facts.packages == () and facts.dpkg_error is not None
    assert report.verdict == "stranded"  # the module files alone still tell: 6.17 has modules, 6.11 has none


def test_root_missing_half_its_files(tmp_path: Path) -> None:
    root = DriverRoot(tmp_path / "r", running=None, boot=[], meminfo_kb=None)
    root.add_kernel_modules(NEW_KERNEL)
    facts, report = judge_root(root)
    assert report.verdict == "unknown"
    assert any("osrelease: missing" in e for e in facts.read_errors)
    assert any("boot: missing" in e for e in facts.read_errors)
    checks = checks_by_id(root)
    assert checks["driver-modules"].status == "warn"
    assert checks["next-boot-modules"].status == "skip"
    # and an empty directory is "no NVIDIA driver", not a crash
    empty = tmp_path / "empty"
    empty.mkdir()
    report = drift.judge(read_driver_facts(empty))
    assert report.verdict in ("absent", "unknown")


def test_config_files_state_is_not_installed() -> None:
    pkgs, err = parse_dpkg_status(
        "Package: linux-modules-nvidia-580-open-6.11.0-1016-nvidia\nStatus: deinstall ok config-files\n"
        "Version: 6.11.0-1016.16\n\n"
        "Package: nvidia-dkms-580\nStatus: install ok half-configured\nVersion: 580.95.05-1\n"
    )
    assert err is None and [p.installed for p in pkgs] == [False, False]
    facts = DriverFacts(running_kernel=OLD_KERNEL, packages=pkgs)
    report = drift.judge(facts)
    assert any("half-configured" in f for f in report.findings)


def test_version_sort_and_parsers() -> None:
    kernels = ["6.8.0-99-generic", "6.8.0-100-generic", OLD_KERNEL, NEW_KERNEL, "6.17.0-1031-nvidia"]
    assert max(kernels, key=drift.version_key) == "6.17.0-1031-nvidia"
    assert drift.version_key("6.8.0-100-generic") > drift.version_key("6.8.0-99-generic")
    assert drift.upstream_version("580.95.05-0ubuntu0.24.04.2") == "580.95.05"
    assert drift.upstream_version("1:610.43.02-1") == "610.43.02"
    assert parse_nvrm_version(fx.NVRM_OPEN.format(v="610.43.02")) == ("610.43.02", True)
    assert parse_nvrm_version(fx.NVRM_PROPRIETARY.format(v="580.142")) == ("580.142", False)
    # verbatim from an H200 host running a Nix-built open module
    real = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
    assert parse_nvrm_version(real) == ("580.159.04", True)
    assert parse_grubenv("# GRUB\nsaved_entry=a\nnext_entry=\n####") == "a"


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet=st.sampled_from(list("Package: Status:installok\n \tnvidia-580-6.17.0-1008abc:")), max_size=400)
)
def test_dpkg_parser_never_raises(text: str) -> None:
    pkgs, _err = parse_dpkg_status(text)
    drift.judge(DriverFacts(running_kernel=OLD_KERNEL, packages=pkgs, dpkg_error=_err))


def test_fixture_uses_a_realistic_status_file(tmp_path: Path) -> None:
    root = fx.stranded_after_update(tmp_path / "r")
    root.packages.append(Pkg("nvidia-firmware-580-580.95.05", "580.95.05-0ubuntu1"))
    facts, _ = judge_root(root)
    names = {p.name for p in facts.packages}
    assert "bash" not in names  # non-nvidia stanzas are skipped
    assert f"linux-signatures-nvidia-{NEW_KERNEL}" in names and facts.dpkg_error is None


def test_container_without_lib_modules_is_not_stranded(tmp_path: Path) -> None:
    """Docker with the GPU passed through: /proc/driver/nvidia and /dev/nvidia* but no host /lib/modules or /boot."""
    root = fx.healthy(tmp_path / "r")
    root.boot = []
    path = root.write()
    shutil.rmtree(path / "lib/modules")
    facts = read_driver_facts(path)
    report = drift.judge(facts)
    assert not report.stranded and report.verdict == "ok", report.findings
    checks = {c.id: c for c in drift.driver_checks(report, facts, nvml_asked=False)}
    assert checks["driver-modules"].status == "skip" and "not visible" in checks["driver-modules"].summary
    # but the same root with the driver gone is stranded: nothing could load it
    (path / "proc/driver/nvidia/version").unlink()
    for node in (path / "dev").iterdir():
        node.unlink()
    assert drift.judge(read_driver_facts(path)).verdict == "stranded"


def test_dpkg_status_is_parsed_again_only_when_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkwatch.telemetry.sources import driverfacts as system

    status = tmp_path / "status"
    status.write_text("Package: nvidia-dkms-580-open\nStatus: install ok installed\nVersion: 580.95.05-0ubuntu1\n\n")
    first = system.read_dpkg_status(status, [])
    assert [p.name for p in first[0]] == ["nvidia-dkms-580-open"]
    parsed: list[str] = []
    real_parse = system.parse_dpkg_lines

    def counting_parse(lines: Iterable[str]) -> tuple[tuple[DpkgPackage, ...], str | None]:
        parsed.append("parse")
        return real_parse(lines)

    monkeypatch.setattr(system, "parse_dpkg_lines", counting_parse)
    assert system.read_dpkg_status(status, []) == first  # unchanged file: served from the cache
    assert parsed == []
    with status.open("a") as fh:  # apt ran
        fh.write(
            "Package: linux-modules-nvidia-580-open-6.17.0-1008-nvidia\nStatus: install ok installed\n"
            "Version: 6.17.0-1008.8\n\n"
        )
    changed = system.read_dpkg_status(status, [])
    assert len(parsed) == 1 and len(changed[0]) == 2


# --- the dpkg scan: a clean stanza without nvidia is settled by one regex, and nothing else changes

_CLEAN_HEADS = [b"Package: libc6", b"Package: nvidia-dkms-580-open", b"Package: caf\xc3\xa9"]
_HEADS = st.sampled_from(
    _CLEAN_HEADS * 4
    + [b"Package: linux-modules-nvidia-580-open-6.17.0-1008-nvidia", b"Package:", b"Package: \xc2\xa0", b"garbled",
       b" x", b"Status: install ok installed"]
)  # fmt: skip
_CLEAN_LINES = [b"Version: 2.39-0ubuntu8", b"Depends: libnvidia-compute-580", b"Description: a package", b" more text",
                b"\tmore", b"Conffiles:", b" /etc/x 0123abcd", b"Status: deinstall ok config-files\r"]  # fmt: skip
_LINES = st.sampled_from(
    _CLEAN_LINES * 3
    + [b"Status:", b" ", b"  \t", b"\r", b"garbled line", b"bad name: x", b":", b"\xff\xfe broken utf-8", b"\x0b",
       b"", b" \xc2\xa0", b"\t\x0c"]
)  # fmt: skip
_STATUS = st.sampled_from([b"Status: install ok installed", b"Status: install ok installed", b"Status:", None])
_SEPARATORS = st.sampled_from([b"\n\n", b"\n\n", b"\n\n", b"\n\n\n", b"\n \n", b"\n\r\n", b"\n"])


@settings(max_examples=400, deadline=None)
@given(
    stanzas=st.lists(st.tuples(_HEADS, _STATUS, st.lists(_LINES, max_size=5), _SEPARATORS), max_size=12),
    trailing=st.sampled_from([b"", b"\n", b"\n\n"]),
    chunk=st.integers(1, 96),
)
@example(  # two stanzas with no blank line between: the second Package field, empty, makes the first incomplete
    stanzas=[
        (b"Package: libc6", b"Status: install ok installed", [], b"\n"),
        (b"Package:", b"Status: install ok installed", [], b"\n\n"),
        (b"Package: libc6", b"Status: install ok installed", [], b"\n\n"),
    ],
    trailing=b"",
    chunk=1,
)
def test_the_dpkg_scan_reads_what_the_line_parser_reads(
    stanzas: list[tuple[bytes, bytes | None, list[bytes], bytes]], trailing: bytes, chunk: int
) -> None:
    """Any file of dpkg-like stanzas (clean or torn, with blank or whitespace-only lines between them, CRs, bad
    UTF-8), read in chunks of any size: the same packages and the same description of damage as line by line."""
    from sparkwatch.telemetry.sources import driverfacts as system

    data = b"".join(
        b"\n".join([head, *lines[:1], *([status] if status else []), *lines[1:]]) + sep
        for head, status, lines, sep in stanzas
    )
    data = data.removesuffix(b"\n") + trailing
    path = Path("/status")
    plain = system.parse_dpkg_lines(system._bounded_lines(io.BytesIO(data), 1 << 20, path, []))
    with tempfile.TemporaryFile() as fh:  # a real file: the scan asks its size first
        fh.write(data)
        fh.seek(0)
        scanned = system.parse_dpkg_lines(system._dpkg_lines(fh, 1 << 20, path, [], chunk_bytes=chunk))
    assert scanned == plain


def test_the_dpkg_scan_settles_clean_stanzas_and_keeps_nvidia(tmp_path: Path) -> None:
    from sparkwatch.telemetry.sources import driverfacts as system

    clean = b"Package: libc6\nStatus: install ok installed\nVersion: 2.39\nDescription: C library\n more\n\n"
    nvidia = b"Package: nvidia-dkms-580-open\nStatus: install ok installed\nVersion: 580.95.05-0ubuntu1\n\n"
    status = tmp_path / "status"
    status.write_bytes(clean * 3000 + nvidia + clean)
    with status.open("rb") as fh:
        items = list(system._dpkg_lines(fh, 1 << 26, status, []))
    assert sum(1 for i in items if i is system.CLEAN_STANZA) == 3001  # no line of theirs reaches the parser
    pkgs, err = system.read_dpkg_status(status, [])
    assert err is None and [(p.name, p.version) for p in pkgs] == [("nvidia-dkms-580-open", "580.95.05-0ubuntu1")]
