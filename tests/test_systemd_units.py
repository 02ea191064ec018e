"""The units (shipped and generated) under the real `systemd-analyze verify`, and `sparkwatch install-service`."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from sparkwatch.cli import main
from sparkwatch.cli.install_service import (
    SHIPPED_EXEC_START,
    SHIPPED_FILES,
    exec_start,
    install,
    render_unit,
)
from tests.conftest import require, require_tool

REPO = Path(__file__).resolve().parent.parent


def root_owns_this_sparkwatch() -> bool:
    """Whether the system unit would run this checkout (root owns it, its venv and every directory above them)."""
    # Imported here: on a sparkwatch without the check, the tests that need it fail, not this module's import.
    from sparkwatch.cli.install_service import root_runs_user_code

    return root_runs_user_code() is None


def verify(unit: Path, user: bool, tmp_path: Path, home: Path | None = None) -> None:
    """`systemd-analyze verify` must exit 0 and print nothing: unknown keys and bad syscall names are only warnings
    (exit 0), so any output is a failure too."""
    analyze = require_tool("systemd-analyze")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSTEMD_")}
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700, exist_ok=True)
    env["XDG_RUNTIME_DIR"] = str(runtime)  # the user manager `--user` builds needs one
    if home is not None:
        env["HOME"] = str(home)
    argv = [analyze, "verify", *(["--user"] if user else []), str(unit)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", (done.returncode, done.stderr)


def unit_keys(text: str) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            k, _, v = line.partition("=")
            keys.setdefault(k, []).append(v)
    return keys


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_shipped_units_are_the_rendered_templates(system: bool) -> None:
    shipped = (REPO / "units" / SHIPPED_FILES[system]).read_text()
    expected = render_unit(system, SHIPPED_EXEC_START[system])
    assert shipped == expected, "regenerate units/ from sparkwatch/unit_templates/"


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_generated_unit_verifies(system: bool, tmp_path: Path) -> None:
    unit = tmp_path / "sparkwatch.service"
    unit.write_text(render_unit(system, exec_start()))
    verify(unit, user=not system, tmp_path=tmp_path)


def test_shipped_user_unit_verifies_with_its_own_execstart(tmp_path: Path) -> None:
    """The shipped user unit runs %h/.local/bin/sparkwatch: give it a HOME where that exists."""
    home = tmp_path / "home"
    (home / ".local" / "bin").mkdir(parents=True)
    (home / ".local" / "bin" / "sparkwatch").symlink_to(sys.executable)
    unit = tmp_path / "sparkwatch.service"
    unit.write_text((REPO / "units" / "sparkwatch.service").read_text())
    verify(unit, user=True, tmp_path=tmp_path, home=home)


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key and an unknown syscall are caught."""
    unit = tmp_path / "sparkwatch.service"
    text = render_unit(True, exec_start()).replace("WatchdogSec=", "WatchdogSecs=")
    unit.write_text(text.replace("process_mrelease", "process_mrelaese"))
    with pytest.raises(AssertionError, match="WatchdogSecs"):
        verify(unit, user=False, tmp_path=tmp_path)


@pytest.mark.parametrize("system", [False, True], ids=["user", "system"])
def test_units_carry_what_the_guard_needs(system: bool) -> None:
    k = unit_keys(render_unit(system, "/usr/bin/sparkwatch run"))
    assert k["Type"] == ["notify"] and k["Restart"] == ["always"]
    assert k["WatchdogSec"] == ["10s"]
    assert k["RestartPreventExitStatus"] == ["2"]  # a bad config is not restarted in a loop
    assert k["MemoryMax"] == ["160M"] and k["LimitMEMLOCK"] == ["infinity"]
    assert k["SystemCallFilter"] == ["@system-service pidfd_open pidfd_send_signal process_mrelease"]
    assert k["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6 AF_NETLINK"]
    assert k["ProtectSystem"] == ["strict"] and k["NoNewPrivileges"] == ["yes"]
    assert "ProtectControlGroups" not in k and "ProtectKernelTunables" not in k  # cgroup.kill must stay writable
    # Launch's declarations live in the RuntimeDirectory (root's in /run/sparkwatch/launched): a restart keeps them.
    assert k["RuntimeDirectory"] == ["sparkwatch"] and k["RuntimeDirectoryPreserve"] == ["yes"]
    if system:
        assert k["User"] == ["root"] and "CAP_KILL" in k["CapabilityBoundingSet"][0]
        assert k["OOMScoreAdjust"] == ["-900"]
        # It reads the kernel log: CAP_SYSLOG for kernel.dmesg_restrict=1, no ProtectKernelLogs (which hides
        # /dev/kmsg and drops CAP_SYSLOG again); /proc/kmsg (a consuming read, rsyslog's) stays hidden. The
        # nspawn test (tests/test_systemd_nspawn.py) shows the line read under a real systemd.
        caps = k["CapabilityBoundingSet"][0].split()
        assert caps == ["CAP_KILL", "CAP_IPC_LOCK", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_SYSLOG"]
        assert k["ProtectKernelLogs"] == ["no"] and k["InaccessiblePaths"] == ["-/proc/kmsg"]
        for key in ("ProtectKernelModules", "ProtectClock", "ProtectHostname", "PrivateTmp", "LockPersonality"):
            assert k[key] == ["yes"], key
        assert k["PrivateDevices"] == ["no"] and k["ProtectHome"] == ["read-only"]
    else:
        assert k["ReadWritePaths"] == ["%S/sparkwatch"] and k["StateDirectory"] == ["sparkwatch"]
        assert "User" not in k


def test_exec_start_uses_the_running_venv() -> None:
    line = exec_start()
    script = Path(sys.executable).parent / "sparkwatch"
    if script.is_file():
        assert line == f"{script} run"
    else:
        assert line == f"{os.path.abspath(sys.executable)} -m sparkwatch run"
    assert line.startswith("/")


def test_exec_start_quotes_and_escapes(tmp_path: Path) -> None:
    odd = tmp_path / "my venv%1$x" / "bin"
    odd.mkdir(parents=True)
    (odd / "python3").symlink_to(sys.executable)
    config = tmp_path / "cfg $HOME" / "config.toml"
    line = exec_start(str(odd / "python3"), config=config)
    quoted_python = f'"{odd}/python3"'.replace("%1$x", "%%1$x")  # the command: % doubled, $ taken literally
    quoted_config = f'"{config}"'.replace("$HOME", "$$HOME")  # an argument: $ doubled too
    assert line == f"{quoted_python} -m sparkwatch run --config {quoted_config}"
    unit = tmp_path / "sparkwatch.service"
    unit.write_text(render_unit(True, line))
    verify(unit, user=False, tmp_path=tmp_path)  # systemd reads the quoted, escaped path back as the real one


class Recorder:
    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, argv: Sequence[str]) -> tuple[int, str]:
        self.calls.append(list(argv))
        if self.fail_on is not None and self.fail_on in argv:
            return 1, "Failed to connect to bus: No medium found"
        return 0, ""


def fake_systemd_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "run" / "systemd" / "system").mkdir(parents=True)
    return root


def test_install_user_unit(tmp_path: Path) -> None:
    root = fake_systemd_root(tmp_path)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg"), "HOME": str(tmp_path)}
    out, err, runner = io.StringIO(), io.StringIO(), Recorder()
    code = install(system=False, start=True, print_only=False, root=root, runner=runner, out=out, err=err, env=env)
    assert code == 0, err.getvalue()
    target = tmp_path / "cfg" / "systemd" / "user" / "sparkwatch.service"
    assert target.read_text() == render_unit(False, exec_start())
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    assert runner.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "sparkwatch.service"],
    ]
    text = out.getvalue()
    for hint in (
        f"wrote {target}",
        "systemctl --user status sparkwatch",
        "journalctl --user -u sparkwatch",
        "journalctl --user SPARKWATCH_EVENT=kill",
        "loginctl enable-linger $USER",
    ):
        assert hint in text, text
    verify(target, user=True, tmp_path=tmp_path)  # what install-service wrote is a valid unit


def test_install_keeps_a_changed_previous_unit_and_no_start(tmp_path: Path) -> None:
    root = fake_systemd_root(tmp_path)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    target = tmp_path / "cfg" / "systemd" / "user" / "sparkwatch.service"
    target.parent.mkdir(parents=True)
    target.write_text("[Service]\nExecStart=/old/sparkwatch run\n")
    out, runner = io.StringIO(), Recorder()
    assert install(system=False, start=False, print_only=False, root=root, runner=runner, out=out, env=env) == 0
    assert (target.parent / "sparkwatch.service.bak").read_text() == "[Service]\nExecStart=/old/sparkwatch run\n"
    assert runner.calls[-1] == ["systemctl", "--user", "enable", "sparkwatch.service"]  # no --now
    assert "systemctl --user start sparkwatch" in out.getvalue()


def test_install_system_unit(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "the system unit install path runs as root")
    require(root_owns_this_sparkwatch(), "the system unit installs only a sparkwatch root owns")
    root = fake_systemd_root(tmp_path)
    out, runner = io.StringIO(), Recorder()
    assert install(system=True, start=True, print_only=False, root=root, runner=runner, out=out) == 0
    target = root / "etc" / "systemd" / "system" / "sparkwatch.service"
    assert "User=root" in target.read_text()
    assert runner.calls == [
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", "sparkwatch.service"],
    ]
    assert "systemctl status sparkwatch" in out.getvalue() and "--user" not in out.getvalue()
    assert "enable-linger" not in out.getvalue()


def test_install_reports_a_failing_systemctl(tmp_path: Path) -> None:
    root = fake_systemd_root(tmp_path)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    err, runner = io.StringIO(), Recorder(fail_on="daemon-reload")
    code = install(
        system=False, start=True, print_only=False, root=root, runner=runner, out=io.StringIO(), err=err, env=env
    )
    assert code == 1
    assert "systemctl --user daemon-reload` failed (exit 1): Failed to connect to bus" in err.getvalue()
    assert "loginctl enable-linger" in err.getvalue()
    assert len(runner.calls) == 1  # stopped at the first failure


def test_install_without_systemd_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "no-systemd"
    root.mkdir()
    env = {"XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    err, runner = io.StringIO(), Recorder()
    code = install(
        system=False, start=True, print_only=False, root=root, runner=runner, out=io.StringIO(), err=err, env=env
    )
    assert code == 1
    assert "systemd is not running here" in err.getvalue() and "--print" in err.getvalue()
    assert runner.calls == [] and not (tmp_path / "cfg").exists()  # nothing written, nothing run


def test_cli_install_service_in_this_container(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The real command here, where PID 1 is not systemd: non-zero and the message, through `sparkwatch` itself."""
    if Path("/run/systemd/system").is_dir():
        pytest.skip("this machine runs systemd")
    assert main(["install-service", "--root", str(tmp_path)]) == 1
    assert "systemd is not running here" in capsys.readouterr().err


def test_cli_print_shows_the_unit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["install-service", "--print"]) == 0
    assert capsys.readouterr().out == render_unit(False, exec_start())
    if not root_owns_this_sparkwatch():  # a checkout or venv not root's (a CI runner's): the refusal, in one line
        assert main(["install-service", "--system", "--print"]) == 1
        assert capsys.readouterr().err.startswith("sparkwatch: refusing the system unit: it runs as root and ")
        return
    assert main(["install-service", "--system", "--print"]) == 0
    assert "User=root" in capsys.readouterr().out


def test_templates_ship_in_the_wheel(tmp_path: Path) -> None:
    """install-service must work from an installed wheel: the templates are package data."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (wheel,) = tmp_path.glob("sparkwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "sparkwatch/unit_templates/sparkwatch.service.in" in names
    assert "sparkwatch/unit_templates/sparkwatch-system.service.in" in names


NOBODY = 65534


def as_user(uid: int, script: str, *args: str) -> None:
    """A shell script as `uid` (its own gid, no supplementary groups) through setpriv, as another local user would."""
    ids = [] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    subprocess.run([*ids, "sh", "-c", script, "sh", *args], check=True, timeout=60)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A directory under /tmp another user may create things in (sticky, like /tmp itself)."""
    path = Path(tempfile.mkdtemp(prefix="sw-unit-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def venv_with_this_sparkwatch(scratch: Path, uid: int, source: Path = REPO) -> Path:
    """A real venv, handed to `uid`, whose site-packages that user points at `source` (this checkout, or a clone of
    its package) and at the test venv's dependencies (a .pth file, as an editable install writes one), so its python
    runs that sparkwatch. Returns the venv. (The venv is made by root and chowned: the interpreter it is made from
    may live where `nobody` cannot run it.)"""
    venv = scratch / "venv"
    base = getattr(sys, "_base_executable", sys.executable)  # the interpreter the test venv was made from
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    for path in [venv, *venv.rglob("*")]:
        os.lchown(path, uid, uid)
    purelib = sysconfig.get_paths()["purelib"]  # the test venv's site-packages: pydantic, prometheus_client, ...
    site = next((venv / "lib").glob("python*/site-packages"))
    as_user(uid, 'printf "%s\\n%s\\n" "$1" "$2" > "$3"', str(source), purelib, str(site / "this-sparkwatch.pth"))
    return venv


def clone_of_this_package(scratch: Path, uid: int) -> Path:
    """The package copied to scratch/clone and handed to `uid`: an editable install from that user's clone."""
    clone = scratch / "clone"
    shutil.copytree(REPO / "sparkwatch", clone / "sparkwatch", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [clone, *clone.rglob("*")]:
        os.lchown(path, uid, uid)
    return clone


def print_system_unit(venv: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "sparkwatch", "install-service", "--system", "--print"],
        capture_output=True, text=True, timeout=60, check=False, cwd="/", env=env,
    )  # fmt: skip


@pytest.mark.parametrize("how", ["owned", "group-writable", "editable-clone"])
def test_the_system_unit_refuses_a_venv_another_user_can_change(scratch: Path, how: str) -> None:
    """`nobody` owns the venv; or root does and left its site-packages writable by nobody's group; or root's venv runs
    sparkwatch from nobody's clone (an editable install): either way nobody could change the code root would run,
    so --system refuses, even with --print, in one line that says how to install for the system."""
    require(os.geteuid() == 0 and shutil.which("setpriv") is not None, "needs root and setpriv to act as nobody")
    clone = clone_of_this_package(scratch, NOBODY) if how == "editable-clone" else REPO
    venv = venv_with_this_sparkwatch(scratch, NOBODY if how == "owned" else 0, clone)
    site = next((venv / "lib").glob("python*/site-packages"))
    if how == "group-writable":
        os.chown(site, 0, NOBODY)
        site.chmod(0o775)
    done = print_system_unit(venv)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout == ""  # no unit printed
    (line,) = done.stderr.splitlines()
    expected = {
        "owned": f"{venv}/bin/python is owned by nobody (uid 65534)",
        "group-writable": f"{site} is writable by group nogroup (gid 65534)",
        "editable-clone": f"{clone}/sparkwatch is owned by nobody (uid 65534)",
    }[how]
    assert f"it runs as root and {expected}, so that user could change the code root runs" in line, line
    assert line.startswith("sparkwatch: refusing the system unit: ")
    assert "sudo python3 -m venv /opt/sparkwatch && sudo /opt/sparkwatch/bin/pip install" in line
    assert "sudo /opt/sparkwatch/bin/sparkwatch install-service --system" in line


def test_the_system_unit_accepts_a_venv_root_owns(scratch: Path) -> None:
    """The same venv made by root, its chain (python's symlink target, this checkout, every parent) root's."""
    require(os.geteuid() == 0, "the system unit's check passes only for root's files")
    require(root_owns_this_sparkwatch(), "this checkout or its venv is not root's")
    venv = venv_with_this_sparkwatch(scratch, 0)
    done = print_system_unit(venv)
    assert done.returncode == 0, done.stderr
    assert f"ExecStart={venv}/bin/python -m sparkwatch run" in done.stdout


def test_the_system_unit_refuses_a_config_another_user_can_edit(scratch: Path) -> None:
    """The code is root's, the --config file nobody's: the file says what root's guard kills and spares, so --system
    refuses it as it refuses code, in one line naming the file."""
    require(os.geteuid() == 0 and shutil.which("setpriv") is not None, "needs root and setpriv to act as nobody")
    require(root_owns_this_sparkwatch(), "this checkout or its venv is not root's")
    venv = venv_with_this_sparkwatch(scratch, 0)
    config = scratch / "config.toml"
    as_user(NOBODY, 'printf "never_kill = [\\".\\"]\\n" > "$1"', str(config))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    argv = [str(venv / "bin" / "python"), "-m", "sparkwatch", "install-service", "--system", "--print"]
    done = subprocess.run(
        [*argv, "--config", str(config)], capture_output=True, text=True, timeout=60, check=False, cwd="/", env=env
    )
    assert done.returncode == 1 and done.stdout == "", done.stdout + done.stderr
    (line,) = done.stderr.splitlines()
    assert f"it reads --config {config} as root and {config} is owned by nobody (uid 65534)" in line, line
    os.chown(config, 0, 0)  # the same file, root's: accepted, and the unit reads it
    done = subprocess.run(
        [*argv, "--config", str(config)], capture_output=True, text=True, timeout=60, check=False, cwd="/", env=env
    )
    assert done.returncode == 0, done.stderr
    assert f"--config {config}" in done.stdout
