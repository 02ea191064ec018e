"""Running the engine for `sparkwatch launch`: its declaration, boot phases, footprint, the guard's word, its end.

- the engine runs under cli.launch.supervise (fork/exec in its own process group and scope, signal forwarding,
  reaping, the pass-through); this module is its hooks. launch is a child subreaper (prctl, set here before the
  start: NVML's check is a child of ours and must be reaped first).
- the phase recogniser (core.launch.bootphase) searches each chunk of output the supervisor copied for the anchors that
  can still come.
- the declaration (common.launched) is written at start, on every phase, when the measured peak grew, and at exit.
- the measured peak is what the tree itself holds (cli.launch.treesample): its RSS (the root's descendants and
  whatever was reparented to launch: a worker that double-forked with setsid), its scope's memory.current, and NVML's
  per-process bytes. The pool's drop is never a peak: everything else on the box is in it.
- ready comes with the first token (cli.launch.firsttoken), else the log line.
- one line says where the declaration went; then the guard's word on it (cli.launch.guardword).
- the exit code passes through (128+N for signal N). A SIGKILL that launch did not send is looked up in the guard's
  published state (cli.launch.guardword): the guard's word is printed in one line, and launch exits 137. The guard
  writes no line of its own on the terminal of an engine whose launch tells it (guard.launchwatch.told_by_launch),
  so the owner reads one.
- the tree is read from /proc by common.sources.procs (children lists, stat, cgroup): no parser of its own here.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sparkwatch.cli.launch import treesample
from sparkwatch.cli.launch.anchorsearch import any_anchor
from sparkwatch.cli.launch.firsttoken import FirstToken
from sparkwatch.cli.launch.gather import PlanContext
from sparkwatch.cli.launch.guardword import AWAIT_POLL_S, GuardWord
from sparkwatch.cli.launch.ranks import RankWatch
from sparkwatch.cli.launch.supervise import Supervisor
from sparkwatch.common import launched, peakstore, syscalls
from sparkwatch.common.launched import Declaration
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.common.sources.procs import (
    read_cgroup,
    read_children,
    read_descendants,
    read_start_ticks,
)
from sparkwatch.core.engines.serving import api_key_of, endpoint_of, endpoint_of_url
from sparkwatch.core.launch import launchenv
from sparkwatch.core.launch.bootphase import BootPhase, PhaseRecognizer
from sparkwatch.core.launch.plan import Plan
from sparkwatch.core.report.guardstate import KillWord
from sparkwatch.core.units import MiB, format_size

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings

# After its ready line, an engine that owns no listening socket on its port within this long is ready by that line.
READY_LISTEN_GRACE_S = 1.0
SAMPLE_EVERY_S = 1.0  # footprint samples while the engine runs (a /proc walk of the tree and, with NVML, one read)
PEAK_WRITE_MIN_BYTES = 256 * MiB  # rewrite the declaration when the peak grew by this much (or 5 %)


class Launch:
    """The hooks of one run under the supervisor (cli.launch.supervise.Hooks), and what launch says around it."""

    def __init__(
        self,
        settings: Settings,
        plan: Plan,
        ctx: PlanContext,
        cmd: list[str],
        *,
        quiet: bool = False,
        use_scope: bool = True,
        env: dict[str, str] | None = None,
        probe: str | None = None,
        ray: bool = False,
        worker_budget_bytes: int | None = None,
    ) -> None:
        """`ray`: the engine runs its ranks on the raylets of a running Ray (checked by launch first): the
        environment launch sets reaches the driver only, and the line says so."""
        self.settings = settings
        self.ray = ray
        self.worker_budget_bytes = worker_budget_bytes  # its Ray ranks' on the other nodes (cli.launch)
        self.plan = plan
        self.ctx = ctx
        self.cmd = cmd
        self.quiet = quiet
        self.use_scope = use_scope
        self.env = dict(os.environ if env is None else env)
        self.proc_root = str(settings.proc_root)
        self.exit_text = ""
        self.detached = False  # the engine runs on after launch (a container launched with -d, once ready)
        self.supervisor = Supervisor(cmd, self.env, self.proc_root, quiet=quiet, use_scope=use_scope)
        self.recognizer = PhaseRecognizer(str(plan.estimate.kind), any_of=any_anchor)
        self.phase_peaks: dict[str, int] = {}
        self.decl: Declaration | None = None
        self.directory = launched.launched_dir(self.env, settings.state_dir)
        self.killed_by: KillWord | None = None
        self.unit = self.supervisor.unit
        self.gpu: Any | None = None
        self.guard = GuardWord(self.env, settings.state_dir, plan.budget_bytes, self.note)
        self._baseline = 0  # MemAvailable just before the start (the pool-drop baseline)
        self._started_wall = 0.0
        self._scoped = False
        self._cgroup: str | None = None
        self.peak = 0
        self._written_peak = 0
        # The engine's endpoint (--probe, else its command line): ready comes with the first token it answers.
        endpoint = endpoint_of_url(probe) if probe else endpoint_of(cmd)
        self.endpoint = endpoint
        self.probe_url = probe or ""
        if endpoint is not None and not probe:
            host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
            self.probe_url = f"http://{host}:{endpoint.port}"
        self.first_token: FirstToken | None = None
        self.ranks: RankWatch | None = None  # an engine over Ray: its ranks' states while it boots
        self._ranks_said: str | None = None

    # --- output
    def note(self, text: str) -> None:
        """A sparkwatch line on stderr, only at the start of a line (never inside the engine's own)."""
        self.supervisor.note(text)

    def output(self, data: bytes, stream: int) -> None:
        for phase in self.recognizer.feed(data, stream):
            self._enter(phase)

    # --- declaration
    def _write_decl(self) -> None:
        if self.decl is None:
            return
        try:
            launched.write(self.directory, self.decl)
        except OSError as exc:
            self.note(f"could not write the declaration in {self.directory}: {exc.strerror or exc}")

    def _enter(self, phase: BootPhase) -> None:
        if self.decl is None:
            return
        now = time.time()
        self.decl = self.decl.entered(phase, now)
        self._write_decl()
        if phase == BootPhase.READY:
            self.note(f"{self.decl.kind} is ready after {self.decl.ready_s or 0:.0f} s (phase ready)")
        else:
            self.note(f"phase {phase} after {now - self.decl.launched_at:.0f} s")

    def _declared_to_guard(self) -> None:
        """One line saying where the declaration went; then the guard's word on it (cli.launch.guardword)."""
        if self.decl is None:
            return
        path = self.directory / self.decl.file_name
        if not path.exists():
            return  # _write_decl said why
        self.note(f"declared in {path}")
        self.guard.declared(self.decl.tree_key)

    # --- the run
    def _environment(self) -> dict[str, str]:
        """The command's environment: ours (core.launch.launchenv) over the user's, and the line that says what."""
        choices = launchenv.engine_env(self.env, self.plan.estimate.jobs)
        if not self.quiet:
            print(launchenv.describe(choices, ray=self.ray), file=sys.stderr, flush=True)
        return launchenv.apply(self.env, choices)

    def run(self) -> int:
        plan = self.plan
        env = self._environment()
        self.gpu = treesample.gpu_reader(
            self.settings
        )  # before the subreaper: its check is a child of ours, reaped by it
        syscalls.set_child_subreaper()
        try:  # the pool-drop baseline the guard's budget warning reads (never a kill's nor a peak's)
            with MeminfoReader(self.settings.proc_root) as reader:
                baseline = reader.read().available_bytes
        except (OSError, MeminfoError):
            baseline = plan.view.available_bytes
        try:
            launched.prune(self.directory, time.time())
        except OSError:
            pass
        self._baseline = baseline
        sup = self.supervisor
        try:
            pid, status = sup.run(sup.argv(plan.budget_bytes), env, self)
        except OSError as exc:
            print(f"sparkwatch: {self.cmd[0]}: {exc.strerror or exc}", file=sys.stderr)
            self.exit_text = "did not start"
            return 127 if isinstance(exc, FileNotFoundError) else 126
        finally:
            close = getattr(self.gpu, "close", None)
            if close is not None:
                close()
        return self._finish(pid, status, self.peak)

    # --- the supervisor's hooks (cli.launch.supervise.Hooks)
    def started(self, pid: int) -> None:
        """The declaration, written at once; the line saying where it went."""
        self._started_wall = time.time()
        # The scope's cgroup, once systemd-run has moved the command into it (read again at each sample until then:
        # before the move the child is still in our own cgroup, whose memory.current is not the engine's).
        self._scoped = self.supervisor.scoped
        self._cgroup = None
        self._declare(pid)
        self._watch_boot(pid)

    def _declare(self, pid: int, where: str = "", **extra: Any) -> None:
        """The declaration of the root `pid` (`extra`: more of its fields), written; the lines saying so."""
        started_wall = self._started_wall
        ticks = read_start_ticks(self.proc_root, pid) or 0
        baseline = self._baseline
        est = self.plan.estimate
        self.decl = Declaration(
            root_pid=pid,
            start_ticks=ticks,
            uid=os.geteuid(),
            kind=str(est.kind),
            model=est.model or "",
            key=self.ctx.key,
            budget_bytes=self.plan.budget_bytes,
            launched_at=started_wall,
            launcher_pid=os.getpid(),
            available_at_launch_bytes=baseline,
            estimate_bytes=est.needs_bytes,
            cgroup=self._cgroup,
            probe_url=self.probe_url,
            worker_budget_bytes=self.worker_budget_bytes,
        )
        self.decl = replace(self.decl, **extra).entered(BootPhase.STARTING, started_wall)
        if self.recognizer.phase != BootPhase.STARTING:  # what its output said before it was declared
            self.decl = self.decl.entered(self.recognizer.phase, time.time())
        self._write_decl()
        self.note(
            f"started {est.kind}{where} as pid {pid}"
            + (f", budget {format_size(self.plan.budget_bytes)}" if self.plan.budget_bytes else "")
            + (
                f", its ranks on the other nodes {format_size(self.worker_budget_bytes)} each (their guards, told by "
                "their agents)"
                if self.worker_budget_bytes
                else ""
            )
        )
        self._declared_to_guard()

    def _watch_boot(self, pid: int, engine: tuple[list[str], dict[str, str]] | None = None) -> None:
        """The first-token probe (`engine`: the argv and environment that name its key, where they are not launch's
        own) and, for an engine over Ray, its ranks."""
        if self.endpoint is not None:
            key = None
            if self.endpoint.server != "url":
                argv, env = engine or (self.cmd, self.env)
                key = api_key_of(argv, env, self.endpoint.server)
            self.first_token = FirstToken(self.proc_root, pid, self.endpoint, key)
            self.first_token.start()
        if self.ray:
            self.ranks = RankWatch(str(self.settings.ray_dashboard_url), self.proc_root, pid)
            self.ranks.start()

    def _ranks_word(self) -> None:
        """Where the engine's ranks stand in Ray, said when it changed (core.launch.rankboot); no more reads of Ray
        once the engine is ready (the group watch, in telemetry, follows the group from there)."""
        if self.ranks is not None and self.recognizer.phase == BootPhase.READY:
            self.ranks.stop()
        view = self.ranks.latest if self.ranks is not None else None
        line = None if view is None else view.line()
        if line is not None and line != self._ranks_said:
            self._ranks_said = line
            self.note(line)

    def _first_token_word(self) -> None:
        """The first good one-token completion: declared (the guard's engine_ready comes with it) and said once.
        An engine whose processes own no listening socket on its port READY_LISTEN_GRACE_S after its ready line
        serves somewhere launch does not know (or not at all): ready is its log line then, and the declaration
        says so (probe_url cleared); `--probe URL` names the endpoint."""
        ft = self.first_token
        if ft is None or self.decl is None or self.decl.first_token_s is not None or not self.decl.probe_url:
            return
        if ft.answered_at is None:
            ready_at = next((at for p, at in self.decl.phases if p == BootPhase.READY), None)
            silent = ready_at is not None and not ft.listening_seen and time.time() - ready_at >= READY_LISTEN_GRACE_S
            if silent or ft.unreachable:  # (unreachable: a container's socket the host cannot dial, said why)
                ft.stop()
                self.decl = replace(self.decl, probe_url="")
                self._write_decl()
                why = ft.unreachable or f"no socket of the engine listens on port {ft.endpoint.port}"
                self.note(f"{why}: ready by its log line" + ("" if ft.unreachable else " (--probe URL)"))
            return
        took = max(ft.answered_at - self.decl.launched_at, 0.0)
        self.decl = replace(self.decl, first_token_s=took)
        self._write_decl()
        latency = f" ({ft.latency_s * 1000:.0f} ms for the token)" if ft.latency_s is not None else ""
        self.note(f"{self.decl.kind} answered its first token after {took:.1f} s{latency}: time to first token")

    def tick(self, pid: int) -> float:
        """The guard's word while awaited, and a footprint sample (the declaration rewritten when the peak grew)."""
        every = AWAIT_POLL_S if self.guard.awaited else SAMPLE_EVERY_S
        if self.decl is not None:
            self.guard.poll(self.decl.tree_key)
        self._first_token_word()
        self._ranks_word()
        if self._scoped and self._cgroup is None:
            self._cgroup = self._scope_cgroup(pid)
        fp = self._sample(pid, self._cgroup)
        phase = str(self.recognizer.phase)
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), fp)
        if fp > self.peak:
            self.peak = fp
            if self.decl is not None and self.peak - self._written_peak >= max(
                PEAK_WRITE_MIN_BYTES, self._written_peak // 20
            ):
                self.decl = _with_peak(self.decl, self.peak)
                self._written_peak = self.peak
                self._write_decl()
        return every

    def exited(self, status: int | None) -> None:
        if self.first_token is not None:
            self.first_token.stop()
        if self.ranks is not None:
            self.ranks.stop()
        self._declare_exit(status, self.peak)  # at once: the guard's engine_exited carries the exit code

    def _declare_exit(self, status: int | None, peak: int) -> None:
        sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else None
        code = os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else None
        self.recognizer.exited()
        if self.decl is None:
            return
        now = time.time()
        decl = _with_peak(self.decl, max(peak, self.decl.peak_bytes or 0)).entered(BootPhase.EXITED, now)
        self.decl = replace(decl, exit_code=code, exit_signal=sig, exited_at=now)
        self._write_decl()

    def _scope_cgroup(self, pid: int) -> str | None:
        """The root's cgroup when it is our own scope (`…/sparkwatch-launch-<pid>.scope`), declared for the guard."""
        path = read_cgroup(self.proc_root, pid)
        if path is None or not path.endswith(f"/{self.unit}.scope"):
            return None
        if self.decl is not None:
            self.decl = replace(self.decl, cgroup=path)
            self._write_decl()
        return path

    def _tree_pids(self, pid: int) -> list[int]:
        """The root's descendants and what was reparented to launch (the subreaper)."""
        orphans = [p for p in read_children(self.proc_root, os.getpid()) or [] if p != pid]
        return read_descendants(self.proc_root, [pid, *orphans])

    def _sample(self, pid: int, cgroup: str | None) -> int:
        """What the tree holds now (core.kill.footprint, without the pool's drop): its processes' RSS
        (`_tree_pids`) or the scope's memory.current, and NVML's bytes for them."""
        return treesample.sample(self.proc_root, self._tree_pids(pid), self.gpu, cgroup)

    def _finish(self, pid: int, status: int | None, peak: int) -> int:
        code, sig = 0, None
        if status is not None:
            if os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
                code = 128 + sig
            else:
                code = os.WEXITSTATUS(status)
        self.exit_text = f"exit code {code}" if sig is None else f"killed by {signal.Signals(sig).name}"
        if self.decl is not None and self.decl.ready_s is not None and peak > 0:
            self._learn(peak)
        if sig == signal.SIGKILL and signal.SIGKILL not in self.supervisor.sent:
            word = self.guard.kill_word(self.decl.tree_key) if self.decl is not None else None
            self.killed_by = word
            if word is not None:
                print(
                    f"sparkwatch: the guard killed {self.plan.estimate.kind} (pid {pid}), trigger "
                    f"{word.trigger}: {word.summary}",
                    file=sys.stderr,
                )
                self.exit_text = f"killed by the sparkwatch guard ({word.trigger})"
            else:
                print(
                    f"sparkwatch: {self.plan.estimate.kind} (pid {pid}) was killed with SIGKILL; no sparkwatch kill "
                    "event names it (the kernel's OOM killer or another program?)",
                    file=sys.stderr,
                )
            return 128 + signal.SIGKILL
        return code

    def _learn(self, peak: int) -> None:
        assert self.decl is not None
        try:
            peakstore.learn(self.settings.state_dir, self.ctx.key, peak, phases=self.phase_peaks,
                            ready_s=self.decl.ready_s, estimate_bytes=self.plan.estimate.needs_bytes)  # fmt: skip
        except OSError as exc:
            self.note(f"could not record the measured peak: {exc.strerror or exc}")


def _with_peak(decl: Declaration, peak: int) -> Declaration:
    return replace(decl, peak_bytes=peak)
