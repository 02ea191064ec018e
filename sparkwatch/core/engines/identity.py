"""Which processes are LLM engines, which are protected, and the trees the guard would kill.

An engine is recognised by what the process *is*: its process title, comm, the executable named by argv[0], or the
entry point a Python interpreter runs (`-m module` or the script) with its subcommand. Never by a substring of the
whole command line: `tail -f vllm.log`, `vim serve_vllm.sh`, `grep vllm`, `pip install vllm`, `bash -c "vllm serve …"`
and `vllm bench serve` are not engines.

Every shape an engine really runs is one row of SHAPES, with the upstream file that produces it; docs/engines.md is
the same table for people. A row with `victim=False` is infrastructure (Ray's raylet, GCS, agents, IO workers): never
a victim, not even inside an engine's tree, while the engine workers beneath it are.

Protection is judged by what a user cannot forge (see `is_protected`): the executable the kernel runs
(/proc/PID/exe) in a root-owned system directory, and the systemd system unit (/proc/PID/cgroup). A process that
merely calls itself `sshd` or `tmux: server` is judged like any other; a worker of an engine dies with its engine
whatever it calls itself.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from sparkwatch.core.livecache import LiveCache
from sparkwatch.core.model import EngineTree, GpuHolder, Proc
from sparkwatch.core.userregex import bounded, compile_user_regex


@dataclass(frozen=True, slots=True)
class Shape:
    """One real process shape: `regex` is matched at the start of each identity string (see identity_strings)."""

    kind: str  # the engine ("vllm"), or the product whose infrastructure this is ("ray")
    regex: str
    source: str  # the upstream file that produces this shape
    example: str  # what the process looks like (title or argv), for docs and the table test
    victim: bool = True  # False: infrastructure, never killed
    adopts_parent: bool = False  # a plain Python parent of this process is the engine's owner (offline LLM())
    needs_library: bool = False  # generic launcher: an engine only with an engine library mapped (ENGINE_LIBRARIES)


# Order matters: the first matching row wins, so infrastructure and exclusions come before the broad `ray::` row.
SHAPES: tuple[Shape, ...] = (
    # --- Ray's own processes: never victims (the raylet fate-shares with its agents: killing one takes the node).
    Shape("ray", r"raylet$", "python/ray/_private/services.py (start_raylet)", "…/ray/raylet/raylet", False),
    Shape("ray", r"gcs_server$", "python/ray/_private/services.py (start_gcs_server)", "…/ray/gcs/gcs_server", False),
    Shape(
        "ray",
        r"ray::(DashboardAgent|RuntimeEnvAgent|SandboxEnvAgent)$",
        "python/ray/dashboard/agent.py, python/ray/_private/runtime_env/agent/main.py (setproctitle)",
        "ray::DashboardAgent",
        False,
    ),
    Shape(
        "ray",
        r"ray::(IDLE_)?(Spill|Restore|IO)Worker",
        "python/ray/_private/ray_constants.py (WORKER_PROCESS_TYPE_SPILL/RESTORE_WORKER*)",
        "ray::IDLE_SpillWorker",
        False,
    ),
    Shape(
        "ray",
        r"ray::(JobSupervisor|ServeController|ProxyActor|HTTPProxyActor)\b",
        "python/ray/dashboard/modules/job/job_supervisor.py, python/ray/serve/_private/controller.py, proxy.py",
        "ray::ServeController",
        False,
    ),
    Shape(
        "ray",
        r"ray-dashboard-",
        "python/ray/dashboard/subprocesses/module.py (dashboard head modules)",
        "ray-dashboard-JobHead-0",
        False,
    ),
    Shape(
        "ray",
        r".*/ray/(dashboard/dashboard|dashboard/agent|_private/log_monitor|autoscaler/_private/monitor"
        r"|_private/runtime_env/agent/main|util/client/server/server)\.py$",
        "python/ray/_private/services.py (start_dashboard, start_log_monitor, start_monitor, start_ray_client_server)",
        "python …/ray/_private/log_monitor.py",
        False,
    ),
    Shape(
        "ray",
        r"ray\.util\.client\.server$",
        "python/ray/_private/services.py (start_ray_client_server)",
        "python -m ray.util.client.server",
        False,
    ),
    # --- vLLM. Titles: f"{VLLM_PROCESS_NAME_PREFIX}::{name}_{suffix}" (default prefix VLLM).
    Shape(
        "vllm",
        r"[^\s:/]+::EngineCore(_|$|\s)",
        "vllm/v1/engine/core.py (set_process_title('EngineCore', DP suffix))",
        "MYPREFIX::EngineCore_DP0",
        adopts_parent=True,
    ),
    Shape("vllm", r"VLLM::", "vllm/utils/system_utils.py (set_process_title)", "VLLM::Worker_TP0_EP0"),
    Shape(
        "vllm",
        r"[^\s:/]+::(Worker|APIServer|DPCoordinator)(_|$|\s)",
        "vllm/v1/executor/multiproc_executor.py, vllm/entrypoints/cli/serve.py, vllm/v1/engine/coordinator.py",
        "MYPREFIX::Worker_TP1_PP0",
    ),
    Shape(
        "vllm",
        r"vllm (serve|run-batch)\b",
        "vllm/entrypoints/cli/main.py (serve, run-batch subcommands)",
        "/venv/bin/vllm serve m",
    ),
    Shape(
        "vllm",
        r"vllm\.entrypoints\.cli\.main (serve|run-batch)\b",
        "vllm/entrypoints/cli/main.py",
        "python -m vllm.entrypoints.cli.main serve m",
    ),
    Shape(
        "vllm",
        r"vllm\.entrypoints\.(openai\.api_server|api_server|openai\.run_batch)$",
        "vllm/entrypoints/openai/api_server.py, vllm/entrypoints/openai/run_batch.py",
        "python -m vllm.entrypoints.openai.api_server",
    ),
    # --- Ray workers and actors (vLLM's Ray executor: ray::RayWorkerWrapper). ray::IDLE is a candidate: a task
    # worker returns to IDLE with its CUDA context and torch's caching allocator still holding memory, and Ray
    # reuses it; an idle one that holds nothing is left alone by the kill policy (it does not grow).
    Shape(
        "ray",
        r"ray::",
        "python/ray/_private/worker.py (setproctitle ray::IDLE, ray::<Actor>.<method>)",
        "ray::RayWorkerWrapper.execute_method",
    ),
    Shape(
        "ray",
        r"default_worker\.py$",
        "python/ray/_private/workers/default_worker.py (before its first title)",
        "python …/ray/_private/workers/default_worker.py",
    ),
    # --- SGLang: LLM and diffusion.
    Shape(
        "sglang",
        r"sglang::scheduler",
        "python/sglang/srt/managers/scheduler.py (setproctitle)",
        "sglang::scheduler_TP0",
        adopts_parent=True,
    ),
    Shape(
        "sglang",
        r"sglang::",
        "python/sglang/srt/managers/*.py (setproctitle sglang::detokenizer, …)",
        "sglang::detokenizer",
    ),
    Shape(
        "sglang",
        r"sgl_diffusion::",
        "python/sglang/multimodal_gen/runtime/managers/gpu_worker.py (setproctitle)",
        "sgl_diffusion::scheduler_TP0",
        adopts_parent=True,
    ),
    Shape("sglang", r"sglang\.launch_server$", "python/sglang/launch_server.py", "python -m sglang.launch_server"),
    Shape("sglang", r"sglang (serve|generate)\b", "python/sglang/cli/main.py (serve, generate)", "sglang generate"),
    Shape(
        "sglang",
        r"sglang\.multimodal_gen\.runtime\.entrypoints\.cli\.main (serve|generate)\b",
        "python/sglang/multimodal_gen/runtime/entrypoints/cli/main.py",
        "python -m sglang.multimodal_gen.runtime.entrypoints.cli.main serve",
    ),
    # --- TensorRT-LLM.
    Shape(
        "trtllm",
        r"trtllm-serve( |$)",
        "tensorrt_llm/commands/serve.py (console script trtllm-serve)",
        "/usr/local/bin/trtllm-serve serve m",
    ),
    Shape(
        "trtllm",
        r"tensorrt_llm\.llmapi\.mgmn_(leader|worker)_node$",
        "tensorrt_llm/llmapi/trtllm-llmapi-launch (mpirun ranks: mgmn_leader_node, mgmn_worker_node)",
        "python3 -m tensorrt_llm.llmapi.mgmn_worker_node",
    ),
    Shape(
        "trtllm",
        r"tensorrt_llm\.commands\.serve$",
        "tensorrt_llm/commands/serve.py",
        "python -m tensorrt_llm.commands.serve",
    ),
    # Generic MPI workers (TensorRT-LLM's LLM API spawns `python -m mpi4py.futures.server` through MPIPoolExecutor):
    # an engine only inside an engine's tree or with an engine library mapped (ENGINE_LIBRARIES).
    Shape(
        "mpi",
        r"mpi4py\.futures(\.server)?$",
        "tensorrt_llm/llmapi/mpi_session.py (MpiPoolSession)",
        "python -m mpi4py.futures.server",
        needs_library=True,
    ),
    # --- llama.cpp and llama-cpp-python.
    Shape(
        "llama.cpp",
        r"llama-(server|cli)$",
        "tools/server/server.cpp, tools/main/main.cpp (binaries)",
        "./build/bin/llama-server -m x.gguf",
    ),
    Shape("llama.cpp", r"rpc-server$", "tools/rpc/rpc-server.cpp", "./build/bin/rpc-server -p 50052"),
    Shape(
        "llama.cpp",
        r"llama_cpp\.server$",
        "llama_cpp/server/__main__.py (llama-cpp-python)",
        "python -m llama_cpp.server --model x.gguf",
    ),
    # --- Ollama: every runner generation. `ollama serve` itself holds no model. llama-server under `ollama serve`
    # (Ollama >= 0.30) is renamed ollama by PARENT_RENAMES.
    Shape(
        "ollama",
        r"ollama runner\b",
        "runner/runner.go (ollama runner subcommand, >= 0.5)",
        "/usr/local/bin/ollama runner --model …",
    ),
    Shape(
        "ollama",
        r"ollama_llama_server$",
        "llm/server.go (runners/*/ollama_llama_server, < 0.5)",
        "/tmp/ollama123/runners/cuda_v12/ollama_llama_server",
    ),
)

# A child engine of this kind under a parent of this shape is named after the parent: Ollama >= 0.30 runs the
# upstream llama-server under `ollama serve` (llm/server.go), and the owner knows it as ollama.
PARENT_RENAMES: tuple[tuple[str, str, str], ...] = (("llama.cpp", r"ollama( serve)?$", "ollama"),)

# Generic MPI workers become engines when one of these is mapped (/proc/PID/maps, read by the scanner only for
# needs_library shapes and for the parents that adoption asks about, see wants_parent_maps): marker in the mapped
# path -> engine. The same markers are the evidence that a plain Python parent built the engine below it.
ENGINE_LIBRARIES: tuple[tuple[str, str], ...] = (
    ("libtensorrt_llm", "trtllm"),  # tensorrt_llm/libs/libtensorrt_llm.so
    ("vllm/_C", "vllm"),  # vllm/_C.abi3.so
    ("sgl_kernel", "sglang"),  # sgl_kernel/common_ops.*.so
    ("libllama", "llama.cpp"),  # llama_cpp/lib/libllama.so
)

# Parents that are never an engine's owner even with an engine directly below them: shells, supervisors,
# multiplexers, launchers (`sparkwatch launch` too: it is the engine's parent and its workers' subreaper). Only a
# plain Python process running a script or module, with the engine's own native module mapped, is adopted (see
# _adoptable_parent).
_SUPERVISOR_ENTRIES = re.compile(
    r"(supervisord|circusd|honcho|torchrun|torch\.distributed\.(run|launch)|accelerate|deepspeed|mpirun|mpiexec"
    r"|uv|pipx|poetry|conda|ray|jupyter.*|pytest-xdist|sparkwatch)$"
)

# Protected executables: basenames, honoured only when /proc/PID/exe lies in a root-owned system directory that an
# unprivileged user cannot write to. sshd, systemd, display servers, desktop shells, terminal multiplexers: the things
# a human needs to get back in after a kill.
PROTECTED_EXES = re.compile(
    r"(sshd|sshd-session|sshd-auth|systemd(-.*)?|init|login|agetty|dbus-(daemon|broker)|Xorg|Xwayland|X"
    r"|(gdm|sddm|lightdm)(-.*)?|gnome-(shell|session.*)|plasmashell|kwin_x11|kwin_wayland|ksmserver"
    r"|xfce4-session|xfwm4|cinnamon|mutter|tmux|screen|containerd|dockerd)$"
)
SYSTEM_DIRS = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/", "/snap/", "/nix/store/")
# systemd system units (cgroup v2 path under /system.slice/, which only root can create or move processes into).
PROTECTED_UNITS = re.compile(
    r"(ssh|sshd|sshd@.*|systemd-.*|dbus|dbus-broker|display-manager|gdm|sddm|lightdm|getty@.*|serial-getty@.*"
    r"|user-runtime-dir@.*|polkit|containerd|docker|sparkwatch)\.(service|socket)$"
)

# What a user may still name in `protect_patterns`: matched against comm, the entry point and the executable path.
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)*)?$")
_PYTHON_OPTS_WITH_ARG = frozenset({"-W", "-X", "--check-hash-based-pycs"})

PF_KTHREAD = 0x00200000


@dataclass(frozen=True, slots=True)
class EngineRules:
    """Compiled shapes, user patterns and the opt-ins."""

    shapes: tuple[tuple[Shape, re.Pattern[str]], ...]
    protect: tuple[re.Pattern[str], ...]  # the user's protect_patterns
    renames: tuple[tuple[str, re.Pattern[str], str], ...] = ()
    gpu_holders_are_engines: bool = False  # `guard_gpu_holders`: an unmatched NVML GPU holder is an engine ("gpu")
    # (comm, argv, engine_lib) -> shape index or -1. Identity is a pure function of these, and matching every
    # pattern against every process was half of a 2,000-process telemetry cycle (~25 ms); a dict hit is ~0.2 µs.
    # Forgets processes that are gone (core.livecache).
    kind_cache: LiveCache[tuple[str, tuple[str, ...], str | None], int] = field(
        default_factory=LiveCache, compare=False, hash=False, repr=False
    )

    @classmethod
    def build(
        cls,
        engine_patterns: Iterable[str] = (),
        protect_patterns: Iterable[str] = (),
        *,
        gpu_holders_are_engines: bool = False,
    ) -> EngineRules:
        # User engines come first: an owner's `kind=regex` names its own processes before any default.
        user = tuple(
            (Shape(kind, p.pattern, "engine_patterns (config)", p.pattern), p)
            for kind, p in compile_engine_patterns(engine_patterns)
        )
        return cls(
            shapes=user + tuple((s, re.compile(s.regex)) for s in SHAPES),
            protect=compile_protect_patterns(protect_patterns),
            renames=tuple((child, re.compile(parent), kind) for child, parent, kind in PARENT_RENAMES),
            gpu_holders_are_engines=gpu_holders_are_engines,
        )


def compile_engine_patterns(patterns: Iterable[str]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    """Parse user patterns written as 'kind=regex' (matched at the start of identity strings). Raises ValueError
    naming the bad pattern, also one whose cost has no bound (core.userregex)."""
    out = []
    for text in patterns:
        kind, sep, regex = text.partition("=")
        if not sep or not kind.strip() or not regex:
            raise ValueError(f"{text!r} should be written as kind=regex, for example 'myengine=my-server$'")
        out.append((kind.strip(), compile_user_regex(regex, searched=False, entry=text)))
    return tuple(out)


def compile_regexes(patterns: Iterable[str], *, searched: bool) -> tuple[re.Pattern[str], ...]:
    """Compile user regexes (protect_patterns: matched; never_kill: searched). Raises ValueError naming the bad
    pattern (core.userregex)."""
    return tuple(compile_user_regex(text, searched=searched) for text in patterns)


def compile_protect_patterns(patterns: Iterable[str]) -> tuple[re.Pattern[str], ...]:
    return compile_regexes(patterns, searched=False)  # is_protected matches them at the start


def _python_entry(argv: Sequence[str]) -> tuple[str, str, tuple[str, ...]]:
    """(entry, script path or module, rest) of a Python command line; ("", "", ()) for inline code."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1], argv[i + 1], tuple(argv[i + 2 :])
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:], arg[2:], tuple(argv[i + 1 :])
        if arg == "-c" or arg.startswith("-c"):
            return "", "", ()
        if arg in _PYTHON_OPTS_WITH_ARG:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg.rsplit("/", 1)[-1], arg, tuple(argv[i + 1 :])
    base = argv[0].rsplit("/", 1)[-1]
    return base, argv[0], ()


def entry_point(argv: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """What a command runs, and its remaining arguments.

    `/usr/bin/python3 -u -m vllm.entrypoints.openai.api_server --model m` -> ("vllm.entrypoints.openai.api_server", …)
    `/venv/bin/python3 /venv/bin/vllm serve m` -> ("vllm", ("serve", "m"))
    `./build/bin/llama-server -m x.gguf` -> ("llama-server", ("-m", "x.gguf"))
    `python3 -c "…"` -> ("", ()): inline code is a command line, not an identity.
    """
    if not argv or not argv[0]:
        return "", ()
    base = argv[0].rsplit("/", 1)[-1]
    if not _PYTHON_RE.match(base):
        return base, tuple(argv[1:])
    entry, _path, rest = _python_entry(argv)
    return entry, rest


def is_python(proc: Proc) -> bool:
    return bool(proc.argv) and bool(_PYTHON_RE.match(proc.argv[0].rsplit("/", 1)[-1]))


def identity_strings(proc: Proc) -> tuple[str, ...]:
    """What a process is recognised by: comm, its title (argv[0]), its entry point, `entry subcommand`, and the
    script's path as given (for Ray's own scripts, told apart from any user's `monitor.py` by their directory)."""
    out = [proc.comm]
    if proc.argv:
        out.append(proc.argv[0].strip())
        if is_python(proc):
            entry, path, rest = _python_entry(proc.argv)
            if path and path != entry:
                out.append(path)
        else:
            entry, rest = entry_point(proc.argv)
        if entry:
            out.append(entry)
            if rest and not rest[0].startswith("-"):
                out.append(f"{entry} {rest[0]}")  # "vllm serve", "ollama runner"
    return tuple(bounded(s) for s in out)  # what a pattern may see (core.userregex)


def forget_dead_kinds(rules: EngineRules, procs: Sequence[Proc]) -> None:
    """Drop cached kinds of processes no longer in `procs` (core.livecache's rule).

    Under churn every new argv is a new key (1,000 processes a minute in the soak bench): without this the cache
    grew by ~0.2 MiB a minute until its hard cap, the largest part of the daemon's RSS growth.
    """
    rules.kind_cache.forget_dead(lambda: {(p.comm, p.argv, p.engine_lib) for p in procs})


def classify(proc: Proc, rules: EngineRules) -> Shape | None:
    """The first shape this process matches, or None. Kernel threads match nothing."""
    if proc.is_kernel_thread:
        return None
    key = (proc.comm, proc.argv, proc.engine_lib)
    cache = rules.kind_cache
    index = cache.get(key)
    if index is None:
        index = -1
        ids = identity_strings(proc)
        for i, (_shape, pattern) in enumerate(rules.shapes):
            if any(pattern.match(s) for s in ids):
                index = i
                break
        cache.put(key, index)
    return None if index < 0 else rules.shapes[index][0]


def rules_for(
    engine_patterns: Iterable[str], protect_patterns: Iterable[str], guard_gpu_holders: bool = False
) -> EngineRules:
    """EngineRules from the three settings that shape them (engine_patterns, protect_patterns, guard_gpu_holders)."""
    return EngineRules.build(engine_patterns, protect_patterns, gpu_holders_are_engines=guard_gpu_holders)


def engine_kind(proc: Proc, rules: EngineRules) -> str | None:
    """The engine this process is by its own identity (not by its parents), or None."""
    shape = classify(proc, rules)
    if shape is None or not shape.victim:
        return None
    if shape.needs_library:
        return library_kind(proc)
    return shape.kind


def library_kind(proc: Proc) -> str | None:
    lib = proc.engine_lib
    if not lib:
        return None
    return next((kind for marker, kind in ENGINE_LIBRARIES if marker in lib), None)


def is_infrastructure(proc: Proc, rules: EngineRules) -> bool:
    """Ray's own processes (raylet, GCS, dashboard and agents, IO workers): never victims."""
    shape = classify(proc, rules)
    return shape is not None and not shape.victim


def wants_maps(comm: str, argv: tuple[str, ...]) -> bool:
    """Whether the scanner should look at this process's mapped libraries: only generic launchers (needs_library
    shapes), so /proc/PID/maps is read for a handful of processes, never for every one."""
    proc = Proc(pid=0, ppid=0, uid=0, comm=comm, state="S", start_ticks=0, rss_bytes=0, argv=argv)
    return any(s.needs_library and p.match(x) for s, p in _DEFAULT_COMPILED for x in identity_strings(proc))


_DEFAULT_COMPILED = tuple((s, re.compile(s.regex)) for s in SHAPES if s.needs_library)
_ADOPTING_COMPILED = tuple(re.compile(s.regex) for s in SHAPES if s.adopts_parent)
_ALL_COMPILED = tuple((s, re.compile(s.regex)) for s in SHAPES)


def _strip_deleted(path: str) -> str:
    return path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path  # after a package upgrade


def exe_protects(exe: str) -> bool:
    """Whether this executable path (/proc/PID/exe) names a protected system binary, in the initial namespaces.

    The scanner asks it to decide which processes need their namespaces read (common.sources.procs)."""
    exe = _strip_deleted(exe)
    return exe.startswith(SYSTEM_DIRS) and PROTECTED_EXES.match(exe.rsplit("/", 1)[-1]) is not None


def protected_by_system(proc: Proc) -> bool:
    """A system process by what a user cannot forge: its executable in a system directory, or its systemd unit.

    The executable counts only for a process in the initial user and mount namespaces: in its own (`unshare -Urm`,
    which any user may run) a bind mount makes /proc/PID/exe read /usr/bin/systemd-cat for a python3, and such an
    engine was never killed. There the process is judged by its identity like any other; its cgroup still counts
    (only root can put a process into a system unit)."""
    if proc.exe and not proc.outside_initial_ns and exe_protects(proc.exe):
        return True
    if proc.cgroup:
        if proc.cgroup == "/init.scope":
            return True  # PID 1's own cgroup
        parts = proc.cgroup.split("/")
        if len(parts) >= 3 and parts[1] == "system.slice" and PROTECTED_UNITS.match(parts[2]):
            return True
    return False


def is_protected(proc: Proc, rules: EngineRules) -> bool:
    """Protected: a system process (protected_by_system), or one the owner named in `protect_patterns`.

    The owner's patterns are matched against comm, the entry point and the executable path. A name can be taken by
    any process; a path pattern (`^/opt/tool/bin/`) cannot, and is the better choice.
    """
    if protected_by_system(proc):
        return True
    if not rules.protect:
        return False
    ids = (proc.comm, entry_point(proc.argv)[0], _strip_deleted(proc.exe) if proc.exe else "")
    return any(p.match(bounded(s)) for p in rules.protect for s in ids if s)


@dataclass(frozen=True, slots=True)
class Scope:
    """Who the guard may touch: not itself or its ancestors, not PID 1, not other users unless it runs as root."""

    self_pid: int
    own_uid: int
    ancestor_pid: int = 0  # 0: every engine; else only engines below (or at) this PID
    # The guard's own ancestors, where the caller has no full process table to find them (the killer's sweep).
    self_ancestors: frozenset[int] = frozenset()


def may_touch(proc: Proc, rules: EngineRules, scope: Scope, untouchable: Collection[int] = ()) -> bool:
    """The one "may touch" rule, for the scanner (find_engine_trees) and the killer's fork sweep alike.

    Never PID 1 or 2, kernel threads, the guard itself or its ancestors, other users' processes (unless the guard
    is root), protected processes, or infrastructure (Ray's raylet, GCS, agents).
    """
    return (
        not proc.is_kernel_thread
        and proc.pid not in (1, 2, scope.self_pid)
        and proc.pid not in scope.self_ancestors
        and proc.pid not in untouchable
        and (scope.own_uid == 0 or proc.uid == scope.own_uid)
        and not is_protected(proc, rules)
        and not is_infrastructure(proc, rules)
    )


def within_ancestor(ancestor_pid: int, pid: int, chain: Collection[int]) -> bool:
    """The scope's `ancestor_pid` rule: every process when it is 0, else that PID and what descends from it
    (`chain`: pid's ancestors). The scanner's trees and the launched engines the guard says it took both hold to it."""
    return not ancestor_pid or ancestor_pid == pid or ancestor_pid in chain


def _ancestors(pid: int, by_pid: Mapping[int, Proc]) -> list[int]:
    chain = []
    seen = {pid}
    cur = by_pid.get(pid)
    while cur is not None and cur.ppid not in seen and cur.ppid > 0:
        chain.append(cur.ppid)
        seen.add(cur.ppid)
        cur = by_pid.get(cur.ppid)
    return chain


def _plain_python_parent(parent: Proc, shape_of: Callable[[Proc], Shape | None]) -> bool:
    """A Python process running a script or module, with no identity of its own and not a launcher: the only kind
    of parent adoption ever considers (an offline `LLM()` or `sgl.Engine()` script)."""
    if parent.is_kernel_thread or parent.pid <= 2 or not is_python(parent):
        return False
    if shape_of(parent) is not None:
        return False  # already an engine or infrastructure by its own identity
    entry, _rest = entry_point(parent.argv)
    return bool(entry) and not _SUPERVISOR_ENTRIES.match(entry)


def _adoptable_parent(parent: Proc, child_kind: str, rules: EngineRules) -> bool:
    """The owner of an offline `LLM()` / `sgl.Engine()`: a plain Python parent *with the child engine's own native
    module mapped* (ENGINE_LIBRARIES: vLLM's `vllm/_C.abi3.so`, SGLang's `sgl_kernel`).

    A direct child titled `VLLM::EngineCore` is not evidence on its own: any process can set that title, and a
    `python -m pytest` whose tests start fake engines was adopted as a "vllm engine" of 536 processes. The library is:
    vLLM's front end imports `vllm._C` at module level through its platform (vllm/platforms/cuda.py, `import vllm._C`)
    before it starts the EngineCore, and SGLang's Engine imports its scheduler module, whose layers import sgl_kernel
    on CUDA (python/sglang/srt/layers/quantization/fp8_utils.py, `from sgl_kernel import fp8_scaled_mm`). Without it
    the EngineCore is the root of its own tree: the process that holds the model still dies."""
    return _plain_python_parent(parent, lambda p: classify(p, rules)) and library_kind(parent) == child_kind


def wants_parent_maps(comm: str, argv: tuple[str, ...]) -> bool:
    """Whether a process is shaped like an engine that adopts its parent (EngineCore, SGLang's schedulers): the
    scanner then reads its parent's mapped libraries once, as adoption evidence (see parent_wants_maps).
    A substring test first: this runs for every process the scanner reads afresh."""
    if not argv or "::" not in argv[0]:
        return False
    proc = Proc(pid=0, ppid=0, uid=0, comm=comm, state="S", start_ticks=0, rss_bytes=0, argv=argv)
    return any(p.match(x) for p in _ADOPTING_COMPILED for x in identity_strings(proc))


def parent_wants_maps(parent: Proc) -> bool:
    """Whether the parent of a wants_parent_maps process is one adoption could accept, so its maps are worth a read:
    a plain Python process with no shape of its own (default shapes)."""
    return parent.engine_lib is None and _plain_python_parent(parent, _default_shape)


def _default_shape(proc: Proc) -> Shape | None:
    ids = identity_strings(proc)
    return next((s for s, p in _ALL_COMPILED if any(p.match(x) for x in ids)), None)


# Engines known by declaration (`sparkwatch launch`, common.launched): (pid, start_ticks) -> (kind, declaring uid).
Declared = Mapping[tuple[int, int], tuple[str, int]]
# The launcher of each declared root: (pid, start_ticks) of the root -> the pid of the `sparkwatch launch` that started
# it (the declaration's launcher_pid).
Launchers = Mapping[tuple[int, int], int]
# The scope `sparkwatch launch` runs a command in: `…/sparkwatch-launch-<launcher pid>.scope` (cli.launch.runner).
LAUNCH_SCOPE_RE = re.compile(r"/sparkwatch-launch-\d+\.scope$")


def adopt_launch_orphans(procs: Sequence[Proc], declared: Declared, launchers: Launchers) -> list[Proc]:
    """`procs` with what a declared root's launch holds besides the root handed to the root as its children.

    A child that double-forks (`setsid`, a daemonising worker) leaves its root's tree: its parent exits, and the
    kernel hands the grandchild to the nearest child subreaper, which `sparkwatch launch` makes itself (prctl), or
    to PID 1. Such a process is the engine's all the same, so its memory counts in the budget and it dies with the
    tree. Two facts the user cannot forge name it, each only for a root trusted as declared (same pid, start time
    and uid, as engine_kinds checks):
    - the launcher: the root's parent is the declared launcher pid, owned by the same uid; its other children are
      orphans reparented to it (launch starts nothing else while the engine runs);
    - the scope: the root is in `…/sparkwatch-launch-N.scope` (the kernel's cgroup, read by the scanner); a process
      in the same cgroup whose parent is not is an orphan that left (systemd moves only the command into it).
    Only the declaring uid's processes are adopted (a root guard never takes another user's, or root's, process into
    a tree on a user's word), and the launcher itself never is: it reports the kill. Everything else (may_touch,
    protection) applies as to any member."""
    if not declared:
        return list(procs)
    by_pid = {p.pid: p for p in procs}
    roots: list[tuple[Proc, int, int]] = []  # (root, declaring uid, its launcher's pid or 0)
    for key, (_kind, uid) in declared.items():
        root = by_pid.get(key[0])
        if root is None or root.key != key or root.uid != uid or root.is_kernel_thread:
            continue
        launcher = by_pid.get(root.ppid)
        said = launchers.get(key, 0)
        roots.append((root, uid, said if said > 1 and launcher is not None and launcher.pid == said else 0))
    launcher_of = {launcher: root for root, uid, launcher in roots if launcher and by_pid[launcher].uid == uid}
    scope_of = {root.cgroup: root for root, _uid, _l in roots if root.cgroup and LAUNCH_SCOPE_RE.search(root.cgroup)}
    if not launcher_of and not scope_of:
        return list(procs)
    new_parent: dict[int, int] = {}
    for p in procs:  # one pass, whatever the number of declared roots
        root = launcher_of.get(p.ppid)
        if root is not None and p.pid != root.pid and p.uid == root.uid:
            new_parent[p.pid] = root.pid  # reparented to the subreaper: the root's
            continue
        root = scope_of.get(p.cgroup) if p.cgroup else None
        if root is None or p.pid == root.pid or p.pid == root.ppid or p.uid != root.uid:
            continue
        parent = by_pid.get(p.ppid)
        if parent is None or parent.cgroup != p.cgroup:
            new_parent[p.pid] = root.pid  # in the root's scope, its parent outside it: left the tree
    if not new_parent:
        return list(procs)
    return [replace(p, ppid=new_parent[p.pid]) if p.pid in new_parent else p for p in procs]


def engine_kinds(
    procs: Sequence[Proc],
    rules: EngineRules,
    gpu_holders: Collection[tuple[int, int]] = (),
    declared: Declared | None = None,
) -> dict[int, str]:
    """pid -> engine kind for every process that is an engine by identity or by its place among its relatives.

    - identity: a SHAPES row (needs_library rows only with an engine library mapped);
    - parent renames: llama-server under `ollama serve` is ollama;
    - adopted parents: the plain Python process whose direct child is an EngineCore/scheduler, and which has that
      engine's native module mapped, is the engine's owner (an offline `LLM()` script). Safe because
      multiprocessing always makes the creating process the parent, the library shows the parent really runs the
      engine (a test runner that starts fake engines does not), and shells, supervisors and launchers are never
      adopted: see _adoptable_parent;
    - with `gpu_holders_are_engines`, a process NVML lists as holding GPU memory ((pid, start_ticks) keys) that
      matches nothing ("gpu");
    - by declaration: the root `sparkwatch launch` started, with the kind it declared, only when the process (same
      pid and start time) belongs to the uid that declared it: a user's word never names another user's process.
    """
    by_pid = {p.pid: p for p in procs}
    kinds: dict[int, str] = {}
    for p in procs:
        shape = classify(p, rules)
        if shape is None or not shape.victim:
            continue
        kind = library_kind(p) if shape.needs_library else shape.kind
        if kind is None:
            continue
        parent = by_pid.get(p.ppid)
        if parent is not None:
            ids = identity_strings(parent)
            for child_kind, pattern, new_kind in rules.renames:
                if kind == child_kind and any(pattern.match(s) for s in ids):
                    kind = new_kind
            if shape.adopts_parent and parent.pid not in kinds and _adoptable_parent(parent, kind, rules):
                kinds[parent.pid] = kind
        kinds[p.pid] = kind
    if rules.gpu_holders_are_engines:
        for p in procs:
            if p.key in gpu_holders and p.pid not in kinds and classify(p, rules) is None:
                kinds[p.pid] = "gpu"
    if declared:
        for p in procs:
            said = declared.get(p.key)
            if said is not None and said[1] == p.uid and not p.is_kernel_thread:
                kinds[p.pid] = said[0]
    return kinds


def find_engine_trees(
    procs: Sequence[Proc],
    rules: EngineRules,
    scope: Scope,
    gpu_holders: Collection[tuple[int, int]] = (),
    declared: Declared | None = None,
    *,
    launchers: Launchers | None = None,
) -> list[EngineTree]:
    """Every engine tree the guard would kill now, outermost engine first, largest RSS first.

    Walks down from each outermost engine: a protected process keeps its whole subtree; infrastructure (a raylet
    that vLLM started inside its own tree) is passed through: not a member, while the workers below it are.
    A declared root's tree also holds what its launch's scope or its launcher holds besides it (adopt_launch_orphans).
    """
    if declared:
        procs = adopt_launch_orphans(procs, declared, launchers or {})
    by_pid = {p.pid: p for p in procs}
    children: dict[int, list[Proc]] = defaultdict(list)
    for p in procs:
        children[p.ppid].append(p)
    untouchable = {1, 2, scope.self_pid, *_ancestors(scope.self_pid, by_pid)}
    kinds = engine_kinds(procs, rules, gpu_holders, declared)
    forget_dead_kinds(rules, procs)
    # Only an engine we may touch can hold others in its tree: an EngineCore whose adopted parent is ourselves (or
    # another user's process) is a root of its own.
    rootable = {pid for pid in kinds if may_touch(by_pid[pid], rules, scope, untouchable)}
    trees = []
    for pid in rootable:
        kind = kinds[pid]
        chain = _ancestors(pid, by_pid)
        if any(a in rootable for a in chain):
            continue  # inside an outer engine's tree
        if not within_ancestor(scope.ancestor_pid, pid, chain):
            continue
        root = by_pid[pid]
        members = [root]
        queue = [root]
        seen = {root.pid}
        while queue:
            parent = queue.pop(0)
            for child in sorted(children.get(parent.pid, ()), key=lambda c: c.pid):
                if child.pid in seen:
                    continue
                seen.add(child.pid)
                if may_touch(child, rules, scope, untouchable):
                    members.append(child)
                    queue.append(child)
                elif is_infrastructure(child, rules) and not is_protected(child, rules):
                    queue.append(child)  # passed through: its engine workers are still members
                # else: protected, another user's, or ourselves: the whole subtree is left alone
        trees.append(EngineTree(kind=kind, root=root, members=tuple(members)))
    trees.sort(key=lambda t: (-t.rss_bytes, t.root.pid))
    return trees


def unknown_gpu_holders(
    procs: Sequence[Proc],
    trees: Sequence[EngineTree],
    gpu_used: Mapping[int, int | None],
    rules: EngineRules,
) -> tuple[GpuHolder, ...]:
    """GPU holders (pid -> used bytes, from NVML) that the guard would not kill: shown so an owner sees them."""
    in_trees = {pid for t in trees for pid in t.pids}
    by_pid = {p.pid: p for p in procs}
    out = []
    for pid in sorted(gpu_used):
        proc = by_pid.get(pid)
        if proc is None or pid in in_trees or proc.is_kernel_thread:
            continue
        if engine_kind(proc, rules) is not None or is_infrastructure(proc, rules):
            continue
        out.append(GpuHolder(proc, gpu_used[pid]))
    return tuple(out)
