"""A Debian bookworm container whose PID 1 is a real systemd (252), under systemd-nspawn, for tests of the shipped
units (tests/test_systemd_nspawn.py). Everything here runs on the host as root.

- The root is built once with mmdebstrap (minbase + systemd, dbus, python3, python3-venv, procps, util-linux, a user
  `tester` with lingering on) into /var/tmp and reused while its package list is the same: 20-32 s to build, 257 MiB.
  Every boot uses `--volatile=overlay`: writes go to a tmpfs over it, so the cached tree is never changed.
- sparkwatch gets in as wheels built on the host (the container has no network): the project's wheel from the
  working tree, and its dependencies downloaded for the container's Python (Debian's 3.11, glibc 2.36), whatever the
  host's interpreter is. Both are cached under /var/tmp, the project's by the hash of its sources.
- The boot works on a host whose PID 1 is not systemd (this VM, CI's): `--register=no --keep-unit` (without a host
  system bus nspawn can neither register nor make a scope: both are needed), started from a cgroup of its own (nspawn
  puts `payload/` and `supervisor/` below the cgroup it starts in, and never removes them), with
  SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 (a pure cgroup2 inside, as on Ubuntu 24.04 and DGX OS, even on a hybrid host).
  `/dev/kmsg` is made inside as the real device node (`mknod c 1 11`), as a host has it: nspawn's `--bind=/dev/kmsg`
  would make it a bind mount over an empty regular file, and ProtectKernelLogs= then behaves as on no real host.
- Only what this module started is ever signalled from the host: the nspawn process and the container's PID 1, each
  checked by its start time. Processes inside are signalled from inside (`kill` through nsenter).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parent.parent
ROOT_DIR = Path(os.environ.get("SPARKWATCH_NSPAWN_ROOT", "/var/tmp/sparkwatch-nspawn-root"))
WHEEL_CACHE = Path(os.environ.get("SPARKWATCH_NSPAWN_WHEELS", "/var/tmp/sparkwatch-nspawn-wheels"))
STATE_DIR = Path("/run/sparkwatch-nspawn")  # one file per running container: what to clean up after a crash
PACKAGES = ("systemd", "systemd-sysv", "dbus", "libpam-systemd", "python3", "python3-venv", "procps", "util-linux")
# The container's interpreter (Debian bookworm's python3) and C library, for the dependency wheels.
CT_PYTHON = "3.11"
CT_GLIBC_MINOR = 36
# The fake engine (tests/helpers/fake_engine.py) sets its title with setproctitle, as vLLM does.
TEST_REQUIREMENTS = ("setproctitle>=1.3",)
CT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CT_ENV = ("env", "-i", f"PATH={CT_PATH}", "LANG=C.UTF-8", "TERM=dumb", "HOME=/root")
TESTER_UID = 1000
BOOT_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


def missing_reason() -> str | None:
    """Why no container can be booted here, or None."""
    if os.geteuid() != 0:
        return "booting a systemd-nspawn container needs root"
    for tool in ("systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt packages systemd-container, util-linux; see .ci/run)"
    if not _root_is_current(ROOT_DIR) and shutil.which("mmdebstrap") is None:
        return "mmdebstrap is not installed, and no container root is cached (apt package mmdebstrap; see .ci/run)"
    if not Path("/sys/fs/cgroup/cgroup.controllers").exists() and not Path("/sys/fs/cgroup/unified").is_dir():
        return "no cgroup2 hierarchy on this host (legacy cgroup v1 only): systemd in nspawn would have no cgroup.kill"
    return None


# --- the root ------------------------------------------------------------------------------------------------------


def _root_is_current(root: Path) -> bool:
    stamp = root / ".sw-packages"
    return stamp.is_file() and stamp.read_text().strip() == ",".join(PACKAGES)


def host_sources() -> str:
    """The host's own apt sources, passed to mmdebstrap as they are, so the container uses the host's mirror."""
    for f in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")):
        if f.is_file() and f.stat().st_size > 0:
            return str(f)
    return "deb http://deb.debian.org/debian bookworm main"


@contextlib.contextmanager
def flock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def build_root(root: Path = ROOT_DIR) -> Path:
    """The cached root, built if absent or built from another package list. Parallel callers build it once."""
    if _root_is_current(root):
        return root
    with flock(root.with_name(root.name + ".lock")):
        if _root_is_current(root):
            return root
        tmp = root.with_name(f"{root.name}.tmp.{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        hooks = [
            'rm -f "$1"/etc/hostname; echo swct > "$1"/etc/hostname',  # mmdebstrap copies the host's in
            ': > "$1"/etc/machine-id',  # systemd makes one from the container UUID at each boot
            f'chroot "$1" useradd -m -u {TESTER_UID} -s /bin/bash tester',
            'mkdir -p "$1"/var/lib/systemd/linger && touch "$1"/var/lib/systemd/linger/tester',  # user@1000 at boot
        ]
        argv = ["mmdebstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}"]
        argv += [f"--customize-hook={h}" for h in hooks]
        argv += ["bookworm", str(tmp), host_sources()]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"mmdebstrap failed ({done.returncode}):\n{done.stderr[-4000:]}")
        (tmp / ".sw-packages").write_text(",".join(PACKAGES) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        tmp.rename(root)
    return root


# --- wheels --------------------------------------------------------------------------------------------------------


def _project_files(repo: Path) -> list[Path]:
    files = [repo / "pyproject.toml", repo / "README.md"]
    for path in sorted((repo / "sparkwatch").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and not path.name.endswith(".pyc"):
            files.append(path)
    return files


def _requirements(repo: Path) -> list[str]:
    with open(repo / "pyproject.toml", "rb") as fh:
        deps: list[str] = tomllib.load(fh)["project"]["dependencies"]
    return [*deps, *TEST_REQUIREMENTS]


def _pip(*args: str, timeout_s: float = 300) -> None:
    argv = [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip {args[0]} failed ({done.returncode}):\n{done.stderr[-4000:]}")


@dataclass(frozen=True)
class Wheels:
    deps: Path  # the dependencies, for the container's interpreter and C library
    project: Path  # sparkwatch's own wheel, built from the working tree


def build_wheels(repo: Path = REPO, cache: Path = WHEEL_CACHE) -> Wheels:
    """The wheels the container installs from (it has no network). The project's wheel is built from a copy of the
    working tree's sources (a build in place would leave build/ and *.egg-info in the tree), keyed by their hash;
    the dependencies are downloaded once per requirement list."""
    machine = platform.machine()
    reqs = _requirements(repo)
    deps_key = hashlib.sha256(json.dumps([reqs, CT_PYTHON, CT_GLIBC_MINOR, machine]).encode()).hexdigest()[:16]
    deps = cache / f"deps-{deps_key}"
    with flock(cache / ".lock"):
        if not (deps / ".done").exists():
            shutil.rmtree(deps, ignore_errors=True)
            # Every manylinux tag bookworm's glibc accepts: pip does not widen a --platform by itself.
            platforms = [f"manylinux_2_{minor}_{machine}" for minor in range(CT_GLIBC_MINOR, 16, -1)]
            platforms += [f"manylinux2014_{machine}", f"manylinux2010_{machine}", f"manylinux1_{machine}"]
            target = [
                "--python-version",
                CT_PYTHON,
                "--implementation",
                "cp",
                "--abi",
                f"cp{CT_PYTHON.replace('.', '')}",
            ]
            plat_args = [a for p in platforms for a in ("--platform", p)]
            _pip("download", "--only-binary=:all:", *target, *plat_args, "-d", str(deps), *reqs)
            (deps / ".done").touch()
        digest = hashlib.sha256()
        for path in _project_files(repo):
            digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
        project = cache / f"sparkwatch-{digest.hexdigest()[:16]}"
        if not (project / ".done").exists():
            shutil.rmtree(project, ignore_errors=True)
            with tempfile.TemporaryDirectory(prefix="sw-src-", dir=cache) as src:
                for path in _project_files(repo):
                    dest = Path(src) / path.relative_to(repo)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, dest)
                _pip("wheel", "--no-deps", "-w", str(project), src)
            (project / ".done").touch()
            for old in sorted(cache.glob("sparkwatch-*"), key=lambda p: p.stat().st_mtime)[:-3]:
                shutil.rmtree(old, ignore_errors=True)  # keep the last three source versions
    return Wheels(deps=deps, project=project)


# --- processes on the host -----------------------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """Start time of a live (not zombie) process, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _alive(pid: int, start: int) -> bool:
    return pid > 0 and _start_ticks(pid) == start


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as fh:
                    if int(fh.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _cgroup_hierarchies() -> list[Path]:
    """Where nspawn makes its cgroups: the unified hierarchy and, on a hybrid host, name=systemd too."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return [Path("/sys/fs/cgroup")]
    return [p for p in (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd")) if p.is_dir()]


def _host_runs_systemd() -> bool:
    return Path("/run/systemd/system").is_dir()


# --- the container -------------------------------------------------------------------------------------------------


class ContainerError(AssertionError):
    pass


@dataclass
class Container:
    """One booted container. `run` executes inside as root with the host's capabilities (nsenter), `unit` as a
    transient service of the container's systemd (its cgroup, its sandbox)."""

    name: str
    log_path: Path
    binds_ro: Sequence[tuple[Path, str]] = ()
    root: Path = ROOT_DIR
    nspawn: subprocess.Popen[bytes] | None = None
    nspawn_start: int = 0
    pid1: int = 0
    pid1_start: int = 0
    boot_s: float = 0.0
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.name}.json"

    # --- boot
    def boot(self) -> None:
        reap_stale()
        self._cleanup_cgroups()
        args = ["-b", "-D", str(self.root), f"--machine={self.name}", "--register=no", "--keep-unit"]
        args += ["--private-network", "--capability=all", "--console=read-only", "--hostname=swct"]
        args += ["--volatile=overlay", *(f"--bind-ro={host}:{ct}" for host, ct in self.binds_ro)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SYSTEMD_", "NOTIFY_SOCKET", "LISTEN_"))}
        env["SYSTEMD_NSPAWN_UNIFIED_HIERARCHY"] = "1"
        if _host_runs_systemd():  # the host's systemd makes the (delegated) scope nspawn keeps
            argv = ["systemd-run", "--quiet", "--scope", f"--unit={self.name}", "-p", "Delegate=yes"]
            argv += ["systemd-nspawn", *args]
        else:  # no systemd on the host: a cgroup of its own, then exec nspawn there
            dirs = " ".join(str(h) for h in _cgroup_hierarchies())
            script = (
                f'for h in {dirs}; do mkdir -p "$h/$0" && echo $$ > "$h/$0/cgroup.procs" || exit 1; done; exec "$@"'
            )
            argv = ["sh", "-c", script, self.name, "systemd-nspawn", *args]
        t0 = time.monotonic()
        log = self._log = open(self.log_path, "wb")  # noqa: SIM115 (open as long as nspawn runs)
        self.nspawn = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.nspawn_start = _start_ticks(self.nspawn.pid) or 0
        self._write_state()
        deadline = t0 + BOOT_TIMEOUT_S
        try:
            self._wait_pid1(deadline)
            self._write_state()
            sock = Path(f"/proc/{self.pid1}/root/run/systemd/private")
            while not sock.is_socket():  # systemctl needs PID 1's private socket, else "Failed to connect to bus"
                self._check_deadline(deadline, "PID 1's /run/systemd/private")
                time.sleep(0.02)
            if self.run(["test", "-e", "/dev/kmsg"], check=False).returncode != 0:
                self.run(["mknod", "-m", "644", "/dev/kmsg", "c", "1", "11"])  # the device, as on a host
            state = self.run(
                ["systemctl", "is-system-running", "--wait"],
                check=False,
                timeout_s=max(1.0, deadline - time.monotonic()),
            ).stdout.strip()
            if state not in ("running", "degraded"):
                raise ContainerError(f"container {self.name} did not boot: {state!r}\n{self.console_tail()}")
            if state == "degraded":
                failed = self.run(["systemctl", "--failed", "--no-pager"], check=False).stdout
                raise ContainerError(f"container {self.name} booted degraded:\n{failed}")
        except BaseException:
            self.stop()
            raise
        self.boot_s = time.monotonic() - t0

    def _wait_pid1(self, deadline: float) -> None:
        """PID 1 is nspawn's child once it runs systemd in a PID namespace of its own (under `systemd-run --scope`
        nspawn is the scope's process, exec'd in place)."""
        assert self.nspawn is not None
        own_ns = os.readlink("/proc/self/ns/pid")
        while True:
            if self.nspawn.poll() is not None:
                raise ContainerError(f"systemd-nspawn exited ({self.nspawn.returncode}):\n{self.console_tail()}")
            for child in _children(self.nspawn.pid):
                try:
                    comm = Path(f"/proc/{child}/comm").read_text().strip()
                    ns = os.readlink(f"/proc/{child}/ns/pid")
                except OSError:
                    continue
                start = _start_ticks(child)
                if comm == "systemd" and ns != own_ns and start is not None:
                    self.pid1, self.pid1_start = child, start
                    return
            self._check_deadline(deadline, "the container's PID 1")
            time.sleep(0.02)

    def _check_deadline(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise ContainerError(f"no {what} after {BOOT_TIMEOUT_S:.0f} s\n{self.console_tail()}")

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        me = os.getpid()
        state = {
            "owner": [me, _start_ticks(me)],
            "nspawn": [self.nspawn.pid if self.nspawn else 0, self.nspawn_start],
            "pid1": [self.pid1, self.pid1_start],
            "name": self.name,
        }
        self.state_file.write_text(json.dumps(state))

    def console_tail(self, n_bytes: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n_bytes:].decode(errors="replace")
        except OSError:
            return ""

    # --- inside
    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout_s: float = 60.0, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run argv in all the container's namespaces, as root with a clean environment."""
        full = ["nsenter", "-t", str(self.pid1), "-a", *CT_ENV, *argv]
        done = subprocess.run(full, capture_output=True, text=True, timeout=timeout_s, input=input_text, check=False)
        if check and done.returncode != 0:
            raise ContainerError(
                f"{' '.join(argv)}: exit {done.returncode}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        return done

    def sh(self, script: str, *args: str, check: bool = True, timeout_s: float = 60.0) -> str:
        return self.run(["sh", "-ec", script, "sh", *args], check=check, timeout_s=timeout_s).stdout

    def write(self, path: str, text: str, owner: str | None = None) -> None:
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1"'
        if owner is not None:
            script += ' && chown "$2" "$1"'
        self.run(["sh", "-ec", script, "sh", path, *([owner] if owner else [])], input_text=text)

    def read(self, path: str) -> str:
        return self.run(["cat", path]).stdout

    def unit(self, argv: Sequence[str], *properties: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """argv as a transient service, waited for, its stdout piped back (systemd-run --pipe --wait)."""
        props = [a for p in properties for a in ("-p", p)]
        return self.run(
            ["systemd-run", "--quiet", "--pipe", "--wait", "--collect", "--service-type=exec", *props, *argv],
            check=False,
            timeout_s=timeout_s,
        )

    def as_tester(self, argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """argv as the `tester` user, with its user manager's runtime dir (systemctl --user talks to it)."""
        runtime = f"XDG_RUNTIME_DIR=/run/user/{TESTER_UID}"
        cmd = ["setpriv", f"--reuid={TESTER_UID}", f"--regid={TESTER_UID}", "--init-groups"]
        return self.run([*cmd, "env", "HOME=/home/tester", runtime, *argv], check=check)

    # --- stop
    def stop(self) -> str:
        """Power off, escalate to SIGTERM of nspawn, then SIGKILL of PID 1 and nspawn; remove what nspawn left."""
        how = "not started"
        if self.nspawn is not None and self.nspawn.poll() is None:
            how = "poweroff"
            if self.pid1 and _alive(self.pid1, self.pid1_start):
                done = self.run(["systemctl", "poweroff", "--no-block"], check=False, timeout_s=10)
                if done.returncode != 0:
                    how = "sigterm"
                    self.nspawn.send_signal(signal.SIGTERM)  # nspawn asks PID 1 to halt (SIGRTMIN+3)
            else:
                how = "sigterm"
                self.nspawn.send_signal(signal.SIGTERM)
            try:
                self.nspawn.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                how += ", then SIGKILL"
        if self.pid1 and _alive(self.pid1, self.pid1_start):
            # nspawn gone but PID 1 left (reparented): only its own SIGKILL ends the PID namespace
            os.kill(self.pid1, signal.SIGKILL)
        if self.nspawn is not None and self.nspawn.poll() is None:
            self.nspawn.kill()
        if self.nspawn is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.nspawn.wait(10)
        deadline = time.monotonic() + 10
        while self.pid1 and _alive(self.pid1, self.pid1_start) and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._cleanup_cgroups()
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{self.name}", ignore_errors=True)
        self.state_file.unlink(missing_ok=True)
        return how

    def _cleanup_cgroups(self) -> None:
        """rmdir the container's cgroup subtree, deepest first (nspawn leaves payload/ and supervisor/)."""
        _remove_cgroups(self.name)


def _remove_cgroups(name: str) -> None:
    for hierarchy in _cgroup_hierarchies():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


def reap_stale() -> None:
    """Stop containers that an earlier test process started and left behind (it was killed): their state file names
    the owner, nspawn and PID 1 with start times, so a reused pid is never signalled."""
    if not STATE_DIR.is_dir():
        return
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
            owner_pid, owner_start = state["owner"]
            nspawn_pid, nspawn_start = state["nspawn"]
            pid1, pid1_start = state["pid1"]
            name = str(state["name"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner_start is not None and _alive(owner_pid, owner_start):
            continue  # its owner still runs (another test process): not ours to stop
        for pid, start in ((pid1, pid1_start), (nspawn_pid, nspawn_start)):
            if _alive(pid, start):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while (_alive(pid1, pid1_start) or _alive(nspawn_pid, nspawn_start)) and time.monotonic() < deadline:
            time.sleep(0.02)
        _remove_cgroups(name)
        shutil.rmtree(f"/run/systemd/nspawn/propagate/{name}", ignore_errors=True)
        path.unlink(missing_ok=True)
