"""core.driver.nvrm and core.driver.freeblocks over real formats: the H200's own /dev/kmsg, NVRM/Xid lines from public
reports, buddyinfo."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkwatch.core.driver import freeblocks
from sparkwatch.core.driver import nvrm as k

FIX = Path(__file__).parent / "fixtures" / "kmsg"
GiB = 1 << 30
MiB = 1 << 20


def records(name: str) -> list[k.KmsgRecord]:
    out = []
    for line in (FIX / name).read_bytes().splitlines():
        rec = k.parse_kmsg_record(line + b"\n")
        if rec is not None:
            out.append(rec)
    return out


def test_h200_kmsg_records_parse_with_their_sequence_and_level() -> None:
    recs = records("h200-kmsg.txt")
    lines = (FIX / "h200-kmsg.txt").read_bytes().splitlines()
    starts = [line for line in lines if line[:1].isdigit()]
    assert len(recs) == len(starts) > 300  # every record of the real ring parses; the probe's own line does not
    assert [r.seq for r in recs] == sorted(r.seq for r in recs)
    assert recs[0].seq == 0 and recs[0].text.startswith("Linux version 6.18.44")
    nvrm = [r for r in recs if "NVRM" in r.text]
    assert [r.level for r in nvrm] == [3, 4, 4]
    assert nvrm[0].text.startswith("NVRM: loading NVIDIA UNIX Open Kernel Module")
    assert all(r.facility == 0 for r in nvrm)


def test_h200_boot_nvrm_lines_are_not_allocation_failures() -> None:
    parsed = [k.parse_nvrm(r.text, r.level) for r in records("h200-kmsg.txt") if "NVRM" in r.text]
    # The module banner is printed at KERN_ERR level: it counts as "other", never as an allocation failure.
    assert [p.kind for p in parsed if isinstance(p, k.NvrmError)] == ["other"]
    assert not any(isinstance(p, k.XidLine) for p in parsed)


def test_public_nv_err_no_memory_lines() -> None:
    parsed = {r.seq: k.parse_nvrm(r.text, r.level) for r in records("nvrm-public.txt")}
    kinds = {seq: p.kind for seq, p in parsed.items() if isinstance(p, k.NvrmError)}
    assert kinds == {
        1001: "no_memory",
        1002: "alloc_failed",
        1003: "no_memory",
        1004: "other",
        1005: "other",
        1006: "alloc_failed",
        1007: "assertion",
    }
    first = parsed[1001]
    assert isinstance(first, k.NvrmError) and first.status == "NV_ERR_NO_MEMORY" and first.is_alloc_failure
    assert parsed[1008] is None  # a warning-level notice is neither counted nor acted on
    assert parsed[1014] is None  # nvidia-modeset, not NVRM


def test_public_xid_lines() -> None:
    xids = {r.seq: (k.parse_nvrm(r.text, r.level), r) for r in records("nvrm-public.txt")}
    x13, _ = xids[1009]
    assert isinstance(x13, k.XidLine)
    assert (x13.device, x13.code, x13.pid, x13.process) == ("PCI:0000:cb:00", 13, None, None)
    assert x13.message.startswith("Graphics SM Warp Exception")
    x31, _ = xids[1011]
    assert isinstance(x31, k.XidLine) and (x31.code, x31.pid, x31.process) == (31, 2913, "python3")
    x48, _ = xids[1012]
    assert isinstance(x48, k.XidLine) and x48.pid is None and x48.message.startswith("An uncorrectable")
    x154, rec = xids[1013]
    assert isinstance(x154, k.XidLine) and x154.device == "PCI:000f:01:00"
    assert rec.caller_tid == 4242


@pytest.mark.parametrize(
    ("seq", "action", "pages"),
    [(1009, k.CHECK_APP, False), (1010, k.REBOOT, True), (1011, k.CHECK_APP, False), (1012, k.RESET_GPU, True),
     (1013, k.RESET_GPU, True)],
)  # fmt: skip
def test_xid_catalogue_says_which_need_a_human(seq: int, action: str, pages: bool) -> None:
    rec = next(r for r in records("nvrm-public.txt") if r.seq == seq)
    xid = k.parse_nvrm(rec.text, rec.level)
    assert isinstance(xid, k.XidLine)
    info = k.xid_info(xid)
    assert (info.action, info.pages) == (action, pages)


def test_xid_154_reboot_and_unknown_codes() -> None:
    line = k.parse_nvrm(
        "NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
    )
    assert isinstance(line, k.XidLine) and k.xid_info(line).action == k.REBOOT
    odd = k.parse_nvrm("NVRM: Xid (PCI:0000:01:00): 999, something new")
    assert isinstance(odd, k.XidLine) and k.xid_info(odd).action == k.INFO and not k.xid_info(odd).pages


@pytest.mark.parametrize("junk", [b"", b"garbage", b"3,x,1,-;NVRM: x", b"3,1;", b";;;"])
def test_garbage_is_no_record(junk: bytes) -> None:
    assert k.parse_kmsg_record(junk) is None


def test_buddyinfo_fresh_h200_vs_fragmented_vm() -> None:
    fresh = freeblocks.parse_buddyinfo((FIX / "h200-buddyinfo.txt").read_bytes())
    assert [z.zone for z in fresh] == ["DMA", "DMA32", "Normal"] and len(fresh[2].free_blocks) == 11
    c = freeblocks.contiguous_free(fresh, 4096)
    # Orders 9 (2 MiB) and 10 (4 MiB): Normal 8 and 37, DMA32 0 and 753, DMA 1 and 3.
    assert c["2MiB"] == (8 * 2 + 37 * 4 + 753 * 4 + 1 * 2 + 3 * 4) * MiB
    assert c["64KiB"] > c["2MiB"]
    frag = freeblocks.parse_buddyinfo((FIX / "vm-fragmented-buddyinfo.txt").read_bytes())
    cf = freeblocks.contiguous_free(frag, 4096)
    normal = next(z for z in frag if z.zone == "Normal")
    all_free = sum((4096 << o) * n for o, n in enumerate(normal.free_blocks))
    big = sum((4096 << o) * n for o, n in enumerate(normal.free_blocks) if o >= 9)
    assert big < all_free  # the fragmented zone holds much of its free memory in blocks under 2 MiB
    assert cf["2MiB"] >= big


def test_buddyinfo_sizes_come_from_the_page_size() -> None:
    zones = freeblocks.parse_buddyinfo((FIX / "gb10-64k-buddyinfo.txt").read_bytes())
    assert len(zones[1].free_blocks) == 14
    c64 = freeblocks.contiguous_free(zones, 65536)
    normal = zones[1].free_blocks
    # 64 KiB pages: every block counts toward 64KiB; 2 MiB is order 5 and up.
    assert c64["64KiB"] == sum((65536 << o) * n for z in zones for o, n in enumerate(z.free_blocks))
    assert c64["2MiB"] == sum((65536 << o) * n for z in zones for o, n in enumerate(z.free_blocks) if o >= 5)
    assert normal[13] == 2 and c64["2MiB"] > 2 * (512 * MiB)
    # The same counts read with 4 KiB pages would be 16 times smaller: the page size is never assumed.
    assert freeblocks.contiguous_free(zones, 4096)["2MiB"] < c64["2MiB"]


@pytest.mark.parametrize("bad", [b"", b"Node 0, zone Normal 1 2 x\n", b"nonsense\n"])
def test_buddyinfo_garbage_is_an_error(bad: bytes) -> None:
    with pytest.raises(freeblocks.BuddyinfoError):
        freeblocks.parse_buddyinfo(bad)


NOMEM = k.NvrmError("no_memory", "NV_ERR_NO_MEMORY", "NVRM: ... [NV_ERR_NO_MEMORY] ...")
P = k.CorroborationParams(floor_bytes=8 * GiB, warn_headroom_bytes=4 * GiB)


def test_alloc_failure_in_band_fires_once_per_arming() -> None:
    st, d = k.corroborate(k.CorroborationState(), P, 10.0, 11 * GiB, NOMEM, guard_armed=True)
    assert (d.action, d.trigger, d.in_band) == (k.FIRE, "driver_alloc_failed", True)
    # The same episode's next line, with the guard now disarmed by its kill: nothing new
    st, d = k.corroborate(st, P, 10.001, 11 * GiB, NOMEM, guard_armed=False)
    assert d.action is None


def test_a_re_armed_guard_does_not_fire_twice_on_one_failure() -> None:
    st, d = k.corroborate(k.CorroborationState(), P, 10.0, 11 * GiB, NOMEM, guard_armed=True)
    assert d.action == k.FIRE
    # The guard found no victim and re-armed (11 GiB > floor + rearm): the next line of the same failure is quiet.
    st, d = k.corroborate(st, P, 10.3, 11 * GiB, NOMEM, guard_armed=True)
    assert d.action is None
    st, d = k.corroborate(st, P, 10.3 + k.ALLOC_EPISODE_GAP_S + 0.1, 11 * GiB, NOMEM, guard_armed=True)
    assert d.action == k.FIRE  # a failure after a quiet gap is a new one


def test_a_line_naming_a_pid_carries_it() -> None:
    line = k.parse_nvrm("NVRM: _memdescAllocInternal: Failed to allocate memory for pid=4242 [NV_ERR_NO_MEMORY]")
    assert isinstance(line, k.NvrmError) and line.pid == 4242 and line.kind == "no_memory"
    assert k.parse_nvrm("NVRM: sysmemConstruct_IMPL: *** Cannot allocate sysmem through fb heap").pid is None  # type: ignore[union-attr]


def test_alloc_failure_at_band_edge_and_above() -> None:
    _, d = k.corroborate(k.CorroborationState(), P, 1.0, 12 * GiB, NOMEM, guard_armed=True)
    assert d.action == k.FIRE  # floor + warn_headroom exactly is in the band
    st, d = k.corroborate(k.CorroborationState(), P, 1.0, 12 * GiB + 1, NOMEM, guard_armed=True)
    assert (d.action, d.in_band) == (k.ALERT, False)
    st, d = k.corroborate(st, P, 2.0, 22 * GiB, NOMEM, guard_armed=True)
    assert d.action is None  # same episode: one alert
    st, d = k.corroborate(st, P, 2.0 + k.ALLOC_EPISODE_GAP_S + 0.1, 22 * GiB, NOMEM, guard_armed=True)
    assert d.action == k.ALERT  # a new episode alerts again


def test_alloc_failure_never_fires_when_disabled_or_blind() -> None:
    off = k.CorroborationParams(8 * GiB, 4 * GiB, enabled=False)
    assert k.corroborate(k.CorroborationState(), off, 1.0, 9 * GiB, NOMEM, guard_armed=True)[1].action == k.ALERT
    blind = k.corroborate(k.CorroborationState(), P, 1.0, None, NOMEM, guard_armed=True)[1]
    assert blind.action == k.ALERT  # no MemAvailable to judge by: a parse error is never a reason to kill


def test_other_nvrm_errors_change_nothing() -> None:
    other = k.NvrmError("assertion", None, "NVRM: nvAssertFailedNoLog: Assertion failed: NV_OK == status")
    st, d = k.corroborate(k.CorroborationState(), P, 1.0, 9 * GiB, other, guard_armed=True)
    assert d.action is None and st == k.CorroborationState()


def test_kernel_log_events_alert_and_fold_per_code_and_gpu() -> None:
    from sparkwatch.core.eventkinds import EventKind
    from sparkwatch.core.report.alerts import RateState, dedup_key, is_alerting, rate_limit

    assert is_alerting(EventKind.XID) and is_alerting(EventKind.DRIVER_ALLOC_FAILED)
    k79 = dedup_key(EventKind.XID, {"code": 79, "device": "PCI:0000:01:00", "pid": None})
    k13 = dedup_key(EventKind.XID, {"code": 13, "device": "PCI:0000:01:00", "pid": 1234})
    assert k79 != k13
    state, sent = rate_limit(RateState(), EventKind.XID, k13, 0.0)
    assert sent
    state, sent = rate_limit(state, EventKind.XID, k13, 60.0)
    assert not sent  # a warp exception storm alerts once per 5 minutes per code and GPU
    state, sent = rate_limit(state, EventKind.XID, k79, 60.0)
    assert sent  # a different code is its own stream
