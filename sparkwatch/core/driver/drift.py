"""Driver drift: the running kernel against the NVIDIA module packages, the files on disk, the loaded module and NVML.

The failure this exists for: a DGX OS update installs kernel 6.17 and removes the NVIDIA modules of the running 6.11.
Until someone reboots, nvidia-smi says "couldn't communicate with the NVIDIA driver", /dev/nvidia* is gone and every
engine fails. Or the update leaves the kernel that boots next without modules, and the box comes back without a GPU.
A Spark has no passwordless sudo, so the output is a verdict plus the exact commands a human runs.

Ubuntu names (matched by pattern: newer branches drop the number, `-server` and `-open` are optional):
  per kernel   linux-modules-nvidia-580-open-6.17.0-1008-nvidia, linux-modules-nvidia-open-6.17.0-1031-nvidia
  meta         linux-modules-nvidia-580-open-nvidia (pulls the per-kernel one for each new kernel of the flavour)
  companions   linux-objects-nvidia-580-open-<kernel>, linux-signatures-nvidia-<kernel>
  DKMS         nvidia-dkms-580-open, nvidia-dkms-open -> /lib/modules/<kernel>/updates/dkms/nvidia.ko[.zst]
  files        /lib/modules/<kernel>/kernel/nvidia-580[-open]/nvidia.ko[.zst]
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sparkwatch.core.driver.nvmlcodes import DRIVER_INSTALLED_CODES, NvmlReturn
from sparkwatch.core.enums import CheckStatus, DriverVerdict
from sparkwatch.core.model import Check, DpkgPackage, DriverFacts, DriverReport

_KERNEL = r"(?P<kernel>\d+\.\d+\.\d+-\d+-[a-z0-9][a-z0-9.+-]*)"
_VARIANT = r"(?:(?P<branch>\d+)-)?(?P<server>server-)?(?P<open>open-)?"
PER_KERNEL_RE = re.compile(rf"^linux-modules-nvidia-{_VARIANT}{_KERNEL}$")
META_RE = re.compile(rf"^linux-modules-nvidia-{_VARIANT}(?P<flavour>[a-z][a-z0-9.+-]*)$")
OBJECTS_RE = re.compile(rf"^linux-objects-nvidia-{_VARIANT}{_KERNEL}$")
SIGNATURES_RE = re.compile(rf"^linux-signatures-nvidia-{_KERNEL}$")
DKMS_RE = re.compile(r"^nvidia-dkms-(?:(?P<branch>\d+)(?:-|$))?(?P<server>server(?:-|$))?(?P<open>open)?$")
# Packages whose version is the user-space driver version (libnvidia-ml.so comes with libnvidia-compute).
LIBRARY_PKG_RE = re.compile(r"^(?:libnvidia-compute|nvidia-utils)-(?:\d+)?(?:-server)?$|^libnvidia-compute$")
KERNEL_SOURCE_PKG_RE = re.compile(r"^nvidia-(?:kernel-source|kernel-common)-(?:\d+)?(?:-server)?(?:-open)?$")


def version_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Natural sort for kernel releases: 6.17.0-1008-nvidia > 6.11.0-1016-nvidia, 6.8.0-100 > 6.8.0-99."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.findall(r"\d+|\D+", text))


def upstream_version(debian_version: str) -> str:
    """580.95.05-0ubuntu0.24.04.2 -> 580.95.05; 1:580.95.05-1 -> 580.95.05."""
    return debian_version.split(":", 1)[-1].split("-", 1)[0].split("+", 1)[0]


def nvml_library_driver_version(nvml_version: str) -> str:
    """nvmlSystemGetNVMLVersion is '<cuda major>.<driver version>', e.g. 12.580.95.05 -> 580.95.05."""
    parts = nvml_version.split(".")
    return ".".join(parts[1:]) if len(parts) >= 4 else nvml_version


def next_boot_kernel(boot_kernels: Sequence[str], grub_entry: str | None) -> tuple[str | None, str]:
    """The kernel GRUB boots next, and how we know.

    grubenv's next_entry/saved_entry wins when it names an installed kernel (the longest match, so -64k flavours are
    told apart); otherwise GRUB's default menu order puts the newest installed kernel first.
    """
    if not boot_kernels:
        return None, "no /boot/vmlinuz-* found"
    if grub_entry:
        named = [k for k in boot_kernels if k in grub_entry]
        if named:
            return max(named, key=len), "grubenv"
    return max(boot_kernels, key=version_key), "newest /boot/vmlinuz-*"


@dataclass(frozen=True, slots=True)
class _Inventory:
    per_kernel: dict[str, list[DpkgPackage]]
    metas: list[DpkgPackage]
    objects: dict[str, list[DpkgPackage]]
    signatures: dict[str, list[DpkgPackage]]
    dkms: list[DpkgPackage]
    library: list[DpkgPackage]
    kernel_source: list[DpkgPackage]
    half_installed: list[DpkgPackage]


def _inventory(packages: Iterable[DpkgPackage]) -> _Inventory:
    inv = _Inventory({}, [], {}, {}, [], [], [], [])
    for pkg in packages:
        if not pkg.installed:
            # 'deinstall ok config-files' is what apt leaves of a removed module package: it is not there.
            if pkg.status.split()[-1:] not in (["not-installed"], ["config-files"]):
                inv.half_installed.append(pkg)
            continue
        if m := PER_KERNEL_RE.match(pkg.name):
            inv.per_kernel.setdefault(m["kernel"], []).append(pkg)
        elif m := OBJECTS_RE.match(pkg.name):
            inv.objects.setdefault(m["kernel"], []).append(pkg)
        elif m := SIGNATURES_RE.match(pkg.name):
            inv.signatures.setdefault(m["kernel"], []).append(pkg)
        elif META_RE.match(pkg.name):
            inv.metas.append(pkg)
        elif DKMS_RE.match(pkg.name):
            inv.dkms.append(pkg)
        elif LIBRARY_PKG_RE.match(pkg.name):
            inv.library.append(pkg)
        elif KERNEL_SOURCE_PKG_RE.match(pkg.name):
            inv.kernel_source.append(pkg)
    return inv


def module_package_for(inv: _Inventory, kernel: str) -> str | None:
    """The per-kernel package to install for `kernel`, in the naming the machine already uses."""
    for pkgs in inv.per_kernel.values():
        for pkg in pkgs:
            if m := PER_KERNEL_RE.match(pkg.name):
                return pkg.name[: m.start("kernel")] + kernel
    for pkg in inv.metas:
        if m := META_RE.match(pkg.name):
            return pkg.name[: m.start("flavour")] + kernel
    return None


def _library_version(facts: DriverFacts, inv: _Inventory) -> str | None:
    """The user-space driver version: NVML's, else the libnvidia-ml file's, else the package's."""
    nvml = facts.nvml
    if nvml is not None and nvml.library_version:
        return nvml_library_driver_version(nvml.library_version)
    if facts.library_versions:
        return max(facts.library_versions, key=version_key)
    if inv.library:
        return upstream_version(max(inv.library, key=lambda p: version_key(p.version)).version)
    return None


def _anything_nvidia(facts: DriverFacts, inv: _Inventory) -> bool:
    """Any trace of an NVIDIA driver: a package, a module file, a loaded module, a device node or a library."""
    nvml = facts.nvml
    return bool(
        inv.per_kernel
        or inv.metas
        or inv.objects
        or inv.dkms
        or inv.library
        or any(facts.module_files.values())
        or facts.loaded_version
        or facts.device_nodes
        or facts.library_versions
        or (nvml is not None and (nvml.library_version or nvml.error_code in DRIVER_INSTALLED_CODES))
    )


def _loaded(facts: DriverFacts) -> tuple[bool | None, str | None]:
    """(loaded, loaded version). Loaded: the proc file or NVML say yes; NVML 9, or neither proc file nor device nodes,
    say no."""
    nvml = facts.nvml
    loaded_version = facts.loaded_version or (nvml.driver_version if nvml is not None else None)
    if facts.loaded_version or (nvml is not None and nvml.driver_version):
        return True, loaded_version
    if (nvml is not None and nvml.error_code == NvmlReturn.ERROR_DRIVER_NOT_LOADED) or not facts.device_nodes:
        return False, loaded_version
    return None, loaded_version


def _next_boot_ok(
    next_kernel: str | None, running: str | None, running_modules: tuple[str, ...], next_modules: tuple[str, ...],
    anything_nvidia: bool,
) -> bool | None:  # fmt: skip
    if next_kernel is None or not anything_nvidia:
        return None
    return bool(running_modules) if next_kernel == running else bool(next_modules)


def _open_modules(facts: DriverFacts, inv: _Inventory, running_modules: tuple[str, ...]) -> bool | None:
    """Whether the open kernel modules are in use (a GB10 needs them): the loaded module, else the package names,
    else the running kernel's module paths."""
    if facts.loaded_open is not None:
        return facts.loaded_open
    names = [p.name for ps in inv.per_kernel.values() for p in ps] + [p.name for p in inv.dkms + inv.metas]
    if names:
        return any("-open" in n for n in names)
    if running_modules and any("kernel/" in f for f in running_modules):
        return any("-open/" in f for f in running_modules)
    return None


@dataclass(frozen=True, slots=True)
class _Signals:
    """The judged facts the verdict is read from, worst first."""

    anything_nvidia: bool
    stranded: bool
    will_strand: bool
    version_mismatch: bool
    running: str | None
    loaded: bool | None
    reboot_required: bool
    dpkg_error: str | None


def _verdict(s: _Signals) -> DriverVerdict:
    if not s.anything_nvidia:
        return DriverVerdict.UNKNOWN if s.running is None and s.dpkg_error else DriverVerdict.ABSENT
    if s.stranded:
        return DriverVerdict.STRANDED
    if s.will_strand:
        return DriverVerdict.WILL_STRAND
    if s.version_mismatch:
        return DriverVerdict.VERSION_MISMATCH
    if s.running is None:
        return DriverVerdict.UNKNOWN
    if s.loaded is False:
        return DriverVerdict.NOT_LOADED
    if s.reboot_required:
        return DriverVerdict.REBOOT_PENDING
    return DriverVerdict.OK


def _read_findings(facts: DriverFacts, inv: _Inventory) -> list[str]:
    findings = list(facts.read_errors)
    if facts.dpkg_error:
        findings.append(f"dpkg status: {facts.dpkg_error}")
    for pkg in inv.half_installed:
        findings.append(f"{pkg.name} is in state '{pkg.status}' (an interrupted apt run?)")
    return findings


def _stranded_findings(inv: _Inventory, running: str, loaded: bool | None, loaded_version: str | None) -> list[str]:
    out = []
    claimed = [p.name for p in inv.per_kernel.get(running, [])]
    if claimed:
        out.append(
            f"{', '.join(claimed)} is installed but no nvidia.ko is under /lib/modules/{running}: "
            "the files were removed or never built"
        )
    if loaded:
        out.append(f"the module {loaded_version or ''} is still loaded from before, but cannot be loaded again")
    return out


def judge(facts: DriverFacts) -> DriverReport:
    """The verdict over one set of facts. Pure: the same facts give the same report on any machine."""
    inv = _inventory(facts.packages)
    findings = _read_findings(facts, inv)
    nvml = facts.nvml
    running = facts.running_kernel
    running_modules = facts.module_files.get(running, ()) if running else ()
    next_kernel, next_source = next_boot_kernel(facts.boot_kernels, facts.grub_entry)
    next_modules = facts.module_files.get(next_kernel, ()) if next_kernel else ()
    library_version = _library_version(facts, inv)
    module_pkgs = inv.dkms or inv.kernel_source
    module_version = upstream_version(module_pkgs[0].version) if module_pkgs else None
    anything_nvidia = _anything_nvidia(facts, inv)
    loaded, loaded_version = _loaded(facts)
    version_mismatch = bool(
        (nvml is not None and nvml.error_code == NvmlReturn.ERROR_LIB_RM_VERSION_MISMATCH)
        or (loaded_version and library_version and loaded_version != library_version)
    )
    # No lib/modules/<running>/ at all while the driver is loaded: we are in a container that cannot see the host's
    # modules, not on a stranded host (an apt upgrade removes the nvidia package, never the running kernel's tree).
    modules_invisible = bool(running) and running not in facts.module_dirs and loaded is True
    if modules_invisible:
        findings.append(f"/lib/modules/{running} is not visible (a container?): module files not checked")
    stranded = bool(running) and not running_modules and anything_nvidia and not modules_invisible
    if running and stranded:
        findings += _stranded_findings(inv, running, loaded, loaded_version)
    next_boot_ok = _next_boot_ok(next_kernel, running, running_modules, next_modules, anything_nvidia)
    if next_kernel is not None and anything_nvidia:
        findings.append(f"next boot: {next_kernel} ({next_source})")
    will_strand = next_boot_ok is False and next_kernel != running
    verdict = _verdict(
        _Signals(
            anything_nvidia, stranded, will_strand, version_mismatch, running, loaded, facts.reboot_required,
            facts.dpkg_error,
        )
    )  # fmt: skip
    return DriverReport(
        verdict=verdict,
        summary=_summary(verdict, running, next_kernel, loaded_version, library_version),
        running_kernel=running,
        next_boot_kernel=next_kernel,
        running_modules=running_modules,
        next_boot_modules=next_modules,
        stranded=stranded,
        next_boot_ok=next_boot_ok,
        loaded=loaded,
        loaded_version=loaded_version,
        library_version=library_version,
        module_version=module_version,
        version_mismatch=version_mismatch,
        reboot_required=facts.reboot_required,
        reboot_required_pkgs=facts.reboot_required_pkgs,
        dkms=bool(inv.dkms),
        open_modules=_open_modules(facts, inv, running_modules),
        findings=tuple(findings),
    )


def _summary(
    verdict: DriverVerdict, running: str | None, nxt: str | None, loaded: str | None, library: str | None
) -> str:
    v = DriverVerdict
    summaries: dict[DriverVerdict, str] = {
        v.STRANDED: f"driver stranded: running kernel {running} has no NVIDIA modules",
        v.WILL_STRAND: f"next boot strands the driver: kernel {nxt} has no NVIDIA modules",
        v.VERSION_MISMATCH: f"driver/library version mismatch: loaded module {loaded or '?'}, library {library or '?'}",
        v.NOT_LOADED: f"NVIDIA modules are installed for {running} but the driver is not loaded",
        v.REBOOT_PENDING: "a reboot is pending",
        v.OK: f"driver ok on {running}" + (f" ({loaded})" if loaded else ""),
        v.ABSENT: "no NVIDIA driver installed",
        v.UNKNOWN: "driver state unknown: the running kernel could not be read",
    }
    return summaries[verdict]


# --- doctor checks and their fixes -------------------------------------------------------------------------------

CONFIRM = "uname -r        # the new kernel\nnvidia-smi      # lists the GPU, no 'couldn't communicate' error"


def _stranded_fix(report: DriverReport, inv: _Inventory) -> str:
    lines = ["sudo apt update", "sudo apt full-upgrade"]
    nxt = report.next_boot_kernel
    if nxt and not report.next_boot_modules:
        pkg = module_package_for(inv, nxt)
        if report.dkms:
            lines.append(f"sudo dkms autoinstall -k {nxt}")
        elif pkg:
            lines.append(f"sudo apt install {pkg}")
        lines.append(f"ls /lib/modules/{nxt}/kernel/nvidia*/ /lib/modules/{nxt}/updates/dkms/   # must list nvidia.ko*")
    lines.append("sudo reboot")
    lines.append("# after the reboot:")
    lines.append(CONFIRM)
    return "\n".join(lines)


def driver_checks(report: DriverReport, facts: DriverFacts, nvml_asked: bool) -> tuple[Check, ...]:
    """The driver-* checks, next-boot-modules and reboot-required of `sparkwatch doctor`."""
    inv = _inventory(facts.packages)
    detail = "\n".join(report.findings) or None
    if report.verdict == DriverVerdict.ABSENT:
        skip = "no NVIDIA driver installed (no nvidia packages, modules, /proc/driver/nvidia or /dev/nvidia*)"
        return (
            Check("driver-modules", CheckStatus.SKIP, skip, detail=detail),
            Check("driver-loaded", CheckStatus.SKIP, skip),
            Check("driver-version-match", CheckStatus.SKIP, skip),
            Check("next-boot-modules", CheckStatus.SKIP, skip),
            _reboot_check(report),
        )
    return (
        _modules_check(report, inv, detail),
        _loaded_check(report, facts, inv, nvml_asked),
        _version_check(report, facts),
        _next_boot_check(report, inv),
        _reboot_check(report),
    )


def _modules_check(report: DriverReport, inv: _Inventory, detail: str | None) -> Check:
    running = report.running_kernel
    if running is None:
        return Check(
            "driver-modules", CheckStatus.WARN, "cannot tell: the running kernel could not be read", detail=detail
        )
    if report.stranded:
        installed = sorted(p.name for ps in inv.per_kernel.values() for p in ps)
        have = f"; module packages installed: {', '.join(installed)}" if installed else ""
        return Check(
            "driver-modules",
            CheckStatus.FAIL,
            f"driver stranded: running kernel {running} has no NVIDIA modules{have}",
            fix=_stranded_fix(report, inv),
            detail=detail,
        )
    if not report.running_modules:
        return Check(
            "driver-modules",
            CheckStatus.SKIP,
            f"/lib/modules/{running} is not visible here; the loaded driver works",
            detail=detail,
        )
    source = "DKMS" if any(f.startswith("updates/dkms") for f in report.running_modules) else "package"
    pkgs = [p.name for p in inv.per_kernel.get(running, [])]
    return Check(
        "driver-modules",
        CheckStatus.OK,
        f"{running} has NVIDIA modules ({source}: {', '.join(report.running_modules)})"
        + (f" from {', '.join(pkgs)}" if pkgs else ""),
        detail=detail,
    )


def _loaded_check(report: DriverReport, facts: DriverFacts, inv: _Inventory, nvml_asked: bool) -> Check:
    nvml = facts.nvml
    nodes = " ".join(f"/dev/{n}" for n in facts.device_nodes) or "no /dev/nvidia*"
    nvml_line = (
        "NVML not asked (judging a --root other than /)"
        if not nvml_asked
        else "NVML: "
        + (
            f"ok, library {nvml.library_version}, driver {nvml.driver_version}"
            if nvml is not None and nvml.error is None
            else f"{nvml.error if nvml is not None else 'no answer'}"
        )
    )
    detail = f"{nodes}\n{nvml_line}"
    if report.loaded:
        kind = {True: " (open)", False: " (proprietary)", None: ""}[facts.loaded_open]
        status = CheckStatus.OK
        summary = f"driver {report.loaded_version}{kind} loaded"
        if nvml_asked and nvml is not None and nvml.error_code is not None:
            status = CheckStatus.FAIL
            summary += f", but NVML fails: {nvml.error}"
        return Check(
            "driver-loaded",
            status,
            summary,
            fix=_stranded_fix(report, inv) if status == CheckStatus.FAIL else None,
            detail=detail,
        )
    if report.loaded is None:
        return Check(
            "driver-loaded",
            CheckStatus.SKIP,
            "no evidence either way (device nodes but no /proc/driver/nvidia)",
            detail=detail,
        )
    if report.verdict == DriverVerdict.UNKNOWN:
        # Too little to go on (a root missing half its files): say what is missing, do not fail on a guess.
        return Check(
            "driver-loaded",
            CheckStatus.WARN,
            "no sign of a loaded NVIDIA driver, and the running kernel could not be read",
            detail=detail,
        )
    if report.stranded:
        fix = _stranded_fix(report, inv)
    else:
        fix = "sudo modprobe nvidia\nsudo dmesg | grep -iE 'nvidia|nvrm' | tail -20   # why it did not load\nnvidia-smi"
    return Check(
        "driver-loaded",
        CheckStatus.FAIL,
        "NVIDIA driver not loaded: no /proc/driver/nvidia/version",
        fix=fix,
        detail=detail,
    )


def _version_check(report: DriverReport, facts: DriverFacts) -> Check:
    if report.version_mismatch:
        return Check(
            "driver-version-match",
            CheckStatus.FAIL,
            f"loaded module {report.loaded_version or '?'} does not match the user-space library "
            f"{report.library_version or '?'} (NVML: driver/library version mismatch)",
            fix="sudo apt update\nsudo apt full-upgrade\nsudo reboot\n# after the reboot:\n" + CONFIRM,
            detail="the library was updated while the old module stayed loaded; a reboot loads the matching module",
        )
    if report.loaded_version is None or report.library_version is None:
        missing = "loaded module" if report.loaded_version is None else "user-space library"
        return Check("driver-version-match", CheckStatus.SKIP, f"cannot compare: {missing} version unknown")
    return Check("driver-version-match", CheckStatus.OK, f"module and library both {report.library_version}")


def _next_boot_check(report: DriverReport, inv: _Inventory) -> Check:
    nxt = report.next_boot_kernel
    if nxt is None or report.next_boot_ok is None:
        return Check("next-boot-modules", CheckStatus.SKIP, "cannot tell which kernel boots next (no /boot/vmlinuz-*)")
    if report.next_boot_ok:
        same = " (the running kernel)" if nxt == report.running_kernel else ""
        return Check("next-boot-modules", CheckStatus.OK, f"next boot {nxt}{same} has NVIDIA modules")
    if nxt == report.running_kernel:
        return Check(
            "next-boot-modules",
            CheckStatus.FAIL,
            f"next boot {nxt} (the running kernel) has no NVIDIA modules",
            fix=_stranded_fix(report, inv),
        )
    pkg = module_package_for(inv, nxt)
    lines = ["sudo apt update", "sudo apt full-upgrade"]
    if report.dkms:
        lines.append(f"sudo dkms autoinstall -k {nxt}")
    elif pkg:
        lines.append(f"sudo apt install {pkg}")
    lines.append(f"ls /lib/modules/{nxt}/kernel/nvidia*/ /lib/modules/{nxt}/updates/dkms/   # must list nvidia.ko*")
    lines.append("# only then: sudo reboot")
    return Check(
        "next-boot-modules",
        CheckStatus.FAIL,
        f"next boot strands the driver: kernel {nxt} has no NVIDIA modules (do not reboot yet)",
        fix="\n".join(lines),
    )


def _reboot_check(report: DriverReport) -> Check:
    if not report.reboot_required:
        return Check("reboot-required", CheckStatus.OK, "no reboot pending")
    pkgs = report.reboot_required_pkgs
    why = f" for {', '.join(pkgs[:6])}" + (f" and {len(pkgs) - 6} more" if len(pkgs) > 6 else "") if pkgs else ""
    blocked = report.next_boot_ok is False
    return Check(
        "reboot-required",
        CheckStatus.WARN,
        f"a reboot is pending{why}" + (" (but fix next-boot-modules first)" if blocked else ""),
        fix="sparkwatch engines           # stop these first\nsudo reboot\n# after the reboot:\n" + CONFIRM,
    )
