"""Builds fixture roots for the driver drift check from real Ubuntu/DGX OS package names and paths.

A root is a directory holding only what sources.system reads: proc/sys/kernel/osrelease, var/lib/dpkg/status,
lib/modules/<kernel>/…/nvidia.ko.zst, boot/vmlinuz-*, boot/grub/grubenv, proc/driver/nvidia/version, dev/nvidia*,
usr/lib/aarch64-linux-gnu/libnvidia-ml.so.<version>, run/reboot-required[.pkgs], proc/meminfo and proc/<pid>/….
Each scenario is written in code here instead of many checked-in files, so the tests say what they build.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

OLD_KERNEL = "6.11.0-1016-nvidia"
NEW_KERNEL = "6.17.0-1008-nvidia"
DRIVER = "580.95.05"
NEWER_DRIVER = "580.126.09"

# Real lines of /proc/driver/nvidia/version (open and proprietary kernel modules).
NVRM_OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  {v}  Release Build  "
    "(dvs-builder@U22-I3-AF03-09-1)  Sat Sep 27 00:36:09 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)
NVRM_PROPRIETARY = (
    "NVRM version: NVIDIA UNIX aarch64 Kernel Module  {v}  Sat Sep 27 00:20:31 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)

# Packages every DGX OS box has, so the status file looks like one and the parser skips non-nvidia stanzas.
_BASE_PACKAGES = (
    ("base-files", "13ubuntu10.3"),
    ("bash", "5.2.21-2ubuntu4"),
    ("dkms", "3.0.11-1ubuntu13"),
    ("linux-image-nvidia-hwe-24.04", "6.17.0-1008.8"),
)


@dataclass
class Pkg:
    name: str
    version: str
    status: str = "install ok installed"
    depends: str = ""


@dataclass
class FakeProc:
    pid: int
    ppid: int
    comm: str
    argv: tuple[str, ...]
    env: dict[str, str]
    uid: int = 0


@dataclass
class DriverRoot:
    """Declarative root; `write()` materialises it (idempotently: it clears the directory first)."""

    path: Path
    running: str | None = OLD_KERNEL
    packages: list[Pkg] = field(default_factory=list)
    modules: dict[str, list[str]] = field(default_factory=dict)  # kernel -> rel paths under lib/modules/<kernel>
    boot: list[str] = field(default_factory=list)
    grubenv: dict[str, str] = field(default_factory=dict)
    loaded: str | None = None
    loaded_open: bool = True
    device_nodes: bool = False
    libml: list[str] = field(default_factory=list)
    reboot_pkgs: list[str] | None = None
    meminfo_kb: tuple[int, int, int] | None = (127600748, 118566368, 0)  # GB10 idle: total, available, swap
    procs: list[FakeProc] = field(default_factory=list)
    dpkg_raw: bytes | None = None  # overrides the generated status file (corrupt/truncated cases)

    # --- the vocabulary of the scenarios
    def add_kernel_modules(
        self, kernel: str, branch: str | None = "580", open_: bool = True, server: bool = False
    ) -> None:
        """The per-kernel package, its companions, and the module file it ships."""
        variant = "-".join(p for p in (branch, "server" if server else None, "open" if open_ else None) if p)
        prefix = f"{variant}-" if variant else ""
        kver = _abi(kernel)
        self.packages.append(Pkg(f"linux-modules-nvidia-{prefix}{kernel}", kver, depends=f"linux-image-{kernel}"))
        self.packages.append(Pkg(f"linux-objects-nvidia-{prefix}{kernel}", kver))
        self.packages.append(Pkg(f"linux-signatures-nvidia-{kernel}", kver))
        subdir = "nvidia-" + variant if variant else "nvidia"
        self.modules.setdefault(kernel, []).append(f"kernel/{subdir}/nvidia.ko.zst")

    def add_meta(self, branch: str | None = "580", open_: bool = True, flavour: str = "nvidia") -> None:
        variant = "-".join(p for p in (branch, "open" if open_ else None) if p)
        name = f"linux-modules-nvidia-{variant}-{flavour}" if variant else f"linux-modules-nvidia-{flavour}"
        self.packages.append(Pkg(name, _abi(NEW_KERNEL)))

    def add_userspace(self, version: str = DRIVER, branch: str = "580") -> None:
        self.packages.append(Pkg(f"libnvidia-compute-{branch}", f"{version}-0ubuntu0.24.04.1"))
        self.packages.append(Pkg(f"nvidia-utils-{branch}", f"{version}-0ubuntu0.24.04.1"))
        self.packages.append(Pkg(f"nvidia-kernel-common-{branch}", f"{version}-0ubuntu0.24.04.1"))
        self.libml.append(version)

    def add_dkms(
        self, kernels: list[str], branch: str | None = "580", open_: bool = True, version: str = DRIVER
    ) -> None:
        variant = "-".join(p for p in (branch, "open" if open_ else None) if p)
        self.packages.append(Pkg(f"nvidia-dkms-{variant}", f"{version}-0ubuntu0.24.04.1"))
        for k in kernels:
            self.modules.setdefault(k, []).append("updates/dkms/nvidia.ko.zst")

    def set_loaded(self, version: str = DRIVER, open_: bool = True) -> None:
        self.loaded, self.loaded_open, self.device_nodes = version, open_, True

    def add_proc(self, pid: int, ppid: int, comm: str, argv: tuple[str, ...], env: dict[str, str]) -> None:
        self.procs.append(FakeProc(pid, ppid, comm, argv, env))

    # --- materialise
    def write(self) -> Path:
        if self.path.exists():
            shutil.rmtree(self.path)
        p = self.path
        p.mkdir(parents=True)
        if self.running is not None:
            _put(p / "proc/sys/kernel/osrelease", self.running + "\n")
        if self.dpkg_raw is not None:
            _put_bytes(p / "var/lib/dpkg/status", self.dpkg_raw)
        else:
            _put(p / "var/lib/dpkg/status", self.dpkg_status())
        for kernel in {*self.boot, *([self.running] if self.running else [])}:
            # every installed kernel has its own modules tree (linux-modules-<kernel>), nvidia or not
            _put(
                p / "lib/modules" / kernel / "modules.dep",
                "kernel/drivers/net/ethernet/mellanox/mlx5/core/mlx5_core.ko.zst:\n",
            )
        for kernel, rels in self.modules.items():
            (p / "lib/modules" / kernel).mkdir(parents=True, exist_ok=True)
            for rel in rels:
                # A zstd frame magic and some bytes: a module file is non-empty; its content is never parsed.
                _put_bytes(p / "lib/modules" / kernel / rel, b"\x28\xb5\x2f\xfd" + b"\0" * 60)
        for kernel in self.boot:
            _put_bytes(p / "boot" / f"vmlinuz-{kernel}", b"MZ\0\0")
            _put_bytes(p / "boot" / f"initrd.img-{kernel}", b"\0")
        if self.boot:
            (p / "boot/grub").mkdir(parents=True, exist_ok=True)
        if self.grubenv:
            body = "# GRUB Environment Block\n" + "".join(f"{k}={v}\n" for k, v in self.grubenv.items())
            _put(p / "boot/grub/grubenv", body + "#" * (1024 - len(body)))
        if self.loaded is not None:
            template = NVRM_OPEN if self.loaded_open else NVRM_PROPRIETARY
            _put(p / "proc/driver/nvidia/version", template.format(v=self.loaded))
        if self.device_nodes:
            for node in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
                _put_bytes(p / "dev" / node, b"")
        for version in self.libml:
            _put_bytes(p / f"usr/lib/aarch64-linux-gnu/libnvidia-ml.so.{version}", b"\x7fELF")
            _put_bytes(p / "usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1", b"\x7fELF")
        if self.reboot_pkgs is not None:
            _put(p / "run/reboot-required", "*** System restart required ***\n")
            _put(p / "run/reboot-required.pkgs", "".join(f"{x}\n" for x in self.reboot_pkgs))
        if self.meminfo_kb is not None:
            total, avail, swap = self.meminfo_kb
            _put(
                p / "proc/meminfo",
                f"MemTotal:       {total} kB\nMemFree:        {avail - 2000000} kB\nMemAvailable:   {avail} kB\n"
                f"Buffers:           12345 kB\nCached:          3000000 kB\nSwapCached:            0 kB\n"
                f"SwapTotal:       {swap} kB\nSwapFree:        {swap} kB\n",
            )
        for proc in self.procs:
            base = p / "proc" / str(proc.pid)
            stat_rest = ["S", str(proc.ppid)] + ["0"] * 17 + ["12345"] + ["0"] + ["2560"] + ["0"] * 26
            _put(base / "stat", f"{proc.pid} ({proc.comm[:15]}) {' '.join(stat_rest)}\n")
            _put_bytes(base / "cmdline", b"".join(a.encode() + b"\0" for a in proc.argv))
            _put_bytes(base / "environ", b"".join(f"{k}={v}".encode() + b"\0" for k, v in proc.env.items()))
        return p

    def dpkg_status(self) -> str:
        stanzas = []
        for name, version in _BASE_PACKAGES:
            stanzas.append(_stanza(Pkg(name, version)))
        for pkg in self.packages:
            stanzas.append(_stanza(pkg))
        return "\n".join(stanzas)


def _abi(kernel: str) -> str:
    """6.17.0-1008-nvidia -> 6.17.0-1008.8: the Debian version of Ubuntu's per-kernel packages."""
    base, abi, _flavour = kernel.split("-", 2)
    return f"{base}-{abi}.{int(abi) % 100}"


def _stanza(pkg: Pkg) -> str:
    lines = [
        f"Package: {pkg.name}",
        f"Status: {pkg.status}",
        "Priority: optional",
        "Section: kernel" if pkg.name.startswith("linux-") else "Section: libs",
        "Installed-Size: 1234",
        "Maintainer: Canonical Kernel Team <kernel-team@lists.ubuntu.com>",
        "Architecture: arm64",
        f"Version: {pkg.version}",
    ]
    if pkg.depends:
        lines.append(f"Depends: {pkg.depends}")
    if pkg.status.endswith("config-files"):
        lines.append("Conffiles:\n /etc/modprobe.d/nvidia-graphics-drivers-kms.conf 1f1ae9b4a0b7d1c2 obsolete")
    lines.append(
        f"Description: {pkg.name}\n This package was built for a sparkwatch fixture from real names.\n .\n It "
        "carries a multi-line description like every real stanza."
    )
    return "\n".join(lines) + "\n"


def _put(path: Path, text: str) -> None:
    _put_bytes(path, text.encode())


def _put_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# --- the scenarios ---------------------------------------------------------------------------------------------


def healthy(path: Path, kernel: str = NEW_KERNEL, branch: str | None = "580", open_: bool = True) -> DriverRoot:
    r = DriverRoot(path, running=kernel, boot=[kernel])
    r.add_kernel_modules(kernel, branch=branch, open_=open_)
    r.add_meta(branch=branch, open_=open_)
    r.add_userspace()
    r.set_loaded(open_=open_)
    return r


def stranded_after_update(path: Path) -> DriverRoot:
    """The field report: DGX OS update installed 6.17 and removed the modules of the running 6.11. No reboot yet."""
    r = DriverRoot(path, running=OLD_KERNEL, boot=[OLD_KERNEL, NEW_KERNEL])
    r.add_kernel_modules(NEW_KERNEL)
    r.packages.append(
        Pkg(f"linux-modules-nvidia-580-open-{OLD_KERNEL}", _abi(OLD_KERNEL), status="deinstall ok config-files")
    )
    r.add_meta()
    r.add_userspace()
    r.reboot_pkgs = [f"linux-image-{NEW_KERNEL}", "linux-base"]
    return r  # module gone, so nothing loaded and no /dev/nvidia*


def will_strand(path: Path) -> DriverRoot:
    """6.17 is installed and boots next, but its module package is not: the reboot would come back without a GPU."""
    r = DriverRoot(path, running=OLD_KERNEL, boot=[OLD_KERNEL, NEW_KERNEL])
    r.add_kernel_modules(OLD_KERNEL)
    r.add_meta()
    r.add_userspace()
    r.set_loaded()
    r.reboot_pkgs = [f"linux-image-{NEW_KERNEL}"]
    return r


def dkms_healthy(path: Path) -> DriverRoot:
    r = DriverRoot(path, running=NEW_KERNEL, boot=[OLD_KERNEL, NEW_KERNEL])
    r.add_dkms([OLD_KERNEL, NEW_KERNEL])
    r.add_userspace()
    r.set_loaded()
    return r


def version_mismatch(path: Path) -> DriverRoot:
    """apt upgraded the user-space driver to 580.126.09 while the 580.95.05 module stays loaded."""
    r = healthy(path)
    r.packages = [p for p in r.packages if not p.name.startswith(("libnvidia", "nvidia-utils", "nvidia-kernel-common"))]
    r.libml = []
    r.add_userspace(NEWER_DRIVER)
    r.set_loaded(DRIVER)
    r.reboot_pkgs = ["nvidia-dkms-580-open", "libnvidia-compute-580"]
    return r
