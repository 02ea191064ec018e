"""`docker run …` and `docker compose up …` as `sparkwatch launch` reads them: the engine a container runs, where its
model lies on the host, and the flags launch adds. Pure: argv and docker's own JSON in, records out; cli.launch_docker
asks docker (`docker image inspect`, `compose config`) and runs it.

- Options are read as docker's flag parser (spf13/pflag) reads them: `--name value`, `--name=value`, a boolean
  `--rm` or `--rm=false`, short booleans grouped (`-dit`), a short option's value attached (`-p8000:8000`, `-e=K=V`)
  or in the next word; docker run's options end at the image (what follows is the command). Which option takes a value
  is docker 28.2's `docker run --help` (docs.docker.com/reference/cli/docker/container/run/), with the deprecated
  `--net`, `--net-alias` and `--dns-opt`; an option not in the tables is refused unless written `--name=value`: it
  cannot be told whether the next word is its value or the image.
- The engine's command line is the entrypoint and the command (`--entrypoint` resets the image's command, as docker
  does), else the image's own (`docker image inspect`), else KNOWN_IMAGES for an image not pulled yet. Wrappers that
  run their arguments are looked through (ENTRY_WRAPPERS, `sh -c '… && exec vllm serve …'`).
- Paths: a path the engine reads in the container is read on the host through the bind mounts (`-v SRC:DST`,
  `--mount type=bind`); the deepest mount that holds it wins, as in the container.
"""

from __future__ import annotations

import csv
import posixpath
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sparkwatch.core.containerid import LAUNCH_ENV as ENV
from sparkwatch.core.containerid import LAUNCH_LABEL as LABEL

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

    @property
    def host_network(self) -> bool:
        return self.last("network", "net") == "host"


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
    if base == "docker-compose":
        return _compose(tuple(argv[:1]), tuple(argv[:1]), argv[1:], v1=True)
    if base != "docker":
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


# --- the engine's command line


# Entrypoints that run their arguments: NGC's (nvcr.io/nvidia/*: /opt/nvidia/nvidia_entrypoint.sh ends in exec "$@"),
# and the init processes docker and images put first (tini, dumb-init, docker-init: `[options] [--] command`).
ENTRY_WRAPPERS = frozenset({"nvidia_entrypoint.sh"})
INITS = frozenset({"tini", "tini-static", "dumb-init", "docker-init"})
SHELLS = frozenset({"sh", "bash", "dash"})
# An image's own entrypoint and command, for an image not pulled yet (`docker image inspect` says it once it is):
# vllm/vllm-openai: vllm's docker/Dockerfile, target vllm-openai, ENTRYPOINT ["vllm", "serve"] (older tags:
# python3 -m vllm.entrypoints.openai.api_server, which takes the same flags); NGC's vLLM and SGLang's images name
# no engine: the command does (`… nvcr.io/nvidia/vllm:25.09-py3 vllm serve MODEL`).
KNOWN_IMAGES: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm/vllm-openai": (("vllm", "serve"), ()),
    "nvcr.io/nvidia/vllm": (("/opt/nvidia/nvidia_entrypoint.sh",), ()),
    "lmsysorg/sglang": ((), ()),
}


def repository(image: str) -> str:
    """`docker.io/vllm/vllm-openai:v0.11.0@sha256:…` -> `vllm/vllm-openai`: the name KNOWN_IMAGES is keyed by."""
    name = image.split("@", 1)[0]
    head, _slash, last = name.rpartition("/")
    last = last.split(":", 1)[0]
    name = f"{head}/{last}" if head else last
    for prefix in ("docker.io/", "index.docker.io/", "library/"):
        name = name.removeprefix(prefix)
    return name


def entry_and_command(
    entrypoint_flag: str | None,
    command: Sequence[str],
    image_entrypoint: Sequence[str] | None,
    image_command: Sequence[str] | None,
) -> tuple[str, ...]:
    """What the container runs, as docker composes it: `--entrypoint` (one word; "" clears it) resets the image's
    command too; a command given replaces the image's."""
    if entrypoint_flag is not None:
        return (*([entrypoint_flag] if entrypoint_flag else []), *command)
    return (*(image_entrypoint or ()), *(command or image_command or ()))


def engine_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """The engine's own command line inside what the container runs: NGC's entrypoint, an init and `sh -c '…'`
    looked through (the last command of the shell's list, `exec` dropped). core.engines.enginecli reads the rest."""
    out = tuple(argv)
    for _ in range(8):  # wrappers of wrappers, bounded
        base = posixpath.basename(out[0]) if out else ""
        if base in ENTRY_WRAPPERS:
            out = out[1:]
        elif base in INITS:
            rest = out[1:]
            out = rest[rest.index("--") + 1 :] if "--" in rest else tuple(w for w in rest if not w.startswith("-"))
        elif base in SHELLS and len(out) >= 3 and out[1] == "-c":
            out = _last_command(out[2])
        else:
            break
    return out


def _last_command(script: str) -> tuple[str, ...]:
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:
        return ()
    last: list[str] = []
    for word in words:
        if word and set(word) <= set(";&|"):
            last = []
        else:
            last.append(word)
    return tuple(last[1:] if last[:1] == ["exec"] else last)


# --- paths


@dataclass(frozen=True, slots=True)
class Mount:
    source: str  # the host path; "" for a volume (named or anonymous), whose place on the host is docker's
    target: str  # where the container sees it
    volume: str = ""  # a named volume's name


def bind_mounts(volumes: Iterable[str], mounts: Iterable[str], cwd: str) -> tuple[Mount, ...]:
    """`-v`/`--volume` and `--mount` as docker run reads them: `SRC:DST[:OPTS]` binds SRC when it is a path (a relative
    one, `./models`, from `cwd`: docker 23+), else names a volume; `DST` alone is an anonymous volume. `--mount` is
    comma-separated key=value (csv quoting), type bind/volume/tmpfs."""
    out = []
    for spec in volumes:
        parts = spec.split(":")
        if len(parts) == 1:
            out.append(Mount("", parts[0]))
            continue
        src, dst = parts[0], parts[1]
        if src.startswith("."):
            src = posixpath.normpath(posixpath.join(cwd, src))
        out.append(Mount(src, dst) if src.startswith("/") else Mount("", dst, volume=src))
    for spec in mounts:
        fields = dict(_kv(item) for row in csv.reader([spec]) for item in row)
        target = fields.get("target") or fields.get("destination") or fields.get("dst") or ""
        source = fields.get("source") or fields.get("src") or ""
        if not target:
            continue
        if fields.get("type", "volume") == "bind" and source.startswith("/"):
            out.append(Mount(source, target))
        else:
            out.append(Mount("", target, volume=source if fields.get("type", "volume") == "volume" else ""))
    return tuple(out)


def _kv(item: str) -> tuple[str, str]:
    key, _eq, value = item.partition("=")
    return key.strip().lower(), value


def host_path(mounts: Sequence[Mount], path: str) -> str | None:
    """Where a container path lies on the host: under the deepest mount that holds it, when that mount binds a host
    path; None when no bind mount holds it (the image's own files, a volume)."""
    path = posixpath.normpath(path)
    best: Mount | None = None
    for m in mounts:
        target = posixpath.normpath(m.target)
        inside = path == target or path.startswith(target.rstrip("/") + "/")
        if inside and (best is None or len(target) >= len(posixpath.normpath(best.target))):
            best = m
    if best is None or not best.source:
        return None
    rel = posixpath.relpath(path, posixpath.normpath(best.target))
    return best.source if rel == "." else posixpath.join(best.source, rel)


# --- environment


def env_file_entries(text: str) -> list[str]:
    """docker's --env-file (opts/envfile.go): one `KEY=VALUE` or `KEY` a line, `#` lines and blank lines skipped,
    leading whitespace dropped; no quoting."""
    out = []
    for raw in text.splitlines():
        line = raw.lstrip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def container_env(image_env: Iterable[str], entries: Iterable[str], host_env: Mapping[str, str]) -> dict[str, str]:
    """The container's environment: the image's, then each `KEY=VALUE` (env files first, then `-e`, as docker merges
    them); a bare `KEY` takes the host's value, and is left out when the host has none."""
    env: dict[str, str] = {}
    for item in (*image_env, *entries):
        key, eq, value = item.partition("=")
        if eq:
            env[key] = value
        elif key in host_env:
            env[key] = host_env[key]
    return env


# --- ports


def published_port(publish: Iterable[str], port: int) -> tuple[str, int] | None:
    """Where the host reaches the container's `port`: the host address and port of the `-p [IP:][HOSTPORT:]PORT`
    that publishes it (a wildcard or no address: loopback), or None (not published, or to a port docker picks)."""
    for written in publish:
        spec = written.split("/", 1)[0]
        if spec.startswith("["):  # [::1]:8000:8000
            host, _b, tail = spec[1:].partition("]")
            parts = [host, *tail.lstrip(":").split(":")]
        else:
            parts = spec.split(":")
        if len(parts) < 2 or parts[-1] != str(port) or not parts[-2].isdigit():
            continue
        host = parts[-3] if len(parts) >= 3 and parts[-3] else "127.0.0.1"
        return ("127.0.0.1" if host in ("0.0.0.0", "::") else host), int(parts[-2])
    return None


# --- what launch adds


def launch_run_argv(run: DockerRun, *, token: str, cidfile: str | None, env: Iterable[tuple[str, str]]) -> list[str]:
    """The `docker run` launch starts: its label and token, `--cidfile` (unless the command has one), `--init` unless
    the command says either way, the environment it sets (core.launch.launchenv), attached: without `-d` (launch
    detaches itself once the engine is ready) nor `-i`/`-t` (the output comes through launch's pipes)."""
    out = [*run.docker, *run.run, f"--label={LABEL}={token}", f"--env={ENV}={token}"]
    if cidfile is not None and run.last("cidfile") is None:
        out.append(f"--cidfile={cidfile}")
    if run.on("init") is None:
        out.append("--init")
    out += [f"--env={k}={v}" for k, v in env]
    for opt in run.options:
        if opt.name not in ("detach", "interactive", "tty"):
            out += opt.words()
    return [*out, run.image, *run.command]


@dataclass(frozen=True, slots=True)
class Service:
    """One compose service, from `compose config` (its output: v2's JSON, or v1's YAML read as such)."""

    name: str
    image: str
    entrypoint: tuple[str, ...] | None
    command: tuple[str, ...] | None
    mounts: tuple[Mount, ...]
    environment: Mapping[str, str]
    restart: str
    init: bool | None
    ports: tuple[str, ...]  # as `-p` writes them
    host_network: bool


def _words(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return tuple(shlex.split(value))
    if isinstance(value, list):
        return tuple(str(v) for v in value)
    raise ValueError(f"not a command: {type(value).__name__}")


def service_of(config: Mapping[str, object], name: str | None, cwd: str) -> Service:
    """The service `name` (or the only one) of a compose config. Raises ValueError, one line."""
    services = config.get("services")
    if not isinstance(services, dict) or not services:
        raise ValueError("compose config: no services")
    if name is None:
        if len(services) != 1:
            raise ValueError(f"compose up: name the service to launch (one of {', '.join(sorted(services))})")
        name = next(iter(services))
    svc = services.get(name)
    if not isinstance(svc, dict):
        raise ValueError(f"compose config: no service {name!r}")
    volumes, binds = [], []
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            volumes.append(v)
        elif isinstance(v, dict) and v.get("type", "volume") == "bind":
            binds.append(f"type=bind,source={v.get('source', '')},target={v.get('target', '')}")
        elif isinstance(v, dict):
            binds.append(f"type=volume,source={v.get('source', '')},target={v.get('target', '')}")
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(str(e).partition("=")[::2] for e in env)
    ports = []
    for p in svc.get("ports") or []:
        if isinstance(p, dict):
            host = f"{p['host_ip']}:" if p.get("host_ip") else ""
            ports.append(f"{host}{p.get('published', '')}:{p.get('target', '')}")
        else:
            ports.append(str(p))
    init = svc.get("init")
    return Service(
        name=name,
        image=str(svc.get("image") or ""),
        entrypoint=_words(svc.get("entrypoint")),
        command=_words(svc.get("command")),
        mounts=bind_mounts(volumes, binds, cwd),
        environment={str(k): "" if v is None else str(v) for k, v in env.items()},
        restart=str(svc.get("restart") or "no"),
        init=init if isinstance(init, bool) else None,
        ports=tuple(ports),
        host_network=svc.get("network_mode") == "host",
    )


def init_allowed(version: str | None) -> bool:
    """Whether a compose file of this `version` may say `init:` (file formats 2.2+ and 3.7+; the compose
    specification, which has no version, always)."""
    if not version:
        return True
    major, _dot, minor = version.partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        return False
    return (int(major), int(minor or 0)) >= ((2, 2) if major == "2" else (3, 7))


def compose_override(
    svc: Service, *, token: str, env: Iterable[tuple[str, str]], version: str | None
) -> dict[str, object]:
    """The compose file launch adds after the owner's (`-f`): the label and token, the environment it sets, and
    `init: true` where the service says nothing of it and its file format allows it."""
    body: dict[str, object] = {"labels": {LABEL: token}, "environment": {ENV: token, **dict(env)}}
    if svc.init is None and init_allowed(version):
        body["init"] = True
    doc: dict[str, object] = {"services": {svc.name: body}}
    if version:
        doc["version"] = version
    return doc


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
