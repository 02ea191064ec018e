"""`sparkwatch launch -- docker run …` and `-- docker compose up SERVICE`: what launch asks docker before it plans,
and the command it then starts (core.launch.dockerargv reads the command lines; cli.launch.incontainer runs it).

- The image's own entrypoint, command and environment: `docker image inspect` (an image not pulled yet: the table of
  known images, core.launch.dockerargv.KNOWN_IMAGES; else the command must name the engine).
- A compose service: `compose config` (`docker compose` v2 prints JSON with `--format json`; docker-compose 1.x
  prints YAML only, read with PyYAML where it is installed), over the files compose itself would read: the `-f`
  given, else COMPOSE_FILE, else the first of compose.yaml, compose.yml, docker-compose.yaml, docker-compose.yml in
  the project directory or above it, with its `.override` file. launch adds its own file after them (`-f`).
- The checkpoint on the host (`facts`, which plan.gather asks instead of reading the container's paths on the
  host): the engine's model path, its `--download-dir` and the container's Hugging Face cache (HF_HUB_CACHE,
  HF_HOME, …, as the container's environment sets them, else under its HOME), each through the bind mounts.
- The token (`<uid>-<16 hex digits>`, os.urandom) goes in the container's label and environment: the guard believes
  the declaration of that container only with it there (common.launched.in_container).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkwatch.common.sources.checkpoint import hub_cache, read_facts
from sparkwatch.core.launch import containerspec as cs
from sparkwatch.core.launch import dockerargv as dk
from sparkwatch.core.launch.plan import ModelFacts

DOCKER_TIMEOUT_S = 60.0  # `compose config` of docker-compose 1.x is a Python start: about a second
COMPOSE_NAMES = ("compose.yaml", "compose.yml", "docker-compose.yaml", "docker-compose.yml")
# What the plan reads from the environment that is the engine's, not launch's: the container's values count.
ENGINE_VARIABLES = ("MAX_JOBS", "RAY_ADDRESS")


class ContainerError(Exception):
    """The container command cannot be planned: one line, and launch's exit code."""

    def __init__(self, line: str, code: int = 2) -> None:
        super().__init__(line)
        self.code = code


def docker_out(
    argv: list[str], env: Mapping[str, str], timeout_s: float | None = DOCKER_TIMEOUT_S
) -> tuple[int, str, str]:
    """One docker (or compose) command: (exit code, stdout, stderr); 127 when it cannot be run, 124 past the time
    (None: no limit, `docker wait`)."""
    try:
        done = subprocess.run(
            argv, env=dict(env), capture_output=True, text=True, timeout=timeout_s, check=False,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except OSError as exc:
        return 127, "", exc.strerror or str(exc)
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(argv[:3])}…: no answer within {timeout_s} s"
    return done.returncode, done.stdout, done.stderr


@dataclass
class Container:
    """A container command launch read: the engine it runs (what the plan holds), and what launch starts."""

    docker: tuple[str, ...]  # the docker client for the container itself (inspect, wait, stop): `docker [-H …]`
    image: str
    engine: tuple[str, ...]  # the engine's command line in the container
    env: dict[str, str]  # the container's environment
    mounts: tuple[cs.Mount, ...]
    restart: str
    detach: bool
    user: str | None
    token: str = field(default_factory=lambda: f"{os.geteuid()}-{os.urandom(8).hex()}")
    run: dk.DockerRun | None = None
    compose: dk.ComposeUp | None = None
    service: cs.Service | None = None
    files: tuple[str, ...] = ()
    version: str | None = None
    workdir: Path | None = None  # launch's own files (the cidfile, the compose file it adds), removed at the end

    @property
    def what(self) -> str:
        return "docker run" if self.run is not None else "compose up"

    @property
    def cidfile(self) -> Path | None:
        """Where the client writes the container's id (`docker run`): the command's own --cidfile, else launch's."""
        if self.run is None:
            return None
        own = self.run.last("cidfile")
        return Path(own) if own else self._dir() / "cid"

    def _dir(self) -> Path:
        if self.workdir is None:
            base = os.environ.get("XDG_RUNTIME_DIR")
            self.workdir = Path(tempfile.mkdtemp(prefix="sparkwatch-launch-", dir=base if base else None))
        return self.workdir

    def argv(self, env: list[tuple[str, str]]) -> list[str]:
        """What launch starts, with the environment it sets in the container (core.launch.launchenv)."""
        if self.run is not None:
            return dk.launch_run_argv(self.run, token=self.token, cidfile=str(self.cidfile), env=env)
        assert self.compose is not None and self.service is not None
        doc = cs.compose_override(self.service, token=self.token, env=env, version=self.version)
        override = self._dir() / "sparkwatch-launch.json"  # JSON is YAML: compose reads it as any compose file
        override.write_text(json.dumps(doc, indent=1))
        return dk.launch_compose_argv(self.compose, self.files, str(override), self.service.name)

    def cleanup(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def plan_env(self, host: Mapping[str, str]) -> dict[str, str]:
        """The environment the plan reads: the host's (where launch declares, its state), with the container's say
        over what the engine reads (MAX_JOBS, RAY_ADDRESS)."""
        out = {k: v for k, v in host.items() if k not in ENGINE_VARIABLES}
        out.update({k: self.env[k] for k in ENGINE_VARIABLES if k in self.env})
        return out

    def facts(self, model: str | None, _env: object, download: str | None, revision: str | None) -> ModelFacts:
        """The checkpoint's facts (as common.sources.checkpoint.read_facts gives them), read on the host through the
        bind mounts; a path the container reads from no bind mount (the image's own files, a volume) is not read:
        the facts say so, and the plan counts no weights."""
        home = self.env.get("HOME") or ("/" if self.user else "/root")
        hub = str(hub_cache({**self.env, "XDG_CACHE_HOME": self.env.get("XDG_CACHE_HOME") or f"{home}/.cache"}))
        host_hub = cs.host_path(self.mounts, hub)
        where, unmapped = model or "", None
        if where.startswith("/"):
            where = cs.host_path(self.mounts, where) or ""
            unmapped = None if where else model
        if download:
            host_download = cs.host_path(self.mounts, download)
            unmapped, download = unmapped or (None if host_download else download), host_download
        if unmapped is None and where and not where.startswith("/") and not download and host_hub is None:
            unmapped = f"{hub} (the container's Hugging Face cache)"
        if unmapped:
            return ModelFacts(source=model or "", error=f"{unmapped}: in the container under no bind mount (-v): "
                              "its files are not read")  # fmt: skip
        return read_facts(where, {"HF_HUB_CACHE": host_hub} if host_hub else {}, download, revision)


def prepared(argv: list[str], env: Mapping[str, str]) -> Container | int | None:
    """`prepare`, for launch (for a command that names a container client, core.engines.enginecli.CONTAINER_CLIENTS):
    the exit code after one line on stderr where the container cannot be planned."""
    try:
        return prepare(argv, env)
    except ContainerError as exc:
        print(f"sparkwatch launch: {exc}", file=sys.stderr)
        return exc.code


def prepare(argv: list[str], env: Mapping[str, str]) -> Container | None:
    """The container `argv` starts, read as docker will run it; None when `argv` is no `docker run` nor compose `up`.
    Raises ContainerError (one line, launch's exit code) for one that cannot be planned."""
    try:
        parsed = dk.parse(argv)
    except ValueError as exc:
        raise ContainerError(str(exc)) from None
    if parsed is None:
        return None
    if shutil.which(argv[0]) is None and not Path(argv[0]).exists():
        raise ContainerError(f"{argv[0]}: command not found", 127)
    if isinstance(parsed, dk.DockerRun):
        return _run(parsed, env)
    return _compose(parsed, env)


def _image(docker: tuple[str, ...], image: str, env: Mapping[str, str]) -> dict[str, Any]:
    """The image's Config (Entrypoint, Cmd, Env, User): `docker image inspect`, else KNOWN_IMAGES' entry."""
    code, out, _err = docker_out([*docker, "image", "inspect", "--format", "{{json .Config}}", image], env)
    if code == 0:
        try:
            config = json.loads(out)
            if isinstance(config, dict):
                return config
        except ValueError:
            pass
    entry, cmd = cs.KNOWN_IMAGES.get(cs.repository(image), ((), ()))
    return {"Entrypoint": list(entry), "Cmd": list(cmd), "Env": []}


def _list(config: Mapping[str, Any], key: str) -> tuple[str, ...] | None:
    value = config.get(key)
    return tuple(str(v) for v in value) if isinstance(value, list) else None


def _run(run: dk.DockerRun, env: Mapping[str, str]) -> Container:
    config = _image(run.docker, run.image, env)
    entries = []
    for path in run.values("env-file"):
        try:
            entries += cs.env_file_entries(Path(path).read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise ContainerError(f"docker run: --env-file {path}: {exc.strerror or exc}") from None
    cenv = cs.container_env(_list(config, "Env") or (), [*entries, *run.values("env")], env)
    inner = cs.entry_and_command(run.entrypoint, run.command, _list(config, "Entrypoint"), _list(config, "Cmd"))
    return Container(
        docker=run.docker, image=run.image, engine=cs.engine_argv(inner), env=cenv,
        mounts=cs.bind_mounts(run.values("volume"), run.values("mount"), os.getcwd()),
        restart=run.restart, detach=run.detach, user=run.last("user") or config.get("User") or None, run=run,
    )  # fmt: skip


def compose_files(up: dk.ComposeUp, env: Mapping[str, str]) -> tuple[str, ...]:
    """The files compose reads: `-f`, else COMPOSE_FILE, else the first default name in the project directory or
    above it, and its override file beside it."""
    if up.files:
        return tuple(up.files)
    if env.get("COMPOSE_FILE"):
        return tuple(f for f in env["COMPOSE_FILE"].split(env.get("COMPOSE_PATH_SEPARATOR") or ":") if f)
    start = Path(up.last("project-directory") or os.getcwd()).resolve()
    for directory in (start, *start.parents):
        for name in COMPOSE_NAMES:
            if (directory / name).is_file():
                stem, ext = name.rsplit(".", 1)
                extra = [directory / f"{stem}.override.{e}" for e in (ext, "yaml" if ext == "yml" else "yml")]
                return (str(directory / name), *(str(p) for p in extra[:1] if p.is_file()))
    raise ContainerError("compose up: no compose file here (compose.yaml, docker-compose.yml) and no -f FILE")


def _config(up: dk.ComposeUp, files: tuple[str, ...], env: Mapping[str, str]) -> dict[str, Any]:
    """`compose config`, as JSON (v2) or YAML (docker-compose 1.x, where PyYAML is installed)."""
    yaml = _yaml_loader()
    base = [*up.tool, *(w for o in up.globals if o.name != "file" for w in o.words()), *(f"--file={f}" for f in files)]
    as_json = up.tool[-1] == "compose" or yaml is None
    code, out, err = docker_out([*base, "config", *(["--format", "json"] if as_json else [])], env)
    if code != 0:
        line = (err.strip().splitlines() or [f"exit code {code}"])[-1]
        if yaml is None and up.tool[-1] != "compose":
            line += " (docker-compose 1.x prints its config as YAML only: install PyYAML, or use docker compose v2)"
        raise ContainerError(f"{' '.join(up.tool)} config: {line}", code if code in (124, 127) else 2)
    try:
        doc = json.loads(out) if as_json or yaml is None else yaml(out)
    except Exception as exc:  # json's ValueError, PyYAML's YAMLError: whatever compose printed, one line
        raise ContainerError(f"compose config: not a compose document: {type(exc).__name__}") from None
    if not isinstance(doc, dict):
        raise ContainerError("compose config: not a compose document")
    return doc


def _yaml_loader() -> Callable[[str], Any] | None:
    """PyYAML's safe_load where it is installed (docker-compose 1.x's config), else None."""
    try:
        import yaml
    except ImportError:
        return None
    load: Callable[[str], Any] = yaml.safe_load
    return load


def _compose(up: dk.ComposeUp, env: Mapping[str, str]) -> Container:
    if len(up.services) > 1:
        raise ContainerError("compose up: launch starts one service: name one (sparkwatch launch -- … up SERVICE)")
    files = compose_files(up, env)
    config = _config(up, files, env)
    try:
        svc = cs.service_of(config, up.services[0] if up.services else None, os.getcwd())
    except ValueError as exc:
        raise ContainerError(str(exc)) from None
    image = _image(up.docker, svc.image, env) if svc.image else {}
    cenv = cs.container_env(_list(image, "Env") or (), [f"{k}={v}" for k, v in svc.environment.items()], {})
    if svc.entrypoint is not None:  # compose, as docker: an entrypoint given resets the image's command
        inner = (*svc.entrypoint, *(svc.command or ()))
    else:
        inner = cs.entry_and_command(None, svc.command or (), _list(image, "Entrypoint"), _list(image, "Cmd"))
    version = config.get("version")
    return Container(
        docker=up.docker, image=svc.image, engine=cs.engine_argv(inner), env=cenv, mounts=svc.mounts,
        restart=svc.restart, detach=up.detach,
        user=str(image.get("User") or "") or None, compose=up, service=svc, files=files,
        version=str(version) if version else None,
    )  # fmt: skip
