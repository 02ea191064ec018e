"""Running an engine in a container for `sparkwatch launch` (cli.launch.docker prepared it): the hooks of
cli.launch.runner.Launch where the engine is a container's processes, and launch's child only the docker client.

- launch runs the client attached (`docker run` without `-d`, `compose up SERVICE` without `-d`): its output is the
  container's, passed through and searched for boot phases as a bare engine's.
- The container is found on a thread of its own (`Finder`): its id from the cidfile (`docker run`) or by launch's
  label (`docker ps --filter label=io.sparkwatch.launch=TOKEN`, compose), then `docker inspect` until it runs. Its
  top process (docker-init, under containerd-shim) is then declared (common.launched: `container`, `launch_id`, the
  process's own uid), so the guard takes the container's processes as the declared engine's tree, holds its budget
  and names it in its word to launch; the footprint is that tree's, with the container's cgroup (memory.current).
  `docker wait` on the same thread gives the container's first exit code (compose up's own says nothing of it).
- Ready is a bare engine's: the first one-token completion, dialled at the engine's own address in the container's
  network namespace (telemetry.sources.listeners.dial_of: the owner of that rule), else its ready line.
- Ctrl-C (and SIGTERM, SIGHUP) stops the container by its id (`docker stop`, the image's stop signal then SIGKILL
  after its timeout); a second one `docker kill`s it; a third kills the client. Before the container is known, they
  go to the client as for any command.
- The end: the container runs with no restart policy while launch watches it (cli.launch.docker leaves `--restart`
  out, or sets `restart: "no"` in launch's compose file): when its top process is gone (the guard killed it, or it
  ended) it stays stopped, however `--restart` read. A container still running when its client ended is stopped
  (`docker stop`): nothing launch started runs on unwatched. The exit code is the container's first (`docker wait`;
  137 and the guard's word when the guard killed it).
- `-d`: launch stays until the engine is ready, with the container's output on stderr, gives the container the
  restart policy the command named (`docker update --restart`), prints its id on stdout (as `docker run -d` does),
  leaves the client and exits 0: the container runs on, declared to the guard (its budget holds until the container
  stops; a restart after that is docker's, under no declaration).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from sparkwatch.cli.launch.docker import Container, docker_out
from sparkwatch.cli.launch.runner import Launch
from sparkwatch.cli.launch.supervise import Supervisor
from sparkwatch.common.sources.procs import read_cgroup, read_descendants, read_start_ticks
from sparkwatch.common.threads import daemon_thread
from sparkwatch.core.container import LABEL_LAUNCH
from sparkwatch.core.engines.enginecli import EngineKind
from sparkwatch.core.engines.serving import endpoint_of
from sparkwatch.core.launch import launchenv
from sparkwatch.core.launch.bootphase import BootPhase

if TYPE_CHECKING:
    from sparkwatch.cli.launch.gather import PlanContext
    from sparkwatch.config.settings import Settings
    from sparkwatch.core.launch.plan import Plan

FIND_EVERY_S = 0.25
# A pull or a build can take minutes: after this long the container is looked for once a second (each look may be a
# docker command, some 30 ms of a core).
FIND_SLOWER_AFTER_S = 10.0
FIND_SLOW_S = 1.0
EXIT_CODE_WAIT_S = 5.0  # after the client ended, how long `docker wait` may take to say the container's exit code
STOP_GRACE_S = 2  # `docker stop -t` of a container whose client is gone: launch is ending


class Finder:
    """The container on a thread of its own: its id, then `docker inspect` until it runs; then `docker wait`."""

    def __init__(self, box: Container, env: dict[str, str]) -> None:
        self.box, self.env = box, env
        self.found: tuple[str, int] | None = None  # (id, top pid)
        self.exit_code: int | None = None
        self.waited = threading.Event()
        self._stop = threading.Event()

    def start(self) -> None:
        daemon_thread(self._run, "sparkwatch-container").start()

    def stop(self) -> None:
        self._stop.set()

    def _id(self) -> str | None:
        cidfile = self.box.cidfile
        if cidfile is not None:
            try:
                return cidfile.read_text().strip() or None
            except OSError:
                return None
        code, out, _err = docker_out(
            [*self.box.docker, "ps", "-aq", "--no-trunc", "--filter", f"label={LABEL_LAUNCH}={self.box.token}"],
            self.env,
        )
        ids = out.split() if code == 0 else []
        return ids[0] if ids else None

    def _run(self) -> None:
        slow_from = time.monotonic() + FIND_SLOWER_AFTER_S
        try:
            while not self._stop.wait(FIND_EVERY_S if time.monotonic() < slow_from else FIND_SLOW_S):
                cid = self._id()
                if cid is None:
                    continue
                code, out, _err = docker_out([*self.box.docker, "inspect", "--type", "container", cid], self.env)
                pid = _running_pid(out) if code == 0 else None
                if pid is not None:
                    self.found = (cid, pid)
                    break
            else:
                return
            code, out, _err = docker_out([*self.box.docker, "wait", self.found[0]], self.env, timeout_s=None)
            if code == 0 and out.strip().isdigit():
                self.exit_code = int(out.strip())
        finally:
            self.waited.set()


def _running_pid(out: str) -> int | None:
    """The top process of a running container, from `docker inspect`; None until it runs."""
    try:
        state = json.loads(out)[0]["State"]
        pid = int(state.get("Pid") or 0)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return pid if state.get("Running") and pid > 0 else None


class ContainerSupervisor(Supervisor):
    """cli.launch.supervise's run, with the signals going to the container once launch knows it."""

    def __init__(self, launch: ContainerLaunch, env: dict[str, str], proc_root: str, quiet: bool) -> None:
        super().__init__([], env, proc_root, quiet=quiet, use_scope=False)
        self.launch = launch
        self.interrupted = False

    def _forward(self, pid: int) -> None:
        launch = self.launch
        if self._signals and launch.cid is None:
            self.interrupted = True  # the container, found later, is stopped at once
        while self._signals and launch.cid is not None:
            signum = self._signals.pop(0)
            done = sum(1 for s in self.sent if s in (signal.SIGTERM, signal.SIGKILL))
            if done >= 2:
                self.sent.append(signal.SIGKILL)
                self._kill_all(pid, signal.SIGKILL)
                self.note(f"sent SIGKILL to the docker client {pid}")
                continue
            self.sent.append(signal.SIGTERM if done == 0 else signal.SIGKILL)
            launch.stop_container("stop" if done == 0 else "kill", f"{signal.Signals(signum).name}")
        super()._forward(pid)


class ContainerLaunch(Launch):
    def __init__(
        self, settings: Settings, plan: Plan, ctx: PlanContext, box: Container, *, quiet: bool = False,
        probe: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(settings, plan, ctx, [box.docker[0]], quiet=quiet, use_scope=False, probe=probe)
        self.box = box
        self.supervisor = self.signals = ContainerSupervisor(self, self.env, self.proc_root, quiet)
        if not probe:  # the engine's own port, dialled at its address in the container (telemetry.sources.listeners)
            self.endpoint = ep = endpoint_of(box.engine)
            self.probe_url = "" if ep is None else f"http://{f'[{ep.host}]' if ':' in ep.host else ep.host}:{ep.port}"
        self.finder = Finder(box, self.env)
        self.cid: str | None = None
        self.root: int | None = None
        self._root_ticks = 0
        self._settled = False
        self._lock = threading.Lock()
        self._status: int | None = None  # the engine's end as a wait status (`_ended`), which `_finish` reports
        self._ended_at: float | None = None

    def _environment(self) -> dict[str, str]:
        """Ours go in the container (`-e`, or launch's compose file), never over what the image or command set."""
        choices = launchenv.engine_env(self.box.env, self.plan.estimate.jobs)
        if not self.quiet:
            print(launchenv.describe(choices, container=True), file=sys.stderr, flush=True)
        self.cmd = self.supervisor.cmd = self.box.argv([(c.name, c.value) for c in choices if not c.kept])
        if self.box.detach:
            self.supervisor.stdout_fd = 2  # stdout says the container's id, as `docker run -d` does
        return dict(self.env)

    def run(self) -> int:
        try:
            return super().run()
        finally:
            self.finder.stop()
            self.box.cleanup()

    # --- the hooks
    def started(self, pid: int) -> None:
        self._started_wall = time.time()
        self.finder.start()
        self.note(f"started {self.box.what} as pid {pid}: the engine is declared once its container runs")
        if self.box.restart not in ("", "no"):
            then = "once it is ready (-d)" if self.box.detach else "never: launch ends with it (-d keeps a policy)"
            self.note(
                f"restart policy {self.box.restart}: held back while launch watches, given to the container {then}"
            )

    def tick(self, pid: int) -> float:
        if self.root is None:
            if self.finder.found is None:
                return FIND_EVERY_S
            self._adopt(*self.finder.found)
        assert self.root is not None
        if self._ended_at is None and read_start_ticks(self.proc_root, self.root) != self._root_ticks:
            self._ended(None)  # its top process is gone: it ended, or the guard killed it (the client may stay)
        every = super().tick(self.root)
        if self.box.detach and not self.detached and self._ready():
            self._detach(pid)
        return every

    def _adopt(self, cid: str, root: int) -> None:
        """The container runs: its top process declared as the engine's root (its own uid, launch's token)."""
        self.cid, self.root = cid, root
        self._started_wall = time.time()  # the engine's start is its container's (a pull before it is no boot)
        self._root_ticks = read_start_ticks(self.proc_root, root) or 0
        self._cgroup = read_cgroup(self.proc_root, root)
        try:
            uid = os.stat(f"{self.proc_root}/{root}").st_uid
        except OSError:
            uid = os.geteuid()
        self._declare(root, f" in container {cid[:12]}", uid=uid, container=cid, launch_id=self.box.token)
        self._watch_boot(root, (list(self.box.engine), self.box.env))
        if self.signals.interrupted:
            self.stop_container("stop", "an interrupt before it ran")

    def _tree_pids(self, pid: int) -> list[int]:
        return read_descendants(self.proc_root, [pid])

    def _ready(self) -> bool:
        d = self.decl
        if d is None:
            return False
        no_phases = self.plan.estimate.kind == EngineKind.OTHER
        return no_phases or d.first_token_s is not None or (d.phase == BootPhase.READY and not d.probe_url)

    def _detach(self, client: int) -> None:
        self.detached = True
        assert self.cid is not None
        policy = self.box.restart
        if policy not in ("", "no"):  # held back while launch watched: a guard kill during the boot was final
            code, _out, err = docker_out([*self.box.docker, "update", f"--restart={policy}", self.cid], self.env)
            self.note(f"its restart policy {policy}: " + ("given back" if code == 0 else f"not set: {err.strip()}"))
        self.note(f"detached: container {self.cid[:12]} runs on, declared to the guard")
        try:
            os.killpg(client, signal.SIGKILL)  # the client only: the container is the daemon's
        except OSError:
            pass

    # --- the container
    def stop_container(self, how: str, why: str) -> None:
        """`docker stop` (or `kill`) of the container by its id, on a thread: the output keeps coming meanwhile."""
        cid = self.cid
        if cid is None:
            return
        self.note(f"{why}: docker {how} {cid[:12]}")

        daemon_thread(lambda: docker_out([*self.box.docker, how, cid], self.env), f"sparkwatch-docker-{how}").start()

    def _settle(self) -> None:
        """The client or the engine ended: a container still running (its client gone) is stopped, nothing launch
        started runs on unwatched (with no restart policy while launch watches, an ended engine stays ended)."""
        with self._lock:
            if self._settled or self.cid is None:
                return
            self._settled = True
        if read_start_ticks(self.proc_root, self.root or 0) == self._root_ticks:
            docker_out([*self.box.docker, "stop", "-t", str(STOP_GRACE_S), self.cid], self.env)

    def exited(self, status: int | None) -> None:
        """The client ended."""
        if self.detached:
            if self.first_token is not None:
                self.first_token.stop()
        elif self.root is None:
            self._status = status  # no container ran: the client's own end (docker's error, 125…)
            super().exited(status)
        elif self._ended_at is None:
            self._ended(status)
        elif self._status is None:
            self._status = _engine_status(None, status, compose=self.box.compose is not None)

    def _ended(self, client: int | None) -> None:
        """The container's engine ended: settled (no restart), its exit code (`docker wait`, else the client's),
        declared at once (the guard's engine_exited carries it)."""
        self._ended_at = time.monotonic()
        self._settle()
        self.finder.waited.wait(EXIT_CODE_WAIT_S)
        self._status = _engine_status(self.finder.exit_code, client, compose=self.box.compose is not None)
        super().exited(self._status)

    def _finish(self, pid: int, status: int | None, peak: int) -> int:
        if self.detached:
            assert self.cid is not None
            os.write(1, f"{self.cid}\n".encode())
            if self.decl is not None and self.decl.ready_s is not None and peak > 0:
                self._learn(peak)
            self.exit_text = f"container {self.cid[:12]}, declared to the guard"
            return 0
        return super()._finish(self.root or pid, self._status, peak)


def _engine_status(code: int | None, client: int | None, *, compose: bool) -> int | None:
    """The engine's end as a wait status: the container's exit code (`docker wait`; `docker run`'s own exit code is
    the same), 128+N read as signal N as docker writes it. compose up's code says nothing of the container."""
    if code is None and client is not None and os.WIFEXITED(client) and not compose:
        code = os.WEXITSTATUS(client)
    if code is None:
        return None if compose else client
    return code - 128 if 128 < code <= 128 + 64 else code << 8
