"""`docker run …` and `docker compose up …` as `sparkwatch launch` reads and writes them: the options, the image, the
command, the services; and the command lines launch starts. Pure: argv in, records out (core.launch.containerspec
says what the container runs and reads; cli.launch.docker asks docker and runs it).

Options are read as docker's flag parser (spf13/pflag) reads them: `--name value`, `--name=value`, a boolean `--rm` or
`--rm=false`, short booleans grouped (`-dit`), a short option's value attached (`-p8000:8000`, `-e=K=V`) or in the
next word; docker run's options end at the image (what follows is the command). Which option takes a value is docker
28.2's `docker run --help` (docs.docker.com/reference/cli/docker/container/run/), with the deprecated `--net`,
`--net-alias` and `--dns-opt`; compose's are v2's and docker-compose 1.29's, together. An option not in the tables is
refused unless written `--name=value`: it cannot be told whether the next word is its value or the image.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sparkwatch.core.container import LABEL_LAUNCH as LABEL
from sparkwatch.core.containerid import LAUNCH_ENV as ENV
from sparkwatch.core.engines.enginecli import COMPOSE_V1_CLIENT, DOCKER_CLIENT

# pflag's booleans (strconv.ParseBool): what `--rm=VALUE` may say.
_TRUE = frozenset({"1", "t", "T", "true", "TRUE", "True"})
_FALSE = frozenset({"0", "f", "F", "false", "FALSE", "False"})


@dataclass(frozen=True, slots=True)
class Spec:
    """One command's options: the long names that take a value, the booleans, and the short letters."""

    values: frozenset[str]
    bools: frozenset[str]
    shorts: Mapping[str, str] = field(default_factory=dict)  # letter -> long name


def _spec(values: str, bools: str, shorts: str = "") -> Spec:
    pairs = dict(p.split("=") for p in shorts.split())
    return Spec(frozenset(values.split()), frozenset(bools.split()), pairs)


RUN = _spec(
    "add-host annotation attach blkio-weight blkio-weight-device cap-add cap-drop cgroup-parent cgroupns cidfile "
    "cpu-count cpu-percent cpu-period cpu-quota cpu-rt-period cpu-rt-runtime cpu-shares cpus cpuset-cpus cpuset-mems "
    "detach-keys device device-cgroup-rule device-read-bps device-read-iops device-write-bps device-write-iops dns "
    "dns-option dns-opt dns-search domainname entrypoint env env-file expose gpus group-add health-cmd "
    "health-interval health-retries health-start-interval health-start-period health-timeout hostname "
    "io-maxbandwidth io-maxiops ip ip6 ipc isolation kernel-memory label label-file link link-local-ip log-driver "
    "log-opt mac-address memory memory-reservation memory-swap memory-swappiness mount name net net-alias network "
    "network-alias oom-score-adj pid pids-limit platform publish pull restart runtime security-opt shm-size "
    "stop-signal stop-timeout storage-opt sysctl tmpfs ulimit user userns uts volume volume-driver volumes-from "
    "workdir",
    "detach disable-content-trust help init interactive no-healthcheck oom-kill-disable privileged publish-all "
    "quiet read-only rm sig-proxy tty use-api-socket",
    "a=attach c=cpu-shares d=detach e=env h=hostname i=interactive l=label m=memory p=publish P=publish-all q=quiet "
    "t=tty u=user v=volume w=workdir",
)
DOCKER = _spec(
    "config context host log-level tlscacert tlscert tlskey",
    "debug help tls tlsverify version",
    "c=context D=debug H=host l=log-level v=version",
)
# `docker compose` (v2) and `docker-compose` (v1.29) global options together: neither reads one of them otherwise.
COMPOSE = _spec(
    "ansi context env-file file host log-level parallel profile progress project-directory project-name tlscacert "
    "tlscert tlskey",
    "all-resources compatibility dry-run help no-ansi skip-hostname-check tls tlsverify verbose version",
    "c=context f=file H=host p=project-name v=version",
)
_DAEMON_OPTIONS = frozenset({"host", "context", "tls", "tlsverify", "tlscacert", "tlscert", "tlskey"})
UP = _spec(
    "attach exit-code-from no-attach pull scale timeout wait-timeout",
    "abort-on-container-exit abort-on-container-failure always-recreate-deps attach-dependencies build detach "
    "force-recreate help menu no-build no-color no-deps no-log-prefix no-recreate no-start quiet-build quiet-pull "
    "remove-orphans renew-anon-volumes timestamps wait watch yes",
    "d=detach t=timeout V=renew-anon-volumes w=watch y=yes",
)


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the long name, without dashes
    value: str | None  # None: a boolean written without a value

    @property
    def on(self) -> bool:
        """A boolean's word: `--rm` and `--rm=true` are on, `--rm=false` is off."""
        return self.value is None or self.value in _TRUE

    def words(self) -> list[str]:
        """The option written back, one word: `--name=value` is what pflag and docopt both read."""
        return [f"--{self.name}" if self.value is None else f"--{self.name}={self.value}"]


def parse_options(
    words: Sequence[str], spec: Spec, what: str, *, interspersed: bool = False
) -> tuple[list[Option], list[str]]:
    """(options, the rest). Without `interspersed` the options end at the first other word or `--`, and the rest is
    everything from there; with it the rest holds every other word (compose up's services). Raises ValueError, one
    line, for an option `what` has not got, or one that needs a value and has none."""
    opts: list[Option] = []
    rest: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            rest += words[i:]
            break
        if not word.startswith("-") or word == "-":
            if not interspersed:
                rest += words[i - 1 :]
                break
            rest.append(word)
            continue
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            if name in spec.bools:
                opts.append(Option(name, value if eq else None))
            elif name in spec.values or eq:
                if not eq:
                    if i >= len(words):
                        raise ValueError(f"{what}: --{name} needs a value")
                    value, i = words[i], i + 1
                opts.append(Option(name, value))
            else:
                raise ValueError(
                    f"{what}: --{name} is not an option sparkwatch launch knows: write it --{name}=VALUE (or "
                    f"--{name}=true), so that the next word is not taken for its value"
                )
            continue
        letters = word[1:]
        for j, letter in enumerate(letters):
            name = spec.shorts.get(letter, "")
            if name in spec.bools:
                opts.append(Option(name, None))
                continue
            if not name:
                raise ValueError(f"{what}: -{letter} is not an option sparkwatch launch knows")
            value = letters[j + 1 :].removeprefix("=")
            if not value:
                if i >= len(words):
                    raise ValueError(f"{what}: -{letter} needs a value")
                value, i = words[i], i + 1
            opts.append(Option(name, value))
            break
    return opts, rest


class Options:
    """Parsed options with the lookups launch needs."""

    options: tuple[Option, ...]

    def values(self, *names: str) -> list[str]:
        return [o.value for o in self.options if o.name in names and o.value is not None]

    def last(self, *names: str) -> str | None:
        found = self.values(*names)
        return found[-1] if found else None

    def on(self, name: str) -> bool | None:
        """A boolean as the command leaves it: None when not given at all."""
        given = [o for o in self.options if o.name == name]
        return given[-1].on if given else None


@dataclass(frozen=True, slots=True)
class DockerRun(Options):
    docker: tuple[str, ...]  # the client and its global options, as written: `docker -H unix:///x`
    run: tuple[str, ...]  # ("run",) or ("container", "run")
    options: tuple[Option, ...]
    image: str
    command: tuple[str, ...]

    @property
    def detach(self) -> bool:
        return bool(self.on("detach"))

    @property
    def entrypoint(self) -> str | None:
        return self.last("entrypoint")

    @property
    def restart(self) -> str:
        return self.last("restart") or "no"


@dataclass(frozen=True, slots=True)
class ComposeUp(Options):
    tool: tuple[str, ...]  # `docker [global options] compose`, or `docker-compose`
    docker: tuple[str, ...]  # the docker client for one container (inspect, stop): `docker [its global options]`
    globals: tuple[Option, ...]  # compose's own global options
    options: tuple[Option, ...]  # up's
    services: tuple[str, ...]

    @property
    def files(self) -> list[str]:
        return [o.value for o in self.globals if o.name == "file" and o.value is not None]

    @property
    def detach(self) -> bool:
        return bool(self.on("detach"))


def parse(argv: Sequence[str]) -> DockerRun | ComposeUp | None:
    """The container command `argv` is, or None for anything else (`docker ps`, a bare engine). Raises ValueError, one
    line, for a docker command launch cannot read (an unknown option without `=`, no image)."""
    if not argv:
        return None
    base = posixpath.basename(argv[0])
    if base == COMPOSE_V1_CLIENT:
        return _compose(tuple(argv[:1]), tuple(argv[:1]), argv[1:], v1=True)
    if base != DOCKER_CLIENT:
        return None
    _opts, rest = parse_options(argv[1:], DOCKER, "docker")
    docker = tuple(argv[: len(argv) - len(rest)])
    if rest[:1] == ["compose"]:
        return _compose((*docker, "compose"), docker, rest[1:], v1=False)
    sub = ("run",) if rest[:1] == ["run"] else ("container", "run") if rest[:2] == ["container", "run"] else None
    if sub is None:
        return None
    run_opts, tail = parse_options(rest[len(sub) :], RUN, "docker run")
    if not tail:
        raise ValueError("docker run: no image named")
    return DockerRun(docker, sub, tuple(run_opts), tail[0], tuple(tail[1:]))


def _compose(tool: tuple[str, ...], docker: tuple[str, ...], words: Sequence[str], *, v1: bool) -> ComposeUp | None:
    gopts, rest = parse_options(words, COMPOSE, "docker-compose" if v1 else "docker compose")
    if rest[:1] != ["up"]:
        return None
    if v1:  # docker-compose's own -H/--context/--tls… name the daemon: docker's client takes the same
        docker = ("docker", *(w for o in gopts if o.name in _DAEMON_OPTIONS for w in o.words()))
    uopts, services = parse_options(rest[1:], UP, "compose up", interspersed=True)
    return ComposeUp(tool, docker, tuple(gopts), tuple(uopts), tuple(services))


# --- what launch adds


def launch_run_argv(run: DockerRun, *, token: str, cidfile: str | None, env: Iterable[tuple[str, str]]) -> list[str]:
    """The `docker run` launch starts: its label and token, `--cidfile` (unless the command has one), `--init` unless
    the command says either way, the environment it sets (core.launch.launchenv), attached: without `-d` (launch
    detaches itself once the engine is ready) nor `-i`/`-t` (the output comes through launch's pipes), and without
    `--restart` (held back while launch watches: a guard kill is final; `-d` gives it back at ready)."""
    out = [*run.docker, *run.run, f"--label={LABEL}={token}", f"--env={ENV}={token}"]
    if cidfile is not None and run.last("cidfile") is None:
        out.append(f"--cidfile={cidfile}")
    if run.on("init") is None:
        out.append("--init")
    out += [f"--env={k}={v}" for k, v in env]
    for opt in run.options:
        if opt.name not in ("detach", "interactive", "tty", "restart"):
            out += opt.words()
    return [*out, run.image, *run.command]


def launch_compose_argv(up: ComposeUp, files: Sequence[str], override: str, service: str) -> list[str]:
    """`compose [globals] -f FILE… -f OVERRIDE up [options] SERVICE`, attached (without `-d`)."""
    out = [*up.tool]
    for opt in up.globals:
        if opt.name != "file":
            out += opt.words()
    out += [f"--file={f}" for f in (*files, override)]
    out.append("up")
    for opt in up.options:
        if opt.name != "detach":
            out += opt.words()
    return [*out, service]
