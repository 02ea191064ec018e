"""What the engine in a container runs and reads, for `sparkwatch launch`'s plan: its command line, where its paths lie
on the host, its environment, a compose service's, and the compose file launch adds. Pure: docker's own documents in
(`docker image inspect`'s Config, `compose config`), records out; core.launch.dockerargv reads the command lines.

- The engine's command line is the entrypoint and the command (`--entrypoint` resets the image's command, as docker
  does), else the image's own (`docker image inspect`), else KNOWN_IMAGES for an image not pulled yet. Wrappers that
  run their arguments are looked through (ENTRY_WRAPPERS, INITS, `sh -c '… && exec vllm serve …'`).
- Paths: a path the engine reads in the container is read on the host through the bind mounts (`-v SRC:DST`,
  `--mount type=bind`, compose `volumes:`); the deepest mount that holds it wins, as in the container.
- The environment: the image's, then `--env-file`, then `-e`, as docker merges them.
"""

from __future__ import annotations

import csv
import posixpath
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from sparkwatch.core.container import LABEL_LAUNCH as LABEL
from sparkwatch.core.containerid import LAUNCH_ENV as ENV

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
    """The compose file launch adds after the owner's (`-f`): the label and token, the environment it sets, no restart
    policy while launch watches, and `init: true` where the service says nothing of it and its file format allows it."""
    body: dict[str, object] = {"labels": {LABEL: token}, "environment": {ENV: token, **dict(env)}}
    if svc.restart not in ("", "no"):
        body["restart"] = "no"  # held back while launch watches (core.launch.dockerargv.launch_run_argv)
    if svc.init is None and init_allowed(version):
        body["init"] = True
    doc: dict[str, object] = {"services": {svc.name: body}}
    if version:
        doc["version"] = version
    return doc
