"""The drift watcher's episodes (persisted across restarts), the udev trigger, low headroom, check-config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, read_events
from sparkwatch.config.schema import guard_config
from sparkwatch.config.settings import load_settings
from sparkwatch.core.driver.drift import judge
from sparkwatch.core.enums import DriverProblem
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.report.alerts import RateState, dedup_key, driver_step, headroom_step, rate_limit
from sparkwatch.guard.poolwatch import PoolWatch
from sparkwatch.telemetry.drivercheck import DriverWatcher
from sparkwatch.telemetry.headroom import HeadroomWatcher
from sparkwatch.telemetry.sources.driverfacts import read_driver_facts
from sparkwatch.telemetry.sources.udev import UdevWatcher, is_driver_uevent, parse_uevent
from tests import driverroot as fx
from tests.receiver import wait_until

GiB = 1 << 30


def kinds(state: Path) -> list[str]:
    return [str(e["kind"]) for e in read_events(state / "events.jsonl")]


def watcher(root: Path, state: Path, interval_s: float = 60.0) -> DriverWatcher:
    settings = load_settings(None, {"root": root, "state_dir": state, "driver_check_interval_s": interval_s})
    return DriverWatcher(settings, EventLog(settings.events_path))


def test_episode_alerts_once_and_survives_restart(tmp_path: Path) -> None:
    root = fx.stranded_after_update(tmp_path / "root")
    root.write()
    state = tmp_path / "state"
    w = watcher(root.path, state)
    for _ in range(5):
        report = w.check()
        assert report is not None and report.verdict == "stranded"
    assert kinds(state) == ["driver_stranded"]
    # restart (a new watcher on the same state dir) while still stranded: no second page
    w2 = watcher(root.path, state)
    w2.check()
    assert kinds(state) == ["driver_stranded"]
    # fixed by the reboot into 6.17
    fixed = fx.healthy(root.path)
    fixed.write()
    w3 = watcher(root.path, state)
    w3.check()
    w3.check()
    assert kinds(state) == ["driver_stranded", "driver_recovered"]
    event = read_events(state / "events.jsonl")[-1]
    assert event["cleared"] == ["stranded"] and event["kernel"] == fx.NEW_KERNEL


def test_unreadable_root_does_not_announce_recovery(tmp_path: Path) -> None:
    root = fx.stranded_after_update(tmp_path / "root")
    root.write()
    state = tmp_path / "state"
    w = watcher(root.path, state)
    w.check()
    (root.path / "proc/sys/kernel/osrelease").unlink()
    (root.path / "var/lib/dpkg/status").unlink()
    for path in sorted((root.path / "lib/modules").rglob("*.zst")):
        path.unlink()
    for path in sorted((root.path / "usr/lib").rglob("libnvidia-ml.so*")):
        path.unlink()
    report = w.check()
    assert report is not None and report.verdict in ("unknown", "absent")
    assert kinds(state) == ["driver_stranded"]


def test_will_strand_then_mismatch_each_alert(tmp_path: Path) -> None:
    root = fx.will_strand(tmp_path / "root")
    state = tmp_path / "state"
    _, alerts = driver_step(frozenset(), judge(read_driver_facts(root.write())))
    assert [a.kind for a in alerts] == ["driver_will_strand"]
    opened, alerts = driver_step(
        frozenset({DriverProblem.WILL_STRAND}), judge(read_driver_facts(fx.version_mismatch(root.path).write()))
    )
    assert [a.kind for a in alerts] == ["driver_version_mismatch"] and opened == {"version_mismatch"}
    assert not state.exists()


def test_udev_handler_matches_nvidia_events() -> None:
    seen: list[str] = []
    w = UdevWatcher(seen.append)
    assert w.handle("add", "module", "nvidia", None)
    assert w.handle("remove", "module", "nvidia_uvm", None)
    assert w.handle("bind", "pci", "000f:01:00.0", "nvidia")
    assert w.handle("add", "drm", "card1", "nvidia")
    assert not w.handle("add", "module", "snd_hda_intel", None)
    assert not w.handle("add", "block", "nvme0n1", None)
    assert not w.handle("online", "module", "nvidia", None)
    assert seen == [
        "uevent add module/nvidia",
        "uevent remove module/nvidia_uvm",
        "uevent bind pci/000f:01:00.0",
        "uevent add drm/card1",
    ]
    assert is_driver_uevent("add", "nvidia-caps", "nvidia-cap1", None)


# As the kernel sends them (lib/kobject_uevent.c): the first captured here from /dev/null's sysfs uevent file, the
# others shaped as a module's removal and a PCI device's bind (drivers/base/dd.c, DRIVER= added) are.
NULL_CHANGE = (
    b"change@/devices/virtual/mem/null\0ACTION=change\0DEVPATH=/devices/virtual/mem/null\0SUBSYSTEM=mem\0"
    b"SYNTH_UUID=0\0MAJOR=1\0MINOR=3\0DEVNAME=null\0DEVMODE=0666\0SEQNUM=6321\0"
)
MODULE_REMOVE = b"remove@/module/nvidia\0ACTION=remove\0DEVPATH=/module/nvidia\0SUBSYSTEM=module\0SEQNUM=7001\0"
PCI_BIND = (
    b"bind@/devices/pci000f:00/000f:00:00.0/000f:01:00.0\0ACTION=bind\0"
    b"DEVPATH=/devices/pci000f:00/000f:00:00.0/000f:01:00.0\0SUBSYSTEM=pci\0DRIVER=nvidia\0SEQNUM=7002\0"
)


def test_kernel_uevents_are_read_as_the_kernel_writes_them() -> None:
    fields = parse_uevent(NULL_CHANGE)
    assert fields is not None and (fields["ACTION"], fields["SUBSYSTEM"], fields["DEVNAME"]) == (
        "change",
        "mem",
        "null",
    )
    seen: list[str] = []
    w = UdevWatcher(seen.append)
    for message in (MODULE_REMOVE, PCI_BIND, NULL_CHANGE):
        f = parse_uevent(message)
        assert f is not None
        w.handle(f["ACTION"], f.get("SUBSYSTEM"), f["DEVPATH"].rsplit("/", 1)[-1], f.get("DRIVER"))
    assert seen == ["uevent remove module/nvidia", "uevent bind pci/000f:01:00.0"]
    # udevd's own messages (group 2, `libudev` magic), a torn message, one without its variables: not uevents
    assert parse_uevent(b"libudev\0\xfe\xed\xca\xfe" + MODULE_REMOVE) is None
    assert parse_uevent(MODULE_REMOVE[:20]) is None
    assert parse_uevent(b"remove@/module/nvidia\0SEQNUM=1\0") is None


def test_udev_handler_pokes_the_drift_check(tmp_path: Path) -> None:
    root = fx.healthy(tmp_path / "root")
    root.write()
    w = watcher(root.path, tmp_path / "state", interval_s=600)
    w.start()
    try:
        assert wait_until(lambda: w.checks_total == 1)
        fx.stranded_after_update(root.path).write()
        udev = UdevWatcher(w.poke)
        udev.handle("remove", "module", "nvidia", None)  # what modprobe -r nvidia sends
        assert wait_until(lambda: w.checks_total == 2, timeout_s=5)
        assert w.report is not None and w.report.verdict == "stranded"
        assert kinds(tmp_path / "state") == ["driver_stranded"]
    finally:
        w.stop()


def test_real_netlink_monitor_delivers_uevents(tmp_path: Path) -> None:
    """A real netlink uevent socket and a real kernel uevent. This box has no NVIDIA module to load, so the
    matcher is widened to /dev/null's device and the uevent is synthesised through its sysfs uevent file."""
    uevent = Path("/sys/devices/virtual/mem/null/uevent")
    if os.geteuid() != 0 or not os.access(uevent, os.W_OK):
        pytest.skip("writing a sysfs uevent file needs root")
    root = fx.healthy(tmp_path / "root")
    root.write()
    w = watcher(root.path, tmp_path / "state", interval_s=600)
    w.start()
    udev = UdevWatcher(w.poke, matcher=lambda action, subsystem, name, driver: (subsystem, name) == ("mem", "null"))
    try:
        udev.start()
    except Exception as exc:
        w.stop()
        pytest.skip(f"no netlink uevent monitor here: {exc}")
    try:
        assert wait_until(lambda: w.checks_total == 1)
        uevent.write_text("change")
        assert wait_until(lambda: udev.matched_total >= 1, timeout_s=5), udev.events_total
        assert wait_until(lambda: w.checks_total >= 2, timeout_s=5)
    finally:
        udev.stop()
        w.stop()


def test_low_headroom_alerts_on_entering_the_band(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    meminfo = proc / "meminfo"

    def set_available(gib: float) -> None:
        kb = int(gib * 1024 * 1024)
        meminfo.write_text(f"MemTotal: 127600748 kB\nMemFree: {kb} kB\nMemAvailable: {kb} kB\n")

    set_available(100)
    settings = load_settings(
        None,
        {
            "proc_root": proc,
            "state_dir": tmp_path / "state",
            "dry_run": True,
            "mlock": False,
            "floor": "8GiB",
            "warn_headroom": "4GiB",
        },
    )
    events = EventLog(settings.events_path)
    guard = PoolWatch.build(guard_config(settings), events)
    watch = HeadroomWatcher(
        settings, lambda: None if guard.stats.mem is None else guard.stats.mem.available_bytes, events
    )
    guard.tick()
    assert not watch.tick()
    set_available(11.5)  # within 4 GiB of the 8 GiB floor
    guard.tick()
    assert watch.tick()
    guard.tick()
    assert not watch.tick()  # same episode
    set_available(12.5)  # out of the band but within the 1 GiB hysteresis: still the same episode
    guard.tick()
    assert not watch.tick()
    set_available(13.5)
    guard.tick()
    watch.tick()
    set_available(11.0)
    guard.tick()
    assert watch.tick()
    assert kinds(tmp_path / "state") == ["low_headroom", "low_headroom"]
    event = read_events(settings.events_path)[-1]
    assert event["mem_available_bytes"] == 11 * GiB and event["floor_bytes"] == 8 * GiB


def test_headroom_and_rate_limit_rules() -> None:
    assert headroom_step(False, 11 * GiB, 8 * GiB, 4 * GiB, GiB) == (True, True)
    assert headroom_step(True, 12 * GiB + 1, 8 * GiB, 4 * GiB, GiB) == (True, False)
    assert headroom_step(True, 13 * GiB + 1, 8 * GiB, 4 * GiB, GiB) == (False, False)
    state, sent = rate_limit(RateState(), EventKind.JIT_STALLED, "jit_stalled:pid=5", 0.0)
    assert sent
    state, sent = rate_limit(state, EventKind.JIT_STALLED, "jit_stalled:pid=5", 100.0)
    assert not sent
    state, sent = rate_limit(state, EventKind.JIT_STALLED, "jit_stalled:pid=6", 100.0)
    assert sent
    assert rate_limit(state, "not_an_alert", "x", 0.0)[1] is False  # type: ignore[arg-type]  # deliberately not an EventKind
    assert dedup_key(EventKind.KILL, {"id": "a"}) != dedup_key(EventKind.KILL, {"id": "b"})


@pytest.mark.parametrize(
    "url",
    ["not a url", "ftp://example.com/hook", "http://", "https://hooks.slack.com:99999/services/x"],
)
def test_check_config_rejects_malformed_webhook_url(tmp_path: Path, url: str) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'webhook_url = "{url}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    proc = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "check-config", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("sparkwatch: config error: webhook_url:")
    assert "Traceback" not in proc.stderr and url not in proc.stderr  # a URL may carry a secret: never echoed


def test_check_config_hides_webhook_secrets(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(
        'webhook_url = "https://hooks.slack.com/services/T0/B0/tok3n"\nwebhook_secret = "sh"\n'
        "webhook_backoff_max_s = 60\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    proc = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "check-config", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tok3n" not in proc.stdout and "hooks.slack.com" in proc.stdout
    assert "webhook_backoff_max_s" in proc.stdout


def test_driver_watcher_never_raises_on_a_broken_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_bytes(b"\xff\xfe garbage \x00\n")
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").mkdir()  # a directory where a file should be
    w = watcher(root, tmp_path / "state")
    report = w.check()
    assert report is not None and report.verdict in ("unknown", "absent")
    assert any("status" in f for f in report.findings)


def test_unknown_running_kernel_keeps_the_stranded_episode_open(tmp_path: Path) -> None:
    root = fx.stranded_after_update(tmp_path / "root")
    root.running = None
    root.boot = [fx.OLD_KERNEL]
    report = judge(read_driver_facts(root.write()))
    opened, alerts = driver_step(frozenset({DriverProblem.STRANDED}), report)
    assert "stranded" in opened and [a.kind for a in alerts if a.kind == "driver_recovered"] == []


def test_episode_state_from_another_version_keeps_what_it_knows(tmp_path: Path) -> None:
    """A state file with a problem name this version does not know (or garbage) never crashes the watcher: known
    problems stay open (no second page), unknown ones are dropped."""
    root = fx.stranded_after_update(tmp_path / "root")
    root.write()
    state = tmp_path / "state"
    state.mkdir()
    (state / "driver-alerts.json").write_text('{"open_problems": ["stranded", "gpu_on_fire"]}')
    w = watcher(root.path, state)
    assert w.check() is not None
    assert kinds(state) == []  # "stranded" was already open: no second alert
    (state / "driver-alerts.json").write_text('{"open_problems": 7}')  # before: TypeError out of the constructor
    w2 = watcher(root.path, state)
    w2.check()
    assert kinds(state) == ["driver_stranded"]  # unreadable state: a fresh episode
    assert json.loads((state / "driver-alerts.json").read_text()) == {"open_problems": ["stranded"]}
