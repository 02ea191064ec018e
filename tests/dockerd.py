"""A real Docker daemon for the container tests (tests marked `docker`): the distribution's `docker.io` (dockerd 20.10
with its containerd and runc), started by the tests on a socket, data root, exec root and bridge of their own.

- One daemon per test session, never the host's: its socket is `/run/swd-<pid>/docker.sock`, its bridge `swd<N>`
  with 172.29.N.1/24 (N picked by the first bridge name free here, so parallel sessions never share one), its data
  root under /var/tmp/sparkwatch-dockerd/. `--iptables=false`: nothing of the host's firewall is touched; a published
  port goes through docker-proxy, as on a host without the NAT rules.
- The image is built offline, once: `mmdebstrap --variant=minbase` with python3 and python3-setproctitle (the fake
  engine sets its title as vLLM does) into a tar cached under /var/tmp (18 s here, 206 MiB), then `docker import`
  (5 s) into each session's daemon. The repository is bind-mounted read-only at /src in the containers that need
  tests/helpers.
- Only what this module started is ever signalled: its own dockerd (by the pid it wrote, checked by start time), and
  the containers the tests made through that daemon (`docker rm -f` by name). A session that died leaves its run
  directory; the next session stops that daemon (its pidfile and argv name the directory) and removes the bridge.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.nspawn import flock, host_sources

REPO = Path(__file__).resolve().parent.parent
IMAGE_DIR = Path(os.environ.get("SPARKWATCH_DOCKER_IMAGE_DIR", "/var/tmp/sparkwatch-docker-image"))
DATA_DIR = Path("/var/tmp/sparkwatch-dockerd")
RUN_PREFIX = "/run/swd-"
PACKAGES = ("python3", "python3-setproctitle", "procps")
IMAGE_KEY = hashlib.sha256(",".join(PACKAGES).encode()).hexdigest()[:12]
IMAGE = f"sparkwatch-test:{IMAGE_KEY}"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
TOOLS = ("dockerd", "containerd", "runc", "docker", "ip")
_DAEMONS: dict[int, subprocess.Popen[bytes]] = {}  # pid -> its Popen, kept until `stop` reaps it


def missing_reason() -> str | None:
    """Why no daemon can be started here, or None."""
    if os.geteuid() != 0:
        return "starting dockerd needs root"
    for tool in TOOLS:
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt packages docker.io, iproute2; see .ci/run)"
    if not _image_tar().is_file() and shutil.which("mmdebstrap") is None:
        return "mmdebstrap is not installed, and no test image is cached (apt package mmdebstrap; see .ci/run)"
    return None


# --- the image -----------------------------------------------------------------------------------------------------


def _image_tar() -> Path:
    return IMAGE_DIR / f"rootfs-{IMAGE_KEY}.tar"


def build_image_tar() -> Path:
    """The cached root file system as a tar, built if absent. Parallel callers build it once."""
    tar = _image_tar()
    if tar.is_file():
        return tar
    with flock(IMAGE_DIR / ".lock"):
        if tar.is_file():
            return tar
        tmp = tar.with_name(f"{tar.name}.tmp.{os.getpid()}")
        argv = ["mmdebstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", "--format=tar"]
        argv += ["bookworm", str(tmp), host_sources()]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"mmdebstrap failed ({done.returncode}):\n{done.stderr[-4000:]}")
        tmp.rename(tar)
    return tar


# --- the daemon ----------------------------------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return []


@dataclass(frozen=True)
class Dockerd:
    run_dir: Path  # /run/swd-<pid>: socket, exec root, pidfile
    data_root: Path
    bridge: str
    subnet_octet: int  # 172.29.<octet>.0/24
    pid: int
    start_ticks: int

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def host(self) -> str:
        """The daemon as DOCKER_HOST names it."""
        return f"unix://{self.socket}"

    @property
    def gateway(self) -> str:
        return f"172.29.{self.subnet_octet}.1"

    def env(self) -> dict[str, str]:
        """The environment of a `docker` client (or of sparkwatch) that talks to this daemon."""
        env = dict(os.environ)
        env["DOCKER_HOST"] = self.host
        env.pop("DOCKER_CONTEXT", None)
        return env

    def docker(self, *args: str, timeout_s: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The docker CLI against this daemon."""
        done = subprocess.run(
            ["docker", *args], env=self.env(), capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return done

    def inspect(self, container: str) -> dict[str, object]:
        out: list[dict[str, object]] = json.loads(self.docker("inspect", container).stdout)
        return out[0]

    def container_pid(self, container: str) -> int:
        state = self.inspect(container)["State"]
        assert isinstance(state, dict)
        return int(state["Pid"])

    def remove(self, *names: str) -> None:
        """`docker rm -f` of containers a test made; a missing one is no error."""
        if names:
            self.docker("rm", "-f", *names, check=False, timeout_s=60)


def _stop_pid(pid: int, ticks: int | None, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM a daemon this module started (checked by start time), then SIGKILL it past the timeout."""
    if ticks is None or _start_ticks(pid) != ticks:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _start_ticks(pid) != ticks:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _reap_stale() -> None:
    """The run directories of sessions that died: stop their daemon (a dockerd whose argv names that directory), remove
    their bridge, data root and directory."""
    for run_dir in Path("/run").glob("swd-*"):
        owner = run_dir.name.removeprefix("swd-")
        if owner.isdigit() and _start_ticks(int(owner)) is not None and Path(f"/proc/{owner}").exists():
            continue  # its session is alive (a pid reused by another process keeps it until that one ends)
        meta = run_dir / "session.json"
        with contextlib.suppress(OSError, ValueError, KeyError):
            info = json.loads(meta.read_text())
            pid = int(info["pid"])
            if str(run_dir) in " ".join(_argv(pid)):
                _stop_pid(pid, int(info["start_ticks"]))
            subprocess.run(["ip", "link", "del", info["bridge"]], capture_output=True, check=False)
            shutil.rmtree(info["data_root"], ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _make_bridge() -> tuple[str, int]:
    """A bridge of this session's own, with the first free name swd<N> (the kernel refuses a name taken)."""
    for octet in range(10, 250):
        name = f"swd{octet}"
        done = subprocess.run(["ip", "link", "add", name, "type", "bridge"], capture_output=True, check=False)
        if done.returncode == 0:
            subprocess.run(["ip", "addr", "add", f"172.29.{octet}.1/24", "dev", name], check=True)
            subprocess.run(["ip", "link", "set", name, "up"], check=True)
            return name, octet
    raise RuntimeError("no free bridge name swd10..swd249")


# dockerd is exec'd by this one line, which first makes it the subreaper of what it starts (the flag survives execve):
# a container's shim, which daemonizes, is then reparented to this session's dockerd rather than to PID 1. Each
# container's processes are descendants of the test process, and a real guard confined to them (`ancestor_pid`, as
# tests/daemon.py sets it) may kill this session's engines and no other's. (A preexec_fn would do it in the forked
# child, where another thread of pytest's may hold a lock: PLW1509.)
SUBREAPER_EXEC = (
    "import ctypes, os, sys; libc = ctypes.CDLL(None, use_errno=True); "
    "libc.prctl(36, 1, 0, 0, 0) == 0 or sys.exit(f'prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}'); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def start(log: Path) -> Dockerd:
    """A daemon of this session's own, with the test image imported. Stop it with `stop`."""
    _reap_stale()
    tar = build_image_tar()
    run_dir = Path(f"{RUN_PREFIX}{os.getpid()}")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(mode=0o700, parents=True)
    data_root = DATA_DIR / f"s{os.getpid()}"
    shutil.rmtree(data_root, ignore_errors=True)
    data_root.mkdir(parents=True)
    bridge, octet = _make_bridge()
    argv = [
        "dockerd",
        f"--host=unix://{run_dir}/docker.sock",
        f"--data-root={data_root}",
        f"--exec-root={run_dir}/exec",
        f"--pidfile={run_dir}/dockerd.pid",
        f"--bridge={bridge}",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-masq=false",
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", SUBREAPER_EXEC, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd="/",
        )
    _DAEMONS[proc.pid] = proc
    ticks = _start_ticks(proc.pid)
    assert ticks is not None, "dockerd exited at once"
    meta = {"pid": proc.pid, "start_ticks": ticks, "bridge": bridge, "data_root": str(data_root)}
    (run_dir / "session.json").write_text(json.dumps(meta))
    daemon = Dockerd(run_dir, data_root, bridge, octet, proc.pid, ticks)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            stop(daemon)
            raise RuntimeError(f"dockerd exited ({proc.returncode}); its log: {log}")
        if daemon.socket.exists() and daemon.docker("version", check=False, timeout_s=10).returncode == 0:
            break
        if time.monotonic() > deadline:
            stop(daemon)
            raise RuntimeError(f"dockerd did not answer within {START_TIMEOUT_S:.0f} s; its log: {log}")
        time.sleep(0.2)
    daemon.docker("import", str(tar), IMAGE, timeout_s=300)
    return daemon


def stop(daemon: Dockerd) -> None:
    """Remove every container of this daemon, stop it, and remove its bridge, data root and run directory."""
    if _start_ticks(daemon.pid) == daemon.start_ticks:
        ids = daemon.docker("ps", "-aq", check=False, timeout_s=30).stdout.split()
        if ids:
            daemon.docker("rm", "-f", *ids, check=False, timeout_s=120)
    _stop_pid(daemon.pid, daemon.start_ticks)
    proc = _DAEMONS.pop(daemon.pid, None)
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_TIMEOUT_S)
    subprocess.run(["ip", "link", "del", daemon.bridge], capture_output=True, check=False)
    shutil.rmtree(daemon.data_root, ignore_errors=True)
    shutil.rmtree(daemon.run_dir, ignore_errors=True)


def run_args(daemon: Dockerd, name: str, *flags: str, src: bool = True) -> list[str]:
    """`docker run -d` arguments for a test container named `name` from the test image, with the repository at /src
    (read-only) when `src`. Append the command."""
    argv = ["run", "-d", "--name", name, "--label", "io.sparkwatch.test=1"]
    if src:
        argv += ["-v", f"{REPO}:/src:ro", "-e", "PYTHONDONTWRITEBYTECODE=1"]
    return [*argv, *flags, IMAGE]


def fake_engine_argv(*args: str) -> Sequence[str]:
    """tests/helpers/fake_engine.py as the container sees it (the repository at /src)."""
    return ("python3", "/src/tests/helpers/fake_engine.py", *args)
