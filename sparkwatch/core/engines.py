"""Which processes are LLM engines, which are protected, and the trees the guard would kill.

An engine is recognised by what the process *is*: its process title, comm, the executable named by argv[0], or the
entry point a Python interpreter runs (`-m module` or the script). Never by a substring of the whole command line:
`tail -f vllm.log`, `vim serve_vllm.sh`, `grep vllm` and `bash -c "vllm serve …"` are not engines.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from sparkwatch.model import EngineTree, Proc

# (kind, regex). Each regex is matched at the start of every identity string of a process (see identity_strings).
DEFAULT_ENGINE_PATTERNS: tuple[tuple[str, str], ...] = (
    # vLLM: setproctitle(f"{VLLM_PROCESS_NAME_PREFIX}::{name}"), e.g. VLLM::EngineCore, VLLM::Worker_TP0.
    ("vllm", r"VLLM::"),
    ("vllm", r"vllm serve\b"),
    ("vllm", r"vllm\.entrypoints(\.|$)"),
    # Ray workers and actors: ray::IDLE, ray::RayWorkerWrapper.execute_method. A raylet is killed only as a
    # descendant of an engine (vLLM starting its own local Ray), never on its own.
    ("ray", r"ray::"),
    ("llama.cpp", r"llama-(server|cli)$"),
    ("sglang", r"sglang::"),
    ("sglang", r"sglang\.launch_server$"),
    ("sglang", r"sglang serve\b"),
    ("trtllm", r"trtllm-serve$"),
    ("trtllm", r"trtllm-serve "),
    ("ollama", r"ollama runner\b"),
    ("ollama", r"ollama_llama_server$"),
)

# Matched at the start of comm and of the entry point. sshd, systemd, display servers and desktop shells,
# terminal multiplexers: the things a human needs to get back in after a kill.
DEFAULT_PROTECT_PATTERNS: tuple[str, ...] = (
    r"sshd?$",
    r"sshd-session$",
    r"systemd(-.*)?$",
    r"\(sd-pam\)$",
    r"(init|login|agetty)$",
    r"dbus-(daemon|broker)",
    r"(Xorg|Xwayland|X)$",
    r"(gdm|sddm|lightdm)(-.*)?$",
    r"gnome-(shell|session).*",
    r"(plasmashell|kwin_x11|kwin_wayland|ksmserver)$",
    r"(xfce4-session|xfwm4|cinnamon|mutter)$",
    r"tmux",
    r"(screen|SCREEN)$",
    r"sparkwatch$",
)

_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)*)?$")
_PYTHON_OPTS_WITH_ARG = frozenset({"-W", "-X", "--check-hash-based-pycs"})

PF_KTHREAD = 0x00200000


@dataclass(frozen=True, slots=True)
class EngineRules:
    """Compiled engine and protect patterns."""

    engines: tuple[tuple[str, re.Pattern[str]], ...]
    protect: tuple[re.Pattern[str], ...]
    # (comm, argv) -> kind. Identity is a pure function of these, and matching every pattern against every process
    # was half of a 2,000-process telemetry cycle (~25 ms); a dict hit is ~0.2 µs. Bounded: cleared when large.
    kind_cache: dict[tuple[str, tuple[str, ...]], str | None] = field(
        default_factory=dict, compare=False, hash=False, repr=False
    )

    @classmethod
    def build(cls, engine_patterns: Iterable[str] = (), protect_patterns: Iterable[str] = ()) -> EngineRules:
        return cls(
            engines=tuple((k, re.compile(r)) for k, r in DEFAULT_ENGINE_PATTERNS)
            + compile_engine_patterns(engine_patterns),
            protect=tuple(re.compile(r) for r in DEFAULT_PROTECT_PATTERNS) + compile_protect_patterns(protect_patterns),
        )


def compile_engine_patterns(patterns: Iterable[str]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    """Parse user patterns written as 'kind=regex'. Raises ValueError naming the bad pattern."""
    out = []
    for text in patterns:
        kind, sep, regex = text.partition("=")
        if not sep or not kind.strip() or not regex:
            raise ValueError(f"{text!r} should be written as kind=regex, for example 'myengine=my-server$'")
        try:
            out.append((kind.strip(), re.compile(regex)))
        except re.error as exc:
            raise ValueError(f"{text!r} is not a valid regex: {exc}") from None
    return tuple(out)


def compile_protect_patterns(patterns: Iterable[str]) -> tuple[re.Pattern[str], ...]:
    out = []
    for text in patterns:
        try:
            out.append(re.compile(text))
        except re.error as exc:
            raise ValueError(f"{text!r} is not a valid regex: {exc}") from None
    return tuple(out)


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
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "-m" and i + 1 < len(argv):
            return argv[i + 1], tuple(argv[i + 2 :])
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:], tuple(argv[i + 1 :])
        if arg == "-c" or arg.startswith("-c"):
            return "", ()
        if arg in _PYTHON_OPTS_WITH_ARG:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg.rsplit("/", 1)[-1], tuple(argv[i + 1 :])
    return base, ()


def identity_strings(proc: Proc) -> tuple[str, ...]:
    """The strings a process is recognised by: comm, its title (argv[0]), its entry point, entry + first argument."""
    out = [proc.comm]
    if proc.argv:
        out.append(proc.argv[0].strip())
        entry, rest = entry_point(proc.argv)
        if entry:
            out.append(entry)
            if rest and not rest[0].startswith("-"):
                out.append(f"{entry} {rest[0]}")  # "vllm serve", "ollama runner"
    return tuple(out)


_KIND_CACHE_MAX = 8192


def forget_dead_kinds(rules: EngineRules, procs: Sequence[Proc]) -> None:
    """Drop cached kinds of processes no longer in `procs` once the cache holds many more than that.

    Under churn every new argv is a new key (1,000 processes a minute in the soak bench): without this the cache
    grew by ~0.2 MiB a minute until _KIND_CACHE_MAX, the largest part of the daemon's RSS growth.
    """
    cache = rules.kind_cache
    if len(cache) > 2 * len(procs) + 256:
        live = {(p.comm, p.argv) for p in procs}
        for key in [k for k in list(cache) if k not in live]:
            cache.pop(key, None)


def engine_kind(proc: Proc, rules: EngineRules) -> str | None:
    if proc.is_kernel_thread:
        return None
    key = (proc.comm, proc.argv)
    cache = rules.kind_cache
    if key in cache:
        return cache[key]
    found = None
    ids = identity_strings(proc)
    for kind, pattern in rules.engines:
        if any(pattern.match(s) for s in ids):
            found = kind
            break
    if len(cache) >= _KIND_CACHE_MAX:
        cache.clear()
    cache[key] = found
    return found


def is_protected(proc: Proc, rules: EngineRules) -> bool:
    ids = (proc.comm, entry_point(proc.argv)[0])
    return any(p.match(s) for p in rules.protect for s in ids if s)


@dataclass(frozen=True, slots=True)
class Scope:
    """Who the guard may touch: not itself or its ancestors, not PID 1, not other users unless it runs as root."""

    self_pid: int
    own_uid: int
    ancestor_pid: int = 0  # 0: every engine; else only engines below (or at) this PID


def _ancestors(pid: int, by_pid: dict[int, Proc]) -> list[int]:
    chain = []
    seen = {pid}
    cur = by_pid.get(pid)
    while cur is not None and cur.ppid not in seen and cur.ppid > 0:
        chain.append(cur.ppid)
        seen.add(cur.ppid)
        cur = by_pid.get(cur.ppid)
    return chain


def find_engine_trees(procs: Sequence[Proc], rules: EngineRules, scope: Scope) -> list[EngineTree]:
    """Every engine tree the guard would kill now, outermost engine first, largest RSS first."""
    by_pid = {p.pid: p for p in procs}
    children: dict[int, list[Proc]] = defaultdict(list)
    for p in procs:
        children[p.ppid].append(p)
    untouchable = {1, 2, scope.self_pid, *_ancestors(scope.self_pid, by_pid)}

    def touchable(p: Proc) -> bool:
        return (
            p.pid not in untouchable
            and not p.is_kernel_thread
            and (scope.own_uid == 0 or p.uid == scope.own_uid)
            and not is_protected(p, rules)
        )

    kinds = {p.pid: k for p in procs if (k := engine_kind(p, rules)) is not None}
    forget_dead_kinds(rules, procs)
    trees = []
    for pid, kind in kinds.items():
        chain = _ancestors(pid, by_pid)
        if any(a in kinds for a in chain):
            continue  # inside an outer engine's tree
        if scope.ancestor_pid and scope.ancestor_pid != pid and scope.ancestor_pid not in chain:
            continue
        root = by_pid[pid]
        if not touchable(root):
            continue
        members = [root]
        queue = [root]
        seen = {root.pid}
        while queue:
            parent = queue.pop(0)
            for child in sorted(children.get(parent.pid, ()), key=lambda c: c.pid):
                if child.pid in seen or not touchable(child):
                    continue  # a protected child keeps its whole subtree
                seen.add(child.pid)
                members.append(child)
                queue.append(child)
        trees.append(EngineTree(kind=kind, root=root, members=tuple(members)))
    trees.sort(key=lambda t: (-t.rss_bytes, t.root.pid))
    return trees
