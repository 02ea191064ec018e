"""`sparkwatch doctor` as a real subprocess on fixture roots, and on this machine with real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkwatch.core.model import MemInfo
from sparkwatch.core.report.doctorchecks import floor_check, swap_check
from tests import driverroot as fx

GiB = 1 << 30
CHECK_IDS = [
    "driver-modules",
    "driver-loaded",
    "driver-version-match",
    "next-boot-modules",
    "reboot-required",
    "swap",
    "max-jobs",
    "ray-memory-monitor",
    "floor",
    "shm-leftovers",
    "guard",
    "kernel-log",
    "recent-xids",
    "peers",
    "listen",
]


def clean_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg-config")  # no user config file leaks in
    env["XDG_STATE_HOME"] = str(tmp_path / "xdg-state")
    return env


def doctor(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(tmp_path),
        check=False,
    )


def doctor_json(tmp_path: Path, root: Path, *extra: str) -> tuple[int, dict[str, object]]:
    proc = doctor(tmp_path, "--json", "--root", str(root), *extra)
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    return proc.returncode, data


def by_id(data: dict[str, object]) -> dict[str, dict[str, str]]:
    checks = data["checks"]
    assert isinstance(checks, list)
    return {c["id"]: c for c in checks}


def assert_contract(data: dict[str, object]) -> None:
    assert set(data) == {"ok", "checks"} and isinstance(data["ok"], bool)
    checks = data["checks"]
    assert isinstance(checks, list)
    assert [c["id"] for c in checks] == CHECK_IDS
    for c in checks:
        assert set(c) <= {"id", "status", "summary", "fix", "detail"} and {"id", "status", "summary"} <= set(c)
        assert c["status"] in ("ok", "warn", "fail", "skip")
        assert isinstance(c["summary"], str) and c["summary"]
        if c["status"] == "fail":
            assert c.get("fix"), f"{c['id']} fails without a fix"
    assert data["ok"] == (not any(c["status"] == "fail" for c in checks))


def test_stranded_root_fails_with_the_fix(tmp_path: Path) -> None:
    root = fx.stranded_after_update(tmp_path / "root").write()
    code, data = doctor_json(tmp_path, root)
    assert_contract(data)
    assert code == 1 and data["ok"] is False
    checks = by_id(data)
    assert checks["driver-modules"]["status"] == "fail"
    fix = checks["driver-modules"]["fix"]
    for command in ("sudo apt full-upgrade", "sudo reboot", "uname -r", "nvidia-smi"):
        assert command in fix
    assert checks["next-boot-modules"]["status"] == "ok"
    assert "NVML not asked" in checks["driver-loaded"]["detail"]  # a fixture root never asks this machine's NVML


@pytest.mark.parametrize(
    ("scenario", "code", "failing"),
    [
        (fx.healthy, 0, set()),
        (fx.dkms_healthy, 0, set()),
        (fx.will_strand, 1, {"next-boot-modules"}),
        (fx.version_mismatch, 1, {"driver-version-match"}),
        (fx.stranded_after_update, 1, {"driver-modules", "driver-loaded"}),
    ],
)
def test_each_verdict_exit_code(tmp_path: Path, scenario: object, code: int, failing: set[str]) -> None:
    root = scenario(tmp_path / "root").write()  # type: ignore[operator]
    got, data = doctor_json(tmp_path, root)
    assert_contract(data)
    assert got == code
    assert {c for c, v in by_id(data).items() if v["status"] == "fail"} == failing


def test_human_output_and_same_verdict_as_json(tmp_path: Path) -> None:
    root = fx.stranded_after_update(tmp_path / "root").write()
    proc = doctor(tmp_path, "--root", str(root))
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("sparkwatch doctor: root ")
    fail_line = next(line for line in lines if "driver-modules" in line)
    assert fail_line.split()[0] == "FAIL" and fx.OLD_KERNEL in fail_line
    assert any(line.strip() == "sudo apt full-upgrade" for line in lines)
    assert lines[-1].startswith("FAIL: 2 failing")


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    assert doctor(tmp_path, "--no-such-flag").returncode == 2
    missing = doctor(tmp_path, "--root", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "not a directory" in missing.stderr
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text('floor = "lots"\n')
    proc = doctor(tmp_path, "--config", str(bad_config), "--root", str(tmp_path))
    assert proc.returncode == 2 and "floor" in proc.stderr and "Traceback" not in proc.stderr


def test_half_empty_and_corrupt_roots_do_not_crash(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, data = doctor_json(tmp_path, empty)
    assert_contract(data)
    assert code == 0
    assert by_id(data)["swap"]["status"] == "skip" and by_id(data)["floor"]["status"] == "skip"
    root = fx.stranded_after_update(tmp_path / "corrupt")
    root.dpkg_raw = b"Package: linux-modules-nvidia-580-open-6.17.0-1008-nvidia\nStat"
    code, data = doctor_json(tmp_path, root.write())
    assert_contract(data)
    assert code == 1 and "truncated" in by_id(data)["driver-modules"]["detail"]


def engine_root(tmp_path: Path) -> fx.DriverRoot:
    root = fx.healthy(tmp_path / "root")
    # vLLM with local Ray: the API server, its engine core, the head raylet (monitor off), a worker-node raylet
    # (monitor left on: the head alone is not enough), a Ray worker, and an unrelated shell grepping for vllm.
    root.add_proc(4100, 1, "python3", ("/venv/bin/python3", "/venv/bin/vllm", "serve", "m"), {"MAX_JOBS": "4"})
    root.add_proc(4101, 4100, "VLLM::EngineCor", ("VLLM::EngineCore",), {"MAX_JOBS": "4"})
    root.add_proc(
        4200,
        1,
        "raylet",
        ("/venv/lib/ray/core/src/ray/raylet/raylet", "--node_ip_address=10.0.0.1"),
        {"RAY_memory_monitor_refresh_ms": "0", "MAX_JOBS": "4"},
    )
    root.add_proc(
        4300,
        1,
        "raylet",
        ("/venv/lib/ray/core/src/ray/raylet/raylet", "--node_ip_address=10.0.0.2"),
        {"PATH": "/usr/bin"},
    )
    root.add_proc(4301, 4300, "ray::RayWorkerW", ("ray::RayWorkerWrapper.execute_method",), {})
    root.add_proc(4400, 1, "grep", ("grep", "vllm"), {})
    return root


def test_environment_checks_from_root_proc(tmp_path: Path) -> None:
    code, data = doctor_json(tmp_path, engine_root(tmp_path).write())
    assert_contract(data)
    checks = by_id(data)
    assert code == 0  # warnings only
    ray = checks["ray-memory-monitor"]
    assert ray["status"] == "warn" and "1 of 2 raylets" in ray["summary"]
    assert "raylet pid 4300" in ray["detail"] and "4200" not in ray["detail"]
    jobs = checks["max-jobs"]
    assert jobs["status"] == "warn" and "1 of 3" in jobs["summary"]  # vllm root + 2 raylets; workers inherit
    assert "pid 4300" in jobs["detail"] and "4101" not in jobs["detail"] and "4400" not in jobs["detail"]
    assert "MAX_JOBS=4" in jobs["fix"]


def test_environment_checks_pass_when_set(tmp_path: Path) -> None:
    root = engine_root(tmp_path)
    root.procs[3].env = {"RAY_memory_monitor_refresh_ms": "0", "MAX_JOBS": "4"}
    _, data = doctor_json(tmp_path, root.write())
    checks = by_id(data)
    assert checks["ray-memory-monitor"]["status"] == "ok"
    assert checks["max-jobs"]["status"] == "ok"
    root.procs[0].env = {"MAX_JOBS": "20"}  # one per core on a Spark: the burst MAX_JOBS exists to stop
    _, data = doctor_json(tmp_path, root.write())
    assert by_id(data)["max-jobs"]["status"] == "warn" and "MAX_JOBS=20" in by_id(data)["max-jobs"]["detail"]


def test_swap_and_floor_against_memtotal(tmp_path: Path) -> None:
    root = fx.healthy(tmp_path / "root")
    _, data = doctor_json(tmp_path, root.write())
    assert by_id(data)["swap"]["status"] == "warn" and "swapon" in by_id(data)["swap"]["fix"]
    assert by_id(data)["floor"]["status"] == "ok"  # 8 GiB of 121.7 GiB
    cfg = tmp_path / "c.toml"
    cfg.write_text('floor = "1GiB"\n')
    _, data = doctor_json(tmp_path, root.write(), "--config", str(cfg))
    assert by_id(data)["floor"]["status"] == "warn"
    cfg.write_text('floor = "200GiB"\n')
    code, data = doctor_json(tmp_path, root.write(), "--config", str(cfg))
    assert by_id(data)["floor"]["status"] == "fail" and code == 1
    root.meminfo_kb = (127600748, 118566368, 16 * 1024 * 1024)
    _, data = doctor_json(tmp_path, root.write())
    assert by_id(data)["swap"]["status"] == "ok"


def test_the_floor_s_fix_names_the_config_file_in_use(tmp_path: Path) -> None:
    """The fix named ~/.config/sparkwatch/config.toml while --config or SPARKWATCH_CONFIG named another file: it names
    the file in use, else the default one (under XDG_CONFIG_HOME)."""
    root = fx.healthy(tmp_path / "root").write()
    cfg = tmp_path / "elsewhere.toml"
    cfg.write_text('floor = "1GiB"\n')
    _, data = doctor_json(tmp_path, root, "--config", str(cfg))
    assert f"# in {cfg}, then restart" in by_id(data)["floor"]["fix"], by_id(data)["floor"]
    env = {**clean_env(tmp_path), "SPARKWATCH_CONFIG": str(cfg)}
    argv = [sys.executable, "-m", "sparkwatch", "doctor", "--json", "--root", str(root)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert f"# in {cfg}, then restart" in by_id(json.loads(done.stdout))["floor"]["fix"], done.stdout
    default = tmp_path / "xdg-config" / "sparkwatch" / "config.toml"
    default.parent.mkdir(parents=True)
    default.write_text('floor = "1GiB"\n')
    _, data = doctor_json(tmp_path, root)
    assert f"# in {default}, then restart" in by_id(data)["floor"]["fix"], by_id(data)["floor"]


def test_floor_rules() -> None:
    spark = MemInfo(127600748 * 1024, 118566368 * 1024, 0, 0, 0, 0, 0)
    assert floor_check(8 * GiB, 4 * GiB, spark, "c.toml").status == "ok"
    assert floor_check(40 * GiB, 4 * GiB, spark, "c.toml").status == "warn"
    small = MemInfo(24 * GiB, 20 * GiB, 0, 0, 0, 0, 0)
    check = floor_check(8 * GiB, 4 * GiB, small, "c.toml")
    assert check.status == "warn" and check.fix is not None and '"6GiB"' in check.fix
    assert swap_check(None).status == "skip"


@pytest.fixture
def live_engine(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real process that looks like vLLM's engine core, started without MAX_JOBS."""
    pytest.importorskip("setproctitle")
    env = {k: v for k, v in os.environ.items() if k != "MAX_JOBS"}
    code = "import setproctitle, time; setproctitle.setproctitle('VLLM::EngineCore'); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"VLLM::"):
                break
            time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_live_root_reads_real_engine_environment(tmp_path: Path, live_engine: subprocess.Popen[bytes]) -> None:
    proc = doctor(tmp_path, "--json")
    assert proc.returncode in (0, 1), proc.stderr
    data = json.loads(proc.stdout)
    assert_contract(data)
    jobs = by_id(data)["max-jobs"]
    assert jobs["status"] == "warn"
    assert f"pid {live_engine.pid} (VLLM::EngineCore): MAX_JOBS unset" in jobs["detail"]


KMSG_FIX = Path(__file__).parent / "fixtures" / "kmsg"


def test_kernel_log_of_a_healthy_h200_and_of_one_in_trouble(tmp_path: Path) -> None:
    """DIR/dev/kmsg as a file of records: the H200's real boot ring, then the NVRM/Xid lines of public reports."""
    root = fx.healthy(tmp_path / "root").write()
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev" / "kmsg").write_bytes((KMSG_FIX / "h200-kmsg.txt").read_bytes())
    _, data = doctor_json(tmp_path, root)
    assert_contract(data)
    checks = by_id(data)
    assert checks["kernel-log"]["status"] == "ok" and "3 NVRM lines" in checks["kernel-log"]["summary"]
    assert checks["recent-xids"]["status"] == "ok"

    (root / "dev" / "kmsg").write_bytes((KMSG_FIX / "nvrm-public.txt").read_bytes())
    code, data = doctor_json(tmp_path, root)
    checks = by_id(data)
    assert code == 1  # Xids that need a reset fail the report
    log = checks["kernel-log"]
    assert log["status"] == "warn" and "4 driver allocation failures" in log["summary"]
    xids = checks["recent-xids"]
    assert xids["status"] == "fail" and "codes 13, 31, 48, 79, 154" in xids["summary"]
    assert "48, 79, 154 need a GPU reset or a reboot" in xids["summary"] and "nvidia-smi -r" in xids["fix"]
    assert "Xid 31 PCI:0000:01:00: GPU memory page fault pid 2913 (python3) -> check_app" in xids["detail"]


def test_lines_written_into_the_kernel_log_by_a_process_are_not_the_drivers(tmp_path: Path) -> None:
    """The public NVRM/Xid records as a process writing /dev/kmsg would leave them (the kernel turns their facility
    into LOG_USER: prefix 11 for level 3, 12 for level 4): a healthy report that says it ignored them."""
    root = fx.healthy(tmp_path / "root").write()
    (root / "dev").mkdir(exist_ok=True)
    injected = []
    for line in (KMSG_FIX / "nvrm-public.txt").read_bytes().splitlines(keepends=True):
        head, sep, rest = line.partition(b",")
        injected.append(str(int(head) | 8).encode() + sep + rest if head.isdigit() else line)
    (root / "dev" / "kmsg").write_bytes(b"".join(injected))
    code, data = doctor_json(tmp_path, root)
    checks = by_id(data)
    assert code == 0, data
    assert checks["kernel-log"]["status"] == "ok" and "0 NVRM lines" in checks["kernel-log"]["summary"]
    assert "written by processes, not the driver: ignored" in checks["kernel-log"]["summary"]
    assert checks["recent-xids"]["status"] == "ok" and checks["recent-xids"]["summary"] == "no Xid in the kernel log"


def test_unreadable_kernel_log_says_why(tmp_path: Path) -> None:
    root = fx.healthy(tmp_path / "root").write()
    code, data = doctor_json(tmp_path, root)
    checks = by_id(data)
    assert code == 0  # a blind kernel log warns; the guard still runs
    assert checks["kernel-log"]["status"] == "warn" and "no such device" in checks["kernel-log"]["summary"]
    assert "install-service --system" in checks["kernel-log"]["fix"]
    assert checks["recent-xids"]["status"] == "skip"


def test_live_kernel_log_that_is_not_the_device_is_not_readable(tmp_path: Path) -> None:
    """On this machine, kernel_log_path naming an empty mode-000 file (what systemd's ProtectKernelLogs=yes can leave
    at /dev/kmsg) is a warning with the reason, not "readable: 0 records"."""
    fake = tmp_path / "kmsg"
    fake.touch(mode=0)
    env = clean_env(tmp_path) | {"SPARKWATCH_KERNEL_LOG_PATH": str(fake)}
    proc = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert proc.returncode in (0, 1), proc.stderr
    checks = by_id(json.loads(proc.stdout))
    log = checks["kernel-log"]
    assert log["status"] == "warn" and "not the kernel log device (character 1:11)" in log["summary"], log
    assert checks["recent-xids"]["status"] == "skip"


def test_max_jobs_summary_counts_every_process_it_lists() -> None:
    """A report once said "3 of 3" above four lines: the unreadable one was listed but not counted."""
    from sparkwatch.core.model import Proc
    from sparkwatch.core.report.doctorchecks import EnvTarget, max_jobs_check

    def target(pid: int) -> EnvTarget:
        proc = Proc(pid, 1, 1000, "VLLM::EngineCor", "S", 1, 0, ("VLLM::EngineCore",))
        return EnvTarget(proc, "engine", "vllm")

    targets = [target(p) for p in (10, 11, 12, 13)]
    environ: dict[int, dict[str, str] | None] = {10: {}, 11: {}, 12: {"MAX_JOBS": "20"}, 13: None}
    check = max_jobs_check(targets, environ, jobs_alert=8)
    assert check.summary.startswith("MAX_JOBS unset in 2, above 8 in 1 of 4 engine/raylet processes; ")
    assert "environment unreadable in 1" in check.summary
    assert check.detail is not None and len(check.detail.splitlines()) == 4
    ok = max_jobs_check(targets[:2], {10: {"MAX_JOBS": "4"}, 11: None}, jobs_alert=8)
    assert ok.summary == "MAX_JOBS set in 1 of 2 engine/raylet processes; environment unreadable in 1"
    single = max_jobs_check(targets[:1], {10: {"MAX_JOBS": "4"}}, jobs_alert=8)
    assert single.summary == "MAX_JOBS set in its engine/raylet process"


def test_no_running_guard_is_a_warning_and_a_fixture_root_skips_the_check(tmp_path: Path) -> None:
    env = {**clean_env(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    proc = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "doctor", "--json"], capture_output=True, text=True, timeout=90, env=env
    )
    assert proc.returncode in (0, 1), proc.stderr
    guard = by_id(json.loads(proc.stdout))["guard"]
    assert guard["status"] == "warn" and guard["summary"].startswith("no guard is running: nothing kills an engine")
    assert "sparkwatch install-service" in guard["fix"]
    _code, data = doctor_json(tmp_path, fx.healthy(tmp_path / "root").write())
    assert by_id(data)["guard"]["status"] == "skip"
