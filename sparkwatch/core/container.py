"""What a container runtime says of a container (the Docker Engine API's inspect document, which podman's compatible
API serves too), as frozen facts, and what its `io.sparkwatch.*` labels ask of sparkwatch. Pure: the document comes
from telemetry.sources.dockerapi; the guard never talks to a daemon.

Labels (docs/containers.md), set with `docker run --label` or compose `labels:`:

| label                      | value                 | meaning                                                       |
| -------------------------- | --------------------- | ------------------------------------------------------------- |
| `io.sparkwatch.after-kill` | gate, stop, allow     | after a guard kill of its engine (`container_after_kill`)     |
| `io.sparkwatch.budget`     | a size (`60GiB`)      | the engine tree's budget, as `engine_budgets` gives one        |
| `io.sparkwatch.protect`    | true / false          | never kill its processes, by any trigger (budgets included)    |
| `io.sparkwatch.priority`   | an integer            | kill order, as `kill_priority` (higher dies earlier)           |
| `io.sparkwatch.launch`     | a declaration id      | set by `sparkwatch launch -- docker run`                       |

A label is trusted as much as the Docker socket is, which is root-equivalent. A label whose value does not parse is
named in `problems` and ignored: never a reason to kill, never a budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from sparkwatch.core.containerid import ContainerRef
from sparkwatch.core.redact import redact
from sparkwatch.core.units import parse_size

LABEL_PREFIX = "io.sparkwatch."
LABEL_AFTER_KILL = "io.sparkwatch.after-kill"
LABEL_BUDGET = "io.sparkwatch.budget"
LABEL_PROTECT = "io.sparkwatch.protect"
LABEL_PRIORITY = "io.sparkwatch.priority"
LABEL_LAUNCH = "io.sparkwatch.launch"
COMPOSE_PROJECT = "com.docker.compose.project"
COMPOSE_SERVICE = "com.docker.compose.service"


class AfterKill(StrEnum):
    """What telemetry does when a container whose engine the guard killed is started again by its restart policy."""

    GATE = "gate"  # pause the restarted container until the pool has settled and its peak fits, then unpause
    STOP = "stop"  # cancel the restart: the API's kill (the policy is left as the owner wrote it)
    ALLOW = "allow"  # let it restart (before sparkwatch knew containers), with the container named


@dataclass(frozen=True, slots=True)
class PortBinding:
    container_port: int
    protocol: str  # tcp, udp
    host_ip: str  # "" or 0.0.0.0: every address
    host_port: int


@dataclass(frozen=True, slots=True)
class Mount:
    source: str  # the host path (a volume's is its data directory)
    destination: str  # the path inside the container
    kind: str  # bind, volume, tmpfs
    read_write: bool


@dataclass(frozen=True, slots=True)
class ContainerFacts:
    """One container as its runtime reports it."""

    id: str  # 64 hex digits
    name: str  # without docker's leading "/"
    image: str  # as the owner named it (Config.Image), not the digest
    state: str  # created, running, paused, restarting, exited, dead
    pid: int  # its init process on the host; 0 when not running
    restart_policy: str = "no"  # no, always, unless-stopped, on-failure
    restart_count: int = 0
    network_mode: str = "default"  # bridge, host, none, container:<id>, a network's name
    ip_addresses: tuple[str, ...] = ()  # its addresses on its networks (bridge ones reachable from the host)
    ports: tuple[PortBinding, ...] = ()
    mounts: tuple[Mount, ...] = ()
    labels: Mapping[str, str] = field(default_factory=dict)
    oom_killed: bool = False  # Docker's own flag: its cgroup's OOM killer, never the guard's kill or a GB10's pool
    exit_code: int | None = None
    started_at: str = ""

    @property
    def short_id(self) -> str:
        return self.id[:12]

    @property
    def compose_project(self) -> str | None:
        return self.labels.get(COMPOSE_PROJECT) or None

    @property
    def compose_service(self) -> str | None:
        return self.labels.get(COMPOSE_SERVICE) or None

    @property
    def restarts_itself(self) -> bool:
        """Whether dockerd starts it again after its init dies of a signal it did not send (every policy but `no`)."""
        return self.restart_policy in ("always", "unless-stopped", "on-failure")

    def label(self) -> str:
        """How an owner finds it in `docker ps`: its name, image and compose service."""
        return container_words(self.name, self.image, self.compose_project or "", self.compose_service or "")


def container_words(name: str, image: str, project: str = "", service: str = "", short_id: str = "") -> str:
    """`container vllm-main (nvcr.io/nvidia/vllm:25.09-py3 spark/vllm)`: the one wording of a container in kill lines,
    events, views and logs (with `short_id`: `…; 4f4f4f4f4f4f)`, the id `docker ps` shows)."""
    where = f" {project}/{service}" if service else ""
    ident = f"; {short_id}" if short_id else ""
    return f"container {name} ({image}{where}{ident})"


def container_line(ref: ContainerRef, facts: ContainerFacts | None) -> str:
    """How a view names a tree's container in place of its root's parent (the runtime's shim): `in container vllm-main
    (nvcr.io/nvidia/vllm:25.09-py3 spark/vllm; 4f4f4f4f4f4f), restart unless-stopped`, or by id alone when the API
    did not say (`in container 4f4f4f4f4f4f (docker)`). Redacted: an image may name a registry's user:token@."""
    if facts is None or facts.id != ref.id:
        return f"in container {ref.short_id} ({ref.runtime})"
    project, service = facts.compose_project or "", facts.compose_service or ""
    words = container_words(facts.name, facts.image, project, service, facts.short_id)
    return redact(f"in {words}, restart {facts.restart_policy}")


@dataclass(frozen=True, slots=True)
class LabelAsks:
    """What a container's io.sparkwatch.* labels ask; None where a label is absent (the config decides)."""

    after_kill: AfterKill | None = None
    budget_bytes: int | None = None
    protect: bool | None = None
    priority: int | None = None
    launch_id: str | None = None
    problems: tuple[str, ...] = ()  # labels that did not parse, in words, each naming its label


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def label_asks(labels: Mapping[str, str]) -> LabelAsks:
    """The io.sparkwatch.* labels, parsed; a bad value is named in `problems` and ignored."""
    problems: list[str] = []
    after_kill = budget = protect = priority = None
    if (raw := labels.get(LABEL_AFTER_KILL)) is not None:
        try:
            after_kill = AfterKill(raw.strip().lower())
        except ValueError:
            problems.append(f"{LABEL_AFTER_KILL}={raw!r}: expected one of {', '.join(AfterKill)}")
    if (raw := labels.get(LABEL_BUDGET)) is not None:
        try:
            budget = parse_size(raw)
            if budget <= 0:
                raise ValueError("not positive")
        except ValueError:
            problems.append(f"{LABEL_BUDGET}={raw!r}: expected a size such as 60GiB")
            budget = None
    if (raw := labels.get(LABEL_PROTECT)) is not None:
        word = raw.strip().lower()
        if word in _TRUE:
            protect = True
        elif word in _FALSE:
            protect = False
        else:
            problems.append(f"{LABEL_PROTECT}={raw!r}: expected true or false")
    if (raw := labels.get(LABEL_PRIORITY)) is not None:
        try:
            priority = int(raw.strip())
        except ValueError:
            problems.append(f"{LABEL_PRIORITY}={raw!r}: expected an integer")
    launch_id = labels.get(LABEL_LAUNCH) or None
    return LabelAsks(after_kill, budget, protect, priority, launch_id, tuple(problems))


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _dict(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def _ports(raw: object) -> tuple[PortBinding, ...]:
    out: list[PortBinding] = []
    for key, bindings in _dict(raw).items():
        port, _, proto = key.partition("/")
        if not port.isdigit() or not isinstance(bindings, list):
            continue
        for b in bindings:
            host_port = str(_dict(b).get("HostPort", ""))
            if host_port.isdigit():
                out.append(PortBinding(int(port), proto or "tcp", str(_dict(b).get("HostIp", "")), int(host_port)))
    return tuple(out)


def _mounts(raw: object) -> tuple[Mount, ...]:
    out: list[Mount] = []
    for m in raw if isinstance(raw, list) else ():
        d = _dict(m)
        src, dst = d.get("Source"), d.get("Destination")
        if isinstance(src, str) and isinstance(dst, str):
            out.append(Mount(src, dst, str(d.get("Type", "bind")), bool(d.get("RW", True))))
    return tuple(out)


def facts_from_inspect(doc: Mapping[str, object]) -> ContainerFacts | None:
    """`GET /containers/{id}/json` as facts; None when the document is not a container's (no 64-digit id)."""
    cid = doc.get("Id")
    if not isinstance(cid, str) or len(cid) != 64:
        return None
    state, config, host = _dict(doc.get("State")), _dict(doc.get("Config")), _dict(doc.get("HostConfig"))
    network = _dict(doc.get("NetworkSettings"))
    labels = {str(k): str(v) for k, v in _dict(config.get("Labels")).items()}
    addresses = [
        str(n.get("IPAddress"))
        for n in (_dict(v) for v in _dict(network.get("Networks")).values())
        if n.get("IPAddress")
    ]
    exit_code = state.get("ExitCode")
    return ContainerFacts(
        id=cid,
        name=str(doc.get("Name", "")).lstrip("/") or cid[:12],
        image=str(config.get("Image") or doc.get("Image") or "?"),
        state=str(state.get("Status", "unknown")),
        pid=_int(state.get("Pid")),
        restart_policy=str(_dict(host.get("RestartPolicy")).get("Name") or "no"),
        restart_count=_int(doc.get("RestartCount")),
        network_mode=str(host.get("NetworkMode") or "default"),
        ip_addresses=tuple(addresses),
        ports=_ports(network.get("Ports")),
        mounts=_mounts(doc.get("Mounts")),
        labels=labels,
        oom_killed=bool(state.get("OOMKilled", False)),
        exit_code=exit_code if isinstance(exit_code, int) and not isinstance(exit_code, bool) else None,
        started_at=str(state.get("StartedAt", "")),
    )


# --- what telemetry tells the guard (common.messages.ContainersMsg) --------------------------------------------------

NOTE_TEXT_MAX = 200  # a container's name, image or service as the guard holds them (docker caps names at 255 anyway)
NOTES_MAX = 64  # containers told to the guard at once: those holding an engine tree first, then the labelled ones


@dataclass(frozen=True, slots=True)
class ContainerNote:
    """One container as the guard knows it, by full id: how an owner names it, and what its io.sparkwatch.* labels ask
    (a label that did not parse is absent here: telemetry named it in its log). A container's labels are fixed when it
    is created, so a note is never stale for its id; the name alone may change (`docker rename`)."""

    id: str  # 64 hex digits: matched against the id in an engine tree's cgroup path (core.containerid)
    name: str
    image: str
    project: str = ""  # com.docker.compose.project
    service: str = ""  # com.docker.compose.service
    budget_bytes: int | None = None  # io.sparkwatch.budget
    protect: bool = False  # io.sparkwatch.protect
    priority: int | None = None  # io.sparkwatch.priority

    @property
    def short_id(self) -> str:
        return self.id[:12]

    def label(self, with_id: bool = False) -> str:
        return container_words(self.name, self.image, self.project, self.service, self.short_id if with_id else "")

    def fields(self) -> dict[str, object]:
        """The names a kill event's `containers` entry and a kill_loop's `container` add to the id."""
        out: dict[str, object] = {"name": self.name, "image": self.image}
        if self.service:
            out["compose_project"] = self.project or None
            out["compose_service"] = self.service
        return out


def _cut(text: str) -> str:
    return text if len(text) <= NOTE_TEXT_MAX else text[: NOTE_TEXT_MAX - 1] + "…"


def note_of(facts: ContainerFacts, asks: LabelAsks | None = None) -> ContainerNote:
    """The note telemetry sends for a container (its labels parsed by `label_asks` unless given)."""
    asks = label_asks(facts.labels) if asks is None else asks
    return ContainerNote(
        id=facts.id,
        name=_cut(facts.name),
        image=_cut(facts.image),
        project=_cut(facts.compose_project or ""),
        service=_cut(facts.compose_service or ""),
        budget_bytes=asks.budget_bytes,
        protect=asks.protect is True,
        priority=asks.priority,
    )


def has_sparkwatch_labels(facts: ContainerFacts) -> bool:
    return any(key.startswith(LABEL_PREFIX) for key in facts.labels)


@dataclass(frozen=True)
class ContainerNotes:
    """Telemetry's last word on the containers, as the guard holds it: the notes by id, with what the guard's tick
    asks of them worked out once when the word comes (the tick reads them without building anything)."""

    by_id: Mapping[str, ContainerNote] = field(default_factory=dict)
    budgets: Mapping[str, int] = field(default_factory=dict)  # id -> io.sparkwatch.budget
    protected: frozenset[str] = frozenset()  # ids with io.sparkwatch.protect=true
    priorities: Mapping[str, int] = field(default_factory=dict)  # id -> io.sparkwatch.priority

    @classmethod
    def of(cls, notes: Iterable[ContainerNote]) -> ContainerNotes:
        by_id = {n.id: n for n in notes}
        return cls(
            by_id=by_id,
            budgets={i: n.budget_bytes for i, n in by_id.items() if n.budget_bytes},
            protected=frozenset(i for i, n in by_id.items() if n.protect),
            priorities={i: n.priority for i, n in by_id.items() if n.priority is not None},
        )

    def __bool__(self) -> bool:
        return bool(self.by_id)


NO_NOTES = ContainerNotes()
