"""Fixture trees for the telemetry: a /proc with chosen processes, and flashinfer/vLLM-shaped JIT caches.

Names and paths are the real ones, as seen on Sparks: VLLM::EngineCore titles, ninja -> nvcc -> cicc chains with
`-gencode arch=compute_121a,code=sm_121a`, `<base>/<version>/121a/cached_ops/<module>/build.ninja`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
FIXED_MTIME = 1_767_225_600  # 2026-01-01T00:00:00Z: fixture mtimes are pinned so exposition is byte-exact

GB10_MEMINFO = (
    "MemTotal:       127600748 kB\n"
    "MemFree:        101234567 kB\n"
    "MemAvailable:   118566368 kB\n"
    "Buffers:           123456 kB\n"
    "Cached:          15234567 kB\n"
    "SwapCached:             0 kB\n"
    "SwapTotal:              0 kB\n"
    "SwapFree:               0 kB\n"
)
PSI_MEMORY = (
    "some avg10=0.00 avg60=0.12 avg300=0.30 total=12345678\nfull avg10=0.00 avg60=0.05 avg300=0.10 total=2345678\n"
)


@dataclass
class FakeProc:
    pid: int
    ppid: int
    comm: str
    argv: list[str]
    state: str = "S"
    rss_bytes: int = 0
    start_ticks: int = 1000
    environ: Mapping[str, str] | None = field(default_factory=dict)  # None: unreadable
    wchan: str = "0"
    cgroup: str | None = None  # its cgroup v2 path (a `0::` line); None: no cgroup file


def write_proc(
    root: Path, procs: Iterable[FakeProc], meminfo: str = GB10_MEMINFO, psi: str | None = PSI_MEMORY
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "meminfo").write_text(meminfo)
    if psi is not None:
        (root / "pressure").mkdir(exist_ok=True)
        (root / "pressure" / "memory").write_text(psi)
    for p in procs:
        d = root / str(p.pid)
        d.mkdir()
        rss_pages = p.rss_bytes // PAGE
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime
        # priority nice num_threads itrealvalue starttime vsize rss ...
        rest = f"{p.state} {p.ppid} {p.pid} {p.pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 {p.start_ticks} 0 {rss_pages}"
        (d / "stat").write_text(f"{p.pid} ({p.comm}) {rest} 0 0\n")
        (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in p.argv) + b"\0")
        if p.environ is None:
            (d / "environ").mkdir()  # reading it fails like EACCES does for another user's process
        else:
            (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in p.environ.items()))
        (d / "wchan").write_text(p.wchan)
        if p.cgroup is not None:
            (d / "cgroup").write_text(f"0::{p.cgroup}\n")
    return root


def write_module(
    arch_dir: Path, module: str, sources: list[str], built: list[str], *, linked: bool = False, object_bytes: int = 4096
) -> Path:
    """A flashinfer cached_ops/<module>/ dir: build.ninja with one .cuda.o per source, some built, maybe the .so."""
    d = arch_dir / "cached_ops" / module
    d.mkdir(parents=True, exist_ok=True)
    lines = [
        "ninja_required_version = 1.3",
        "cxx = c++",
        "nvcc = /usr/local/cuda/bin/nvcc",
        "cuda_cflags = -gencode=arch=compute_121a,code=sm_121a -O3",
        "rule cuda_compile",
        "  command = $nvcc $cuda_cflags -c $in -o $out",
        "rule link",
        "  command = $cxx $in -shared -o $out",
        "",
    ]
    for src in sources:
        lines.append(f"build $builddir/{src}.cuda.o: cuda_compile /src/flashinfer/csrc/{src}.cu")
    lines.append(f"build {module}.so: link " + " ".join(f"{s}.cuda.o" for s in sources))
    lines.insert(1, "builddir = .")  # relative: the fixture must not depend on where tmp_path is
    (d / "build.ninja").write_text("\n".join(lines) + "\n")
    for src in built:
        (d / f"{src}.cuda.o").write_bytes(b"\x7fELF" + b"\0" * (object_bytes - 4))
    if linked:
        (d / f"{module}.so").write_bytes(b"\x7fELF" + b"\0" * 8188)
    return d


def pin_mtimes(root: Path, ts: float = FIXED_MTIME) -> None:
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in [*filenames, *dirnames]:
            os.utime(os.path.join(dirpath, name), (ts, ts), follow_symlinks=False)
        os.utime(dirpath, (ts, ts))
