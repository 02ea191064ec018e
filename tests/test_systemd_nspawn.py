"""The shipped units under a real systemd (252, Debian bookworm) as PID 1 of a systemd-nspawn container.

One container for the module (tests/nspawn.py: a cached root, wheels built from the working tree, a venv inside);
every test starts from the shipped system unit freshly restarted on the base config. What is proved, each on its own:
READY (Type=notify), the watchdog restarting a stopped guard, telemetry restarted alone, a reload applied and a
broken one refused, the kernel log read under the system unit (an NVRM line written from the host: same kernel), a
kill through cgroup.kill of an engine running as its own service, and the user unit under `tester`'s user manager.

Needs root, systemd-nspawn and mmdebstrap (apt: systemd-container, mmdebstrap); skipped otherwise, a failure under
SPARKWATCH_TEST_REQUIRE_TOOLS=1 (CI). Run it alone with `pytest -m nspawn` (docs/systemd.md).
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sparkwatch.core.kill.budget import memory_high_bytes
from sparkwatch.core.units import GiB
from tests import nspawn
from tests.conftest import require
from tests.kmsgwriter import kmsg_writable_reason, write_kmsg

pytestmark = [pytest.mark.nspawn, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
UNIT = "sparkwatch.service"
EVENTS = "/var/lib/sparkwatch/events.jsonl"
CONFIG = "/etc/sparkwatch/config.toml"  # the system unit's XDG_CONFIG_HOME=/etc
METRICS_URL = "http://127.0.0.1:9847/metrics"
# Far under this VM's MemAvailable, so the guard never fires unless a test asks it to.
BASE_CONFIG = 'floor = "2GiB"\nwarn_headroom = "1GiB"\n'
CAP_SYSLOG = 34  # include/uapi/linux/capability.h


@pytest.fixture(scope="module")
def ct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[nspawn.Container]:
    reason = nspawn.missing_reason()
    require(reason is None, reason or "")
    t0 = time.monotonic()
    nspawn.build_root()
    wheels = nspawn.build_wheels()
    prepared_s = time.monotonic() - t0
    log = tmp_path_factory.mktemp("nspawn") / "console.log"
    binds = [
        (wheels.deps, "/wheels/deps"),
        (wheels.project, "/wheels/project"),
        (REPO / "tests" / "helpers", "/helpers"),
    ]
    c = nspawn.Container(name=f"sw-it-{os.getpid()}", log_path=log, binds_ro=binds)
    c.boot()
    try:
        t1 = time.monotonic()
        c.sh(
            "python3 -m venv /opt/sw\n"
            "/opt/sw/bin/pip install --quiet --no-index --find-links /wheels/deps --find-links /wheels/project "
            "sparkwatch setproctitle\n"
            "ln -sf /opt/sw/bin/sparkwatch /usr/local/bin/sparkwatch\n"  # the shipped system unit's ExecStart
            "install -d -o tester -g tester /home/tester/.local /home/tester/.local/bin /home/tester/.config\n"
            "ln -sf /opt/sw/bin/sparkwatch /home/tester/.local/bin/sparkwatch\n",  # the user unit's %h/.local/bin
            timeout_s=300,
        )
        # The shipped units as they are in the repository (rendered from sparkwatch/unit_templates/).
        c.write(f"/etc/systemd/system/{UNIT}", (REPO / "units" / "sparkwatch-system.service").read_text())
        user_unit = f"/home/tester/.config/systemd/user/{UNIT}"
        c.write(user_unit, (REPO / "units" / "sparkwatch.service").read_text())
        c.run(["chown", "-R", "tester:tester", "/home/tester/.config"])
        c.run(["systemctl", "daemon-reload"])
        print(
            f"nspawn: root and wheels {prepared_s:.1f} s, boot {c.boot_s:.2f} s, "
            f"venv + install {time.monotonic() - t1:.1f} s"
        )
        yield c
    finally:
        how = c.stop()
        print(f"nspawn: stopped ({how})")


class SystemUnit:
    """The shipped system unit in the container, and what the tests read from it."""

    def __init__(self, ct: nspawn.Container) -> None:
        self.ct = ct
        self.cursor = self.journal_cursor()

    def show(self, prop: str) -> str:
        return self.ct.run(["systemctl", "show", "-p", prop, "--value", UNIT]).stdout.strip()

    def main_pid(self) -> int:
        return int(self.show("MainPID"))

    def active(self) -> str:
        return self.ct.run(["systemctl", "is-active", UNIT], check=False).stdout.strip()

    def telemetry_pid(self, main: int) -> int | None:
        out = self.ct.run(["ps", "-o", "pid=,comm=", "--ppid", str(main)], check=False).stdout
        pids = [
            int(pid) for pid, comm in (line.split(None, 1) for line in out.splitlines()) if comm == "sparkwatch-tel"
        ]
        return pids[0] if pids else None

    def journal_cursor(self) -> str:
        out = self.ct.run(["journalctl", "-n", "0", "--show-cursor", "--no-pager"]).stdout
        return out.rsplit("-- cursor: ", 1)[1].strip()

    def journal(self) -> str:
        """This unit's journal since the test began (sparkwatch's lines and systemd's about the unit)."""
        argv = ["journalctl", "-u", UNIT, "-o", "cat", "--no-pager", f"--after-cursor={self.cursor}"]
        return self.ct.run(argv).stdout

    def events(self) -> list[dict[str, object]]:
        text = self.ct.run(["cat", EVENTS], check=False).stdout
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def metrics(self) -> dict[str, float]:
        """The exposition, fetched inside (minbase has no curl: the venv's urllib)."""
        code = f"import urllib.request; print(urllib.request.urlopen({METRICS_URL!r}, timeout=5).read().decode())"
        done = self.ct.run(["/opt/sw/bin/python", "-c", code], check=False, timeout_s=15)
        if done.returncode != 0:
            return {}
        out = {}
        for line in done.stdout.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def wait(self, what: str, predicate: Callable[[], bool], timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not after {timeout_s:.0f} s\n--- journal:\n{self.journal()[-4000:]}")
            time.sleep(0.1)

    def metric_after(self, name: str, predicate: Callable[[float], bool], timeout_s: float = 20.0) -> float:
        seen: list[float] = []

        def ok() -> bool:
            value = self.metrics().get(name)
            if value is not None:
                seen.append(value)
            return value is not None and predicate(value)

        self.wait(f"{name} (seen: {seen[-3:]})", ok, timeout_s)
        return seen[-1]


@pytest.fixture
def unit(ct: nspawn.Container) -> Iterator[SystemUnit]:
    """The shipped system unit, restarted on the base config (tests run in random order: none leans on another)."""
    u = SystemUnit(ct)
    ct.write(CONFIG, BASE_CONFIG)
    ct.run(["systemctl", "reset-failed", UNIT], check=False)
    ct.run(["systemctl", "restart", UNIT], timeout_s=60)  # Type=notify: returns once READY=1 came
    yield u


def test_ready_under_the_shipped_system_unit(unit: SystemUnit) -> None:
    """Type=notify: active only after READY=1, the STATUS= line shown, and the guard as the main PID holding the
    unit's capabilities (CAP_SYSLOG among them: the kernel log)."""
    assert unit.active() == "active"
    assert unit.show("Type") == "notify" and unit.show("SubState") == "running"
    assert unit.show("StatusText").startswith("MemAvailable "), unit.show("StatusText")
    main = unit.main_pid()
    status = unit.ct.read(f"/proc/{main}/status")
    caps = {k: int(v, 16) for k, v in re.findall(r"^(Cap\w+):\s+([0-9a-f]+)$", status, re.M)}
    assert caps["CapEff"] & (1 << CAP_SYSLOG), status
    assert caps["CapBnd"] == sum(1 << b for b in (5, 14, 19, 2, 34)), hex(caps["CapBnd"])  # KILL IPC_LOCK PTRACE DAC_RS
    unit.wait("the telemetry process", lambda: unit.telemetry_pid(main) is not None)
    assert "sparkwatch: running: floor 2048 MiB" in unit.journal()


def test_watchdog_restarts_a_stopped_guard(unit: SystemUnit) -> None:
    """SIGSTOP the guard: no more WATCHDOG=1, and WatchdogSec=10s has systemd kill and restart it."""
    old = unit.main_pid()
    restarts = int(unit.show("NRestarts"))
    t0 = time.monotonic()
    unit.ct.run(["kill", "-STOP", str(old)])
    unit.wait(
        "a new main PID after the watchdog",
        lambda: unit.main_pid() not in (0, old) and unit.active() == "active",
        timeout_s=45,
    )
    took_s = time.monotonic() - t0
    assert int(unit.show("NRestarts")) == restarts + 1
    journal = unit.journal()
    assert "Watchdog timeout" in journal, journal[-3000:]
    assert 9.0 < took_s < 40.0, took_s  # the 10 s watchdog, then RestartSec=2s; never before the watchdog fired
    print(f"watchdog: a stopped guard was replaced after {took_s:.1f} s")


def test_telemetry_is_restarted_alone(unit: SystemUnit) -> None:
    """SIGKILL the telemetry process: the guard (main PID) stays, a new telemetry child comes, an event says so."""
    main = unit.main_pid()
    unit.wait("the telemetry process", lambda: unit.telemetry_pid(main) is not None)
    tel = unit.telemetry_pid(main)
    assert tel is not None
    before = len(unit.events())
    restarts = int(unit.show("NRestarts"))
    unit.ct.run(["kill", "-KILL", str(tel)])
    unit.wait("a new telemetry process", lambda: unit.telemetry_pid(main) not in (None, tel))
    assert unit.main_pid() == main and unit.active() == "active"
    restarted = [e for e in unit.events()[before:] if e["kind"] == "component_restarted"]
    assert restarted and restarted[0]["component"] == "telemetry", unit.events()[before:]
    assert int(unit.show("NRestarts")) == restarts  # the unit itself was not restarted


def test_reload_is_applied_and_a_broken_one_refused(unit: SystemUnit) -> None:
    main = unit.main_pid()
    unit.metric_after("sparkwatch_memory_floor_bytes", lambda v: v == 2 * GiB)

    unit.ct.write(CONFIG, BASE_CONFIG.replace('floor = "2GiB"', 'floor = "3GiB"'))
    unit.ct.run(["systemctl", "reload", UNIT])
    unit.wait("the reload's log lines", lambda: re.search(r"reload: \S+ applied .*floor", unit.journal()) is not None)
    journal = unit.journal()
    assert "reload: floor: 2.0 GiB → 3.0 GiB" in journal, journal[-3000:]
    unit.metric_after("sparkwatch_memory_floor_bytes", lambda v: v == 3 * GiB)
    assert unit.main_pid() == main and unit.active() == "active"

    # A misspelt key: refused whole, the running config kept, the unit still active with the same guard.
    unit.ct.write(CONFIG, 'flor = "5GiB"\n')
    unit.ct.run(["systemctl", "reload", UNIT])
    unit.wait("the refusal", lambda: "keeping the running config" in unit.journal())
    refusal = next(line for line in unit.journal().splitlines() if "keeping the running config" in line)
    assert "reload: config error:" in refusal and "flor" in refusal, refusal
    time.sleep(1.5)  # what a wrongly applied config would have changed by now (state goes out at least once a second)
    assert unit.metrics()["sparkwatch_memory_floor_bytes"] == 3 * GiB
    assert unit.main_pid() == main and unit.active() == "active"
    assert "floor 3 GiB" in unit.show("StatusText")


def test_system_unit_reads_the_kernel_log(unit: SystemUnit) -> None:
    """An NVRM line written into /dev/kmsg on the host (one kernel, one ring) is read by the guard in the unit.

    Written by a process, the kernel gives it the user facility: sparkwatch counts it as read
    (kernel_log_lines_total) and as injected, not the driver's (kernel_log_injected_lines_total), and acts on it only
    with kernel_log_accept_injected (off here)."""
    assert unit.metric_after("sparkwatch_kernel_log_readable", lambda v: True) == 1.0, unit.journal()[-3000:]
    assert "kernel log not readable" not in unit.journal()
    reason = kmsg_writable_reason()
    if reason is not None:  # on a GPU host: no fake Xid/NVRM lines for its health agents to act on
        pytest.skip(reason)
    lines = unit.metrics()["sparkwatch_kernel_log_lines_total"]
    injected = unit.metrics()["sparkwatch_kernel_log_injected_lines_total"]
    tag = uuid.uuid4().hex[:8]
    # Neither an allocation failure nor an Xid: no sparkwatch on this host acts on it, accept_injected or not.
    write_kmsg([f"NVRM: sparkwatch nspawn test {tag}: written from the host"])
    unit.metric_after("sparkwatch_kernel_log_injected_lines_total", lambda v: v >= injected + 1)
    assert unit.metrics()["sparkwatch_kernel_log_lines_total"] >= lines + 1
    assert "ignoring NVRM lines written into the kernel log by a process" in unit.journal()
    assert "kernel log not readable" not in unit.journal()


def test_the_system_unit_sees_dev_kmsg_but_not_proc_kmsg(ct: nspawn.Container) -> None:
    """What the shipped system unit's sandbox lets a process see, run as a copy of the unit with another ExecStart:
    /dev/kmsg is the device and reads; /proc/kmsg (reads consume rsyslog's lines) and syslog(2) stay closed."""
    shipped = (REPO / "units" / "sparkwatch-system.service").read_text()
    copy = re.sub(r"(?m)^ExecStart=.*$", "ExecStart=/opt/sw/bin/python /helpers/kmsg_probe.py", shipped)
    copy = re.sub(r"(?m)^(Type=notify|WatchdogSec=.*|ExecReload=.*|Restart=always)$", "", copy)
    copy = copy.replace("[Service]\n", "[Service]\nType=oneshot\nStandardOutput=truncate:/run/kmsg-probe.out\n", 1)
    ct.write("/etc/systemd/system/sw-kmsg-probe.service", copy)
    ct.run(["systemctl", "daemon-reload"])
    ct.run(["systemctl", "start", "sw-kmsg-probe.service"])
    dev, proc, klog = ct.read("/run/kmsg-probe.out").split()
    assert dev == "crw-r--r--:1:11", dev  # opened, and the device
    # InaccessiblePaths=-/proc/kmsg: an empty mode-000 file over it, which the unit's CAP_DAC_READ_SEARCH opens and
    # reads nothing from. Without the line the unit opens what is there: on a host the real -r-------- file, in
    # nspawn the FIFO nspawn puts there for the container's journald (prw-------, seen when the line was removed).
    assert proc == "----------", proc
    assert klog == "EPERM", klog  # syslog(2) is not in @system-service: SystemCallFilter= refuses it


def test_a_hidden_kernel_log_is_not_called_readable(ct: nspawn.Container) -> None:
    """The issue's case: /dev/kmsg a bind mount over an empty file (what nspawn's --bind=/dev/kmsg makes), and a
    service with ProtectKernelLogs=yes and CAP_DAC_READ_SEARCH (the old system unit's). It finds an empty mode-000
    regular file there and opens it; sparkwatch must say that this is not the kernel log, not "readable"."""
    ct.sh("mknod -m 644 /run/kmsg-node c 1 11; rm /dev/kmsg; touch /dev/kmsg; mount --bind /run/kmsg-node /dev/kmsg")
    try:
        done = ct.unit(
            ["/opt/sw/bin/sparkwatch", "doctor", "--json"],
            "ProtectKernelLogs=yes",
            "CapabilityBoundingSet=CAP_KILL CAP_IPC_LOCK CAP_SYS_PTRACE CAP_DAC_READ_SEARCH",
            "Environment=XDG_CONFIG_HOME=/etc",
        )
        checks = {c["id"]: c for c in json.loads(done.stdout)["checks"]}
        log = checks["kernel-log"]
        assert log["status"] == "warn", log
        assert "/dev/kmsg is an empty regular file (mode 000), not the kernel log device" in log["summary"], log
    finally:
        ct.sh("umount /dev/kmsg; rm -f /dev/kmsg /run/kmsg-node; mknod -m 644 /dev/kmsg c 1 11")


def test_kill_through_cgroup_kill(unit: SystemUnit) -> None:
    """An engine-shaped tree (VLLM::EngineCore and a worker) running as its own transient service is alone in its
    cgroup: with the floor over MemAvailable the guard kills it through cgroup.kill."""
    ct = unit.ct
    engine = f"sw-engine-{uuid.uuid4().hex[:6]}"
    pidfile = f"/run/{engine}.pids"
    argv = ["/opt/sw/bin/python", "/helpers/fake_engine.py", "--title", "VLLM::EngineCore"]
    argv += ["--worker", "VLLM::Worker_TP0", "--pidfile", pidfile]
    ct.run(["systemd-run", "--quiet", f"--unit={engine}", "--service-type=exec", *argv])
    try:
        unit.wait(
            "the engine's two processes", lambda: len(ct.run(["cat", pidfile], check=False).stdout.splitlines()) >= 2
        )
        pids = {int(line.split()[0]) for line in ct.read(pidfile).splitlines()}
        assert f"/system.slice/{engine}.service" in ct.read(f"/proc/{min(pids)}/cgroup")
        total = re.search(r"^MemTotal:\s+(\d+) kB", ct.read("/proc/meminfo"), re.M)
        assert total is not None
        floor_mib = int(total.group(1)) // 1024 - 64  # over MemAvailable from the first sample (see tests/conftest.py)
        before = len(unit.events())
        ct.write(CONFIG, f'floor = "{floor_mib}MiB"\nrearm_headroom = "1MiB"\nwarn_headroom = "1GiB"\n')
        ct.run(["systemctl", "restart", UNIT])

        def killed() -> bool:
            return any(e["kind"] == "kill" for e in unit.events()[before:])

        unit.wait("a kill event", killed, timeout_s=30)
        kill = next(e for e in unit.events()[before:] if e["kind"] == "kill")
        assert kill["method"] == "cgroup.kill+pidfd", kill
        victims = kill["victims"]
        assert isinstance(victims, list) and {v["pid"] for v in victims} == pids, kill
        unit.wait(
            f"{engine} gone", lambda: ct.run(["systemctl", "is-active", engine], check=False).stdout.strip() != "active"
        )
        assert (
            ct.run(["sh", "-c", f"cat /sys/fs/cgroup/system.slice/{engine}.service/cgroup.procs"], check=False).stdout
            == ""
        )
    finally:
        ct.run(["systemctl", "stop", engine], check=False)
        ct.run(["systemctl", "reset-failed", engine], check=False)
        ct.write(CONFIG, BASE_CONFIG)  # no guard left firing at every engine for the tests that follow
        ct.run(["systemctl", "restart", UNIT], check=False)


def test_the_system_guard_publishes_its_state_for_every_user(unit: SystemUnit) -> None:
    """/run/sparkwatch/guard.json (the unit's RuntimeDirectory, writable under ProtectSystem=strict): root's, 0644 in
    a 0755 directory. `tester` reads it: status and doctor find the system guard armed at its floor, and tester's
    launch says the system guard took its declaration (the system guard reads every /run/user/*/ declaration)."""
    main = unit.main_pid()
    unit.wait(
        "guard.json", lambda: unit.ct.run(["test", "-f", "/run/sparkwatch/guard.json"], check=False).returncode == 0
    )
    modes = unit.ct.run(["stat", "-c", "%U %a", "/run/sparkwatch", "/run/sparkwatch/guard.json"]).stdout.split()
    assert modes == ["root", "755", "root", "644"], modes
    status = unit.ct.as_tester(["/opt/sw/bin/sparkwatch", "status", "--once"])
    assert f"GUARD      guard pid {main} (root), armed, floor 2.0 GiB" in status.stdout, status.stdout
    doctor = unit.ct.as_tester(["/opt/sw/bin/sparkwatch", "doctor", "--json"], check=False)
    check = next(c for c in json.loads(doctor.stdout)["checks"] if c["id"] == "guard")
    assert check["status"] == "ok" and f"guard pid {main} (root), armed" in check["summary"], check
    argv = ["/opt/sw/bin/sparkwatch", "launch", "--budget", "1GiB", "--settle-timeout", "0", "--", "sleep", "4"]
    launched = unit.ct.as_tester(argv, check=False)
    assert launched.returncode == 0, launched.stderr
    assert f"sparkwatch: guard pid {main} (armed) took it: its budget 1.0 GiB is enforced" in launched.stderr, (
        launched.stderr
    )
    unit.ct.run(["systemctl", "stop", UNIT])
    try:
        assert unit.ct.run(["test", "-e", "/run/sparkwatch/guard.json"], check=False).returncode != 0  # removed
    finally:
        unit.ct.run(["systemctl", "start", UNIT], timeout_s=60)


def test_a_restart_keeps_root_s_launch_declarations(unit: SystemUnit) -> None:
    """/run/sparkwatch holds root's launch declarations (launched/): RuntimeDirectoryPreserve=yes keeps the directory
    across a stop and a restart, where systemd would otherwise delete it and the guard forget root's engines."""
    unit.ct.run(["mkdir", "-p", "/run/sparkwatch/launched"])
    unit.ct.write("/run/sparkwatch/launched/kept", "a file of root's\n")
    unit.ct.run(["systemctl", "restart", UNIT], timeout_s=60)
    assert unit.ct.read("/run/sparkwatch/launched/kept") == "a file of root's\n"
    unit.ct.run(["systemctl", "stop", UNIT])
    try:
        assert unit.ct.run(["test", "-f", "/run/sparkwatch/launched/kept"], check=False).returncode == 0
    finally:
        unit.ct.run(["rm", "-f", "/run/sparkwatch/launched/kept"], check=False)
        unit.ct.run(["systemctl", "start", UNIT], timeout_s=60)


def test_user_unit_under_the_user_manager(ct: nspawn.Container) -> None:
    """The shipped user unit under tester's (lingering) user manager: READY, and the kernel log is not readable
    where kernel.dmesg_restrict=1, with the hint to run the system unit, which the test above shows reads it."""
    ct.run(["systemctl", "stop", UNIT])  # one of the two on a node, never both (docs/systemd.md)
    assert ct.run(["systemctl", "is-active", "user@1000.service"]).stdout.strip() == "active"
    cursor = SystemUnit(ct).cursor
    ct.as_tester(["systemctl", "--user", "daemon-reload"])
    try:
        ct.as_tester(["systemctl", "--user", "restart", UNIT])
        assert ct.as_tester(["systemctl", "--user", "is-active", UNIT]).stdout.strip() == "active"
        main = int(ct.as_tester(["systemctl", "--user", "show", "-p", "MainPID", "--value", UNIT]).stdout)
        assert ct.run(["ps", "-o", "uid=", "-p", str(main)]).stdout.strip() == "1000"
        # Its published state, in its runtime dir (RuntimeDirectory=, writable under ProtectSystem=strict): tester's.
        published = "/run/user/1000/sparkwatch/guard.json"
        deadline = time.monotonic() + 20
        while ct.run(["test", "-f", published], check=False).returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ct.run(["stat", "-c", "%U %a", published]).stdout.split() == ["tester", "644"]
        status = ct.as_tester(["/opt/sw/bin/sparkwatch", "status", "--once"]).stdout
        assert f"GUARD      guard pid {main} (uid 1000), armed" in status, status
        if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1":
            deadline = time.monotonic() + 20
            journal = ""
            while "kernel log not readable" not in journal and time.monotonic() < deadline:
                argv = ["journalctl", "_UID=1000", "-o", "cat", "--no-pager", f"--after-cursor={cursor}"]
                journal = ct.run(argv).stdout
                time.sleep(0.2)
            line = next((x for x in journal.splitlines() if "kernel log not readable" in x), "")
            assert "run the system unit (sudo sparkwatch install-service --system" in line, journal[-3000:]
    finally:
        ct.as_tester(["systemctl", "--user", "stop", UNIT], check=False)


def test_launch_runs_the_engine_in_its_own_scope_under_the_user_manager(ct: nspawn.Container) -> None:
    """`sparkwatch launch` as tester, with a real user manager: the command runs in its own transient scope
    (sparkwatch-launch-<pid>.scope, what the guard's footprint counts as the tree's cgroup), whose MemoryHigh sits
    one margin above the guard's kill limit for the budget, so the kernel's throttle never pre-empts the kill."""
    show = (
        'cg=$(sed -n "s/^0:://p" /proc/self/cgroup); echo "cgroup $cg"; '
        'echo "high $(systemctl --user show -p MemoryHigh --value "${cg##*/}")"'
    )  # the unit's property: this container's user subtree has no memory controller, so no memory.high file
    done = ct.as_tester(
        ["/opt/sw/bin/sparkwatch", "launch", "--budget", "1GiB", "--settle-timeout", "0", "--", "sh", "-c", show],
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.startswith(("cgroup ", "high ")))
    assert re.search(r"/user@1000\.service/.*/sparkwatch-launch-\d+\.scope$", lines["cgroup"]), done.stdout
    assert int(lines["high"]) == memory_high_bytes(1 * GiB), done.stdout
