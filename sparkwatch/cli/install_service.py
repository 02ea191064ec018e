"""`sparkwatch install-service [--system] [--no-start] [--print]`: install sparkwatch as a systemd service.

The unit is rendered from the template shipped in the package (sparkwatch/unit_templates/*.service.in) with the
absolute path of the interpreter running this command, so it starts the same sparkwatch, venv and all. The user
unit goes to ~/.config/systemd/user/, the system unit (root; for engines run as root or in Docker) to
/etc/systemd/system/; both are named sparkwatch.service, so `systemctl [--user] status sparkwatch` finds either.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

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
        help="install the system unit (runs as root) for engines run as root or in Docker; needs root",
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
