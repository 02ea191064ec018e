"""A real `sparkwatch run` sees NVRM and Xid lines written into the real /dev/kmsg and acts by the rules.

The lines are written as root, the way the driver prints them (`<3>NVRM: ...`). The daemon reads the real /proc and
its guard is confined to this test's processes (ancestor_pid). Its floor is far under this machine's MemAvailable,
so only the kernel-log corroboration can make it fire: warn_headroom decides whether MemAvailable is "near" it.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from pathlib import Path
from typing import cast

import pytest

from sparkwatch.common.eventlog import read_events
from sparkwatch.common.sources.meminfo import MeminfoReader
from tests.conftest import Spawner, alive, pids_in, wait_until
from tests.daemon import sparkwatch_run, wait_for_event
from tests.kmsgwriter import KMSG, kmsg_writable_reason, write_kmsg

GiB = 1 << 30
MiB = 1 << 20
# The NV_ERR_NO_MEMORY triple one failed allocation prints (NVIDIA/open-gpu-kernel-modules issue 848).
NO_MEMORY = [
    "NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from "
    "_memdescAllocInternal(pMemDesc) @ mem_desc.c:1353",
    "NVRM: sysmemConstruct_IMPL: *** Cannot allocate sysmem through fb heap",
    "NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from "
    "pRmApi->Alloc(...) @ nv_gpu_ops.c:4647",
]


@pytest.fixture(autouse=True)
def _kmsg_writable() -> None:
    reason = kmsg_writable_reason()
    if reason is not None:
        pytest.skip(reason)


def kernel_env(warn_headroom_bytes: int, **extra: str) -> dict[str, str]:
    return {
        "SPARKWATCH_KERNEL_LOG_PATH": str(KMSG),
        # The test's lines come from a process (facility user), not from the driver: a daemon ignores them unless
        # told otherwise (test_injected_lines_are_ignored_by_default).
        "SPARKWATCH_KERNEL_LOG_ACCEPT_INJECTED": "true",
        "SPARKWATCH_FLOOR": "1GiB",  # far under MemAvailable here: memory alone never fires
        "SPARKWATCH_WARN_HEADROOM": f"{warn_headroom_bytes}B",
        "SPARKWATCH_MLOCK": "false",
        **extra,
    }


def available_bytes() -> int:
    with MeminfoReader() as reader:
        return reader.read().available_bytes


def metric(port: int, name: str, **labels: str) -> float | None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in body.splitlines():
        if line.startswith(f"{name}{{{want}}} " if want else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def start_engine(spawner: Spawner, tmp_path: Path) -> dict[int, tuple[int, str]]:
    pidfile = tmp_path / "engine.pids"
    spawner.engine("--title", "VLLM::EngineCore", "--worker", "VLLM::Worker_TP0", pidfile=pidfile, wait_for=2)
    return pids_in(pidfile)


def test_alloc_failure_within_warn_headroom_kills_the_engine(spawner: Spawner, tmp_path: Path) -> None:
    # warn_headroom as large as the pool: whatever MemAvailable is now, it is within the band.
    with sparkwatch_run(tmp_path, env=kernel_env(available_bytes() + 64 * GiB)) as daemon:
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_kernel_log_readable") == 1.0, 15)
        members = start_engine(spawner, tmp_path)
        time.sleep(0.5)  # the engine is up before the driver "fails"
        t0 = time.monotonic()
        write_kmsg(NO_MEMORY)
        kill = wait_for_event(daemon.events_path, "kill", timeout_s=15)
        seen_s = time.monotonic() - t0
        assert kill["trigger"] == "driver_alloc_failed"
        victims = {v["pid"] for v in cast("list[dict[str, object]]", kill["victims"])}
        assert set(members) <= victims
        assert wait_until(lambda: not any(alive(pid, t) for pid, (t, _) in members.items()), 10)
        failed = wait_for_event(daemon.events_path, "driver_alloc_failed", timeout_s=10)
        assert failed["action"] == "fired" and failed["in_band"] is True and failed["status"] == "NV_ERR_NO_MEMORY"
        assert failed["nvrm_kind"] == "no_memory"
        # One failure, three lines: one kill and one driver_alloc_failed event, not three.
        time.sleep(1.0)
        kinds = [e["kind"] for e in read_events(daemon.events_path)]
        assert kinds.count("kill") == 1 and kinds.count("driver_alloc_failed") == 1
        assert wait_until(
            lambda: metric(daemon.port, "sparkwatch_kernel_nvrm_errors_total", kind="no_memory") == 2.0, 5
        )  # the guard's counters cross the channel every 0.25 s
        assert wait_until(
            lambda: metric(daemon.port, "sparkwatch_kernel_nvrm_errors_total", kind="alloc_failed") == 1.0, 5
        )  # the guard's counters cross the channel every 0.25 s
        assert wait_until(
            lambda: metric(daemon.port, "sparkwatch_guard_kills_total", trigger="driver_alloc_failed") == 1.0, 5
        )  # the guard's counters cross the channel every 0.25 s
        assert any("NVIDIA driver allocation failed at MemAvailable" in line for line in daemon.stderr_lines)
    # "Within a second" of the line, with a 2-core machine shared by other test runs: the kill event is fsynced by
    # the reaper after the tree is reaped, so allow the tree's reaping on top.
    assert seen_s < 5.0, seen_s


def test_injected_lines_are_ignored_by_default(spawner: Spawner, tmp_path: Path) -> None:
    """With the default settings, the same lines written from userspace (the kernel marks them facility user) page
    nobody and fire nothing: a driver allocation failure in the band, and an Xid 79 "fallen off the bus"."""
    env = kernel_env(available_bytes() + 64 * GiB)
    del env["SPARKWATCH_KERNEL_LOG_ACCEPT_INJECTED"]
    with sparkwatch_run(tmp_path, env=env) as daemon:
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_kernel_log_readable") == 1.0, 15)
        members = start_engine(spawner, tmp_path)
        write_kmsg([*NO_MEMORY, "NVRM: Xid (PCI:0000:01:00): 79, pid=1234, name=python3, GPU has fallen off the bus."])
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_kernel_log_injected_lines_total") == 4.0, 10)
        assert wait_until(lambda: any("ignoring NVRM lines written into the kernel log" in line
                                      for line in daemon.stderr_lines), 5)  # fmt: skip
        time.sleep(1.0)
        assert all(alive(pid, t) for pid, (t, _) in members.items())
        kinds = {e["kind"] for e in read_events(daemon.events_path)}
        assert not kinds & {"kill", "driver_alloc_failed", "xid"}, kinds  # low_headroom: the band is the whole pool
        assert metric(daemon.port, "sparkwatch_kernel_nvrm_errors_total", kind="no_memory") == 0.0


def test_alloc_failure_above_the_band_alerts_and_kills_nothing(spawner: Spawner, tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path, env=kernel_env(0)) as daemon:
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_kernel_log_readable") == 1.0, 15)
        members = start_engine(spawner, tmp_path)
        write_kmsg(NO_MEMORY[:1])
        failed = wait_for_event(daemon.events_path, "driver_alloc_failed", timeout_s=10)
        assert failed["action"] == "alerted" and failed["in_band"] is False
        assert "alert only, no kill" in str(failed["summary"])
        time.sleep(1.5)
        assert all(alive(pid, t) for pid, (t, _) in members.items())
        assert "kill" not in [e["kind"] for e in read_events(daemon.events_path)]


def test_corroboration_off_alerts_even_in_the_band(spawner: Spawner, tmp_path: Path) -> None:
    env = kernel_env(available_bytes() + 64 * GiB, SPARKWATCH_KERNEL_LOG_CORROBORATION="false")
    with sparkwatch_run(tmp_path, env=env) as daemon:
        members = start_engine(spawner, tmp_path)
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_kernel_log_readable") == 1.0, 15)
        write_kmsg(NO_MEMORY[:1])
        failed = wait_for_event(daemon.events_path, "driver_alloc_failed", timeout_s=10)
        assert failed["action"] == "alerted" and "kernel_log_corroboration is off" in str(failed["summary"])
        time.sleep(1.0)
        assert all(alive(pid, t) for pid, (t, _) in members.items())


def test_xid_naming_a_pid_is_attributed_to_its_engine_tree(spawner: Spawner, tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path, env=kernel_env(0)) as daemon:
        members = start_engine(spawner, tmp_path)
        worker = next(pid for pid, (_t, role) in members.items() if role != "root")
        root = next(pid for pid, (_t, role) in members.items() if role == "root")
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_kernel_log_readable") == 1.0, 15)
        tag = uuid.uuid4().hex[:6]
        write_kmsg(
            [
                f"NVRM: Xid (PCI:000f:01:00): 31, pid={worker}, name=python3, Ch 00000008, intr 00000000. MMU Fault: "
                f"ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f8b_a0000000 {tag}",
                "NVRM: Xid (PCI:000f:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            ],
            level=4,
        )
        assert wait_until(lambda: len([e for e in read_events(daemon.events_path) if e["kind"] == "xid"]) == 2, 10)
        x31, x79 = [e for e in read_events(daemon.events_path) if e["kind"] == "xid"]
        assert x31["code"] == 31 and x31["pid"] == worker and x31["page"] is False
        assert x31["engine"] == "vllm" and x31["engine_root_pid"] == root
        assert x79["code"] == 79 and x79["page"] is True and x79["action"] == "reboot"
        assert "a human must act" in str(x79["summary"])
        assert wait_until(
            lambda: metric(daemon.port, "sparkwatch_kernel_xid_total", code="79") == 1.0, 5
        )  # the guard's counters cross the channel every 0.25 s
        assert all(alive(pid, t) for pid, (t, _) in members.items())  # an Xid alone never kills


def test_unreadable_kernel_log_is_said_once_and_the_guard_runs(tmp_path: Path) -> None:
    with sparkwatch_run(tmp_path, env={"SPARKWATCH_MLOCK": "false"}) as daemon:  # daemon.py points it nowhere
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_kernel_log_readable") == 0.0, 15)
        # The guard's series arrive with its first state message over the channel (every 0.25 s).
        assert wait_until(lambda: metric(daemon.port, "sparkwatch_guard_loop_age_seconds") is not None, 15)
        said = [line for line in daemon.stderr_lines if "kernel log not readable" in line]
        assert len(said) == 1 and "no such device" in said[0]
