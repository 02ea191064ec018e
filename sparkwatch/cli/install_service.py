"""`sparkwatch install-service [--system] [--no-start] [--print]`: install sparkwatch as a systemd service.

The unit is rendered from the template shipped in the package (sparkwatch/unit_templates/*.service.in) with the
absolute path of the interpreter running this command, so it starts the same sparkwatch, venv and all. The user
unit goes to ~/.config/systemd/user/, the system unit (root; for engines run as root or in Docker) to
/etc/systemd/system/; both are named sparkwatch.service, so `systemctl [--user] status sparkwatch` finds either.

The system unit runs as root, so it must run only code root owns: `--system` (with `--print` too) refuses when the
interpreter, its symlink's target, the script, the sparkwatch package (for an editable install, the source tree),
a directory on the import path or a `.pth` file in one, or any directory above any of them up to /, is owned by
another user or writable by one (group- or other-writable; a sticky directory such as /tmp only guards what root
owns in it). A user's venv would otherwise let that user change the code root runs at the next restart.
"""

from __future__ import annotations

import argparse
import grp
import os
import pwd
import shlex
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import sparkwatch

UNIT_NAME = "sparkwatch.service"
USER_TEMPLATE = "sparkwatch.service.in"
SYSTEM_TEMPLATE = "sparkwatch-system.service.in"

# The ExecStart of the units shipped in units/ (for packagers and hand installs): where `pip install --user` and
# `pipx` put the script for the user unit, where `sudo pip install` puts it for the system unit. tests check that
# units/*.service are exactly these renderings of the templates.
SHIPPED_EXEC_START = {False: "%h/.local/bin/sparkwatch run", True: "/usr/local/bin/sparkwatch run"}
SHIPPED_FILES = {False: "sparkwatch.service", True: "sparkwatch-system.service"}

# Runs one command and returns (exit status, combined output). Injectable: tests cannot run a service manager here.
Runner = Callable[[Sequence[str]], tuple[int, str]]


def run_command(argv: Sequence[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]}: command not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)}: timed out after 60 s"
    return done.returncode, (done.stdout + done.stderr).strip()


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "install-service",
        parents=[parent],
        help="install, enable and start sparkwatch as a systemd service (user unit by default)",
        description="Write the systemd unit for this sparkwatch (the user unit, or with --system the system unit "
        "for engines run as root or in Docker), enable it and start it. --print shows the unit and changes "
        "nothing. The unit runs the armed daemon: see `sparkwatch run --help`.",
    )
    p.add_argument(
        "--system",
        action="store_true",
        help="install the system unit (runs as root) for engines run as root or in Docker; needs root, and a "
        "sparkwatch only root can change (a venv root made: docs/systemd.md)",
    )
    p.add_argument("--no-start", action="store_true", help="write and enable the unit, but do not start it now")
    p.add_argument("--print", action="store_true", dest="print_only", help="print the unit and change nothing")
    p.set_defaults(handler=handle)


def _systemd_quote(word: str, command: bool = False) -> str:
    # In ExecStart, '%' starts a specifier everywhere and '$' a variable in the arguments (not in the command
    # itself: systemd-analyze verify reads `$$` there literally); a word with spaces needs double quotes.
    word = word.replace("%", "%%")
    if not command:
        word = word.replace("$", "$$")
    if any(c.isspace() for c in word) or '"' in word or "\\" in word:
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return word


def exec_start(executable: str | None = None, config: Path | None = None) -> str:
    """The command the unit runs: the venv's `sparkwatch` script next to the interpreter if there is one, else
    `<interpreter> -m sparkwatch`. Absolute, and not resolved through symlinks (a venv's python is a symlink to
    the system one, and resolving it would lose the venv)."""
    python = os.path.abspath(executable or sys.executable)
    script = os.path.join(os.path.dirname(python), "sparkwatch")
    argv = [script] if os.access(script, os.X_OK) and os.path.isfile(script) else [python, "-m", "sparkwatch"]
    argv.append("run")
    if config is not None:
        argv += ["--config", os.path.abspath(config)]
    return " ".join(_systemd_quote(a, command=i == 0) for i, a in enumerate(argv))


# `sparkwatch install-service --system` from a venv root owns, said in the refusal.
ROOT_INSTALL_HINT = (
    "install it where only root can write: sudo python3 -m venv /opt/sparkwatch && "
    "sudo /opt/sparkwatch/bin/pip install <this clone, or sparkwatch> && "
    "sudo /opt/sparkwatch/bin/sparkwatch install-service --system"
)
PACKAGE_FILES_MAX = 4096  # the package holds ~150 files; a tree past this is not one to walk from a CLI


def _unsafe(path: str) -> str | None:
    """Why a non-root user could change `path` (it, or a directory above it), or None. Looks at the path as
    written and at where its symlinks lead."""
    seen: set[str] = set()
    for candidate in (os.path.abspath(path), os.path.realpath(path)):
        parts = candidate.split(os.sep)
        for i in range(len(parts), 0, -1):  # the leaf first: its owner is what the message names first
            current = os.sep.join(parts[:i]) or os.sep
            if current in seen:
                continue
            seen.add(current)
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                continue
            except OSError as exc:
                return f"{current} cannot be checked ({exc.strerror})"
            why = _unsafe_inode(current, st)
            if why is not None:
                return why
    return None


def _unsafe_inode(path: str, st: os.stat_result) -> str | None:
    """Root owns it and no one else may write it. A sticky directory (/tmp) writable by all is fine: there no one may
    rename or remove what root owns."""
    if st.st_uid != 0:
        return f"{path} is owned by {_user(st.st_uid)}"
    if stat.S_ISLNK(st.st_mode):
        return None  # a symlink's own mode means nothing; its directory and its target are checked
    sticky_dir = stat.S_ISDIR(st.st_mode) and bool(st.st_mode & stat.S_ISVTX)
    if st.st_mode & stat.S_IWOTH and not sticky_dir:
        return f"{path} is writable by every user"
    if st.st_mode & stat.S_IWGRP and st.st_gid != 0 and not sticky_dir:
        return f"{path} is writable by group {_group(st.st_gid)}"
    return None


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def package_dir() -> str:
    """The sparkwatch package this command runs from: site-packages/sparkwatch, or the clone's for an editable
    install."""
    return os.path.dirname(os.path.abspath(sparkwatch.__file__))


def code_paths(executable: str | None = None) -> list[str]:
    """What the system unit would run: the interpreter, the script beside it, the sparkwatch package, each directory
    on the import path and the `.pth` files in them (the working directory left out: the unit does not run here)."""
    python = os.path.abspath(executable or sys.executable)
    out = [python]
    script = os.path.join(os.path.dirname(python), "sparkwatch")
    if os.path.isfile(script):
        out.append(script)
    out.append(package_dir())
    cwd = os.getcwd()
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == cwd or not os.path.exists(entry):
            continue
        out.append(os.path.abspath(entry))
        if os.path.isdir(entry):
            try:
                out += [os.path.join(entry, n) for n in sorted(os.listdir(entry)) if n.endswith(".pth")]
            except OSError:
                pass
    return out


def root_runs_user_code(executable: str | None = None) -> str | None:
    """The first reason the system unit would run code a non-root user can change, or None (root owns it all)."""
    for path in code_paths(executable):
        why = _unsafe(path)
        if why is not None:
            return why
    package = package_dir()  # and every file and directory in it (its __pycache__ too: Python runs those)
    walked = 0
    for dirpath, dirnames, filenames in os.walk(package):
        for name in [*dirnames, *filenames]:
            walked += 1
            if walked > PACKAGE_FILES_MAX:
                return f"{package} holds over {PACKAGE_FILES_MAX} files: not a sparkwatch package to run as root"
            full = os.path.join(dirpath, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            why = _unsafe_inode(full, st)
            if why is not None:
                return why
    return None


def template(system: bool) -> str:
    name = SYSTEM_TEMPLATE if system else USER_TEMPLATE
    return resources.files("sparkwatch").joinpath("unit_templates", name).read_text(encoding="utf-8")


def system_unit_environment() -> dict[str, str]:
    """The variables the system unit's template sets (`Environment=A=x B=y`): where it keeps its config and state
    (XDG_CONFIG_HOME=/etc, XDG_STATE_HOME=/var/lib), read from the template so that `events` follows it."""
    out: dict[str, str] = {}
    for line in template(True).splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "Environment":
            for word in shlex.split(value):
                name, eq, val = word.partition("=")
                if eq:
                    out[name] = val
    return out


def render_unit(system: bool, command: str) -> str:
    text = template(system)
    if "@EXEC_START@" not in text:
        raise RuntimeError("unit template lacks @EXEC_START@")
    return text.replace("@EXEC_START@", command)


def user_unit_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ if env is None else env)
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(base) / "systemd" / "user"


def _lingering(root: Path) -> bool | None:
    try:
        user = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return None
    return (root / "var/lib/systemd/linger" / user).exists()


def install(
    *,
    system: bool,
    start: bool,
    print_only: bool,
    root: Path = Path("/"),
    config: Path | None = None,
    executable: str | None = None,
    runner: Runner = run_command,
    out: TextIO | None = None,
    err: TextIO | None = None,
    env: dict[str, str] | None = None,
) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    unit = render_unit(system, exec_start(executable, config))
    if system:
        why = root_runs_user_code(executable)
        if why is not None:
            print(
                f"sparkwatch: refusing the system unit: it runs as root and {why}, so that user could change the code "
                f"root runs; {ROOT_INSTALL_HINT}",
                file=err,
            )
            return 1
        # The config is no code, but it says what root's guard may kill and spare (never_kill, ancestor_pid,
        # protect_patterns, engine_budgets, state_dir): a file another user can edit steers the guard as surely.
        why = None if config is None else _unsafe(str(config))
        if why is not None:
            print(
                f"sparkwatch: refusing the system unit: it reads --config {os.path.abspath(config or '')} as root and "
                f"{why}, so that user could steer root's guard; keep the system unit's config where root alone "
                "writes (/etc/sparkwatch/config.toml, the unit's default)",
                file=err,
            )
            return 1
    if print_only:
        out.write(unit)
        return 0
    if not (root / "run/systemd/system").is_dir():
        print(
            "sparkwatch: systemd is not running here (no /run/systemd/system: a container, or another init), so "
            "there is no service manager to install into. Run `sparkwatch run` directly, or under your "
            "supervisor; `sparkwatch install-service --print` shows the unit.",
            file=err,
        )
        return 1
    if system and os.geteuid() != 0:
        me = shlex.join([os.path.abspath(executable or sys.executable), "-m", "sparkwatch", "install-service"])
        print(f"sparkwatch: the system unit needs root: sudo {me} --system", file=err)
        return 1
    scope = [] if system else ["--user"]
    target_dir = root / "etc/systemd/system" if system else user_unit_dir(env)
    target = target_dir / UNIT_NAME
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
        old = target.read_text(encoding="utf-8") if target.exists() else None
        if old is not None and old != unit:
            backup = target.with_name(UNIT_NAME + ".bak")
            backup.write_text(old, encoding="utf-8")
            print(f"kept the previous unit as {backup}", file=out)
        tmp = target.with_name(UNIT_NAME + ".tmp")
        tmp.write_text(unit, encoding="utf-8")
        tmp.chmod(0o644)
        os.replace(tmp, target)
    except OSError as exc:
        print(f"sparkwatch: could not write {target}: {exc.strerror or exc}", file=err)
        return 1
    print(f"wrote {target}", file=out)

    steps = [["systemctl", *scope, "daemon-reload"], ["systemctl", *scope, "enable", *(["--now"] if start else [])]]
    steps[1].append(UNIT_NAME)
    for argv in steps:
        code, output = runner(argv)
        shown = shlex.join(argv)
        if code != 0:
            print(f"sparkwatch: `{shown}` failed (exit {code}): {output}", file=err)
            if not system:
                print(
                    "sparkwatch: a user unit needs your user's service manager: log in through a session (not `su`), "
                    "or run `loginctl enable-linger $USER` first.",
                    file=err,
                )
            return 1
        print(f"ran {shown}", file=out)

    u = " --user" if not system else ""
    lines = [
        "",
        "sparkwatch is "
        + ("enabled and started." if start else f"enabled; start it with: systemctl{u} start sparkwatch"),
        f"  status:  systemctl{u} status sparkwatch",
        f"  logs:    journalctl{u} -u sparkwatch -f",
        f"  kills:   journalctl{u} SPARKWATCH_EVENT=kill",
        f"  reload:  systemctl{u} reload sparkwatch   (after editing the config)",
    ]
    if not system:
        linger = _lingering(root)
        if linger is not True:
            lines.append(
                "  Without a login session a user service stops: run `loginctl enable-linger $USER` so it keeps "
                "running" + (" (lingering is off for you now)." if linger is False else ".")
            )
    print("\n".join(lines), file=out)
    return 0


def handle(args: argparse.Namespace) -> int:
    return install(
        system=args.system,
        start=not args.no_start,
        print_only=args.print_only,
        root=args.root or Path("/"),
        config=args.config,
    )
