"""The driver's own view of memory: NVRM and Xid lines from the kernel log (free memory by buddy order is
core.driver.freeblocks).

Pure: /dev/kmsg records come in as data; `corroborate` takes the time and
MemAvailable as arguments, in the shape of core.kill.trigger.step (state in, decision out).

Line formats are the driver's own (NVIDIA open-gpu-kernel-modules, and public reports quoting dmesg):
  NVRM: Xid (PCI:0000:01:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
  NVRM: Xid (PCI:0000:01:00): 31, pid=2913, name=python3, Ch 00000008, intr 00000000. MMU Fault: ...
  NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): ...   (older drivers: no pid)
  NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from ...
  NVRM: sysmemConstruct_IMPL: *** Cannot allocate sysmem through fb heap
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from sparkwatch.core.kill.triggers import Trigger

# --- /dev/kmsg records


# The kernel's own lines; a line written into /dev/kmsg from userspace always gets another facility (the kernel sets
# LOG_USER when the writer asks for 0: kernel/printk/printk.c, devkmsg_write), so the two can be told apart.
KERNEL_FACILITY = 0


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    """One /dev/kmsg record: "<prio>,<seq>,<usec>,<flags>[,caller=T<tid>];<text>" (Documentation/ABI/testing/
    dev-kmsg). The facility is 0 for the kernel's own lines; lines written to /dev/kmsg by root get 1 (LOG_USER)."""

    facility: int
    level: int
    seq: int
    ts_us: int
    text: str
    caller_tid: int | None = None  # CONFIG_PRINTK_CALLER kernels: the task that printed (the ioctl's caller)


def is_from_kernel(record: KmsgRecord) -> bool:
    """Printed by the kernel (a driver), not written into /dev/kmsg by a process."""
    return record.facility == KERNEL_FACILITY


def parse_kmsg_record(data: bytes) -> KmsgRecord | None:
    """None for anything that is not a record (a torn read, garbage): a parse error is never a reason to act."""
    head, sep, rest = data.partition(b";")
    if not sep:
        return None
    fields = head.split(b",")
    if len(fields) < 4 or not all(f.isdigit() for f in fields[:3]):
        return None
    prio, seq, ts = (int(f) for f in fields[:3])
    caller = None
    for extra in fields[4:]:
        if extra.startswith(b"caller=T") and extra[8:].isdigit():
            caller = int(extra[8:])
    text = rest.split(b"\n", 1)[0]  # continuation lines (" SUBSYSTEM=…") carry nothing we use
    return KmsgRecord(prio >> 3, prio & 7, seq, ts, text.decode("utf-8", "replace"), caller)


# --- NVRM lines

_XID = re.compile(r"NVRM: Xid \(([^)]*)\): (\d+),\s*(.*)")
_XID_PID = re.compile(r"pid='?(\d+|<unknown>)'?,\s*name=([^,]*),\s*")
_RECOVERY = re.compile(r"recovery action changed from .* to 0x[0-9a-fA-F]+ \(([^)]*)\)")
_NV_ERR = re.compile(r"\[(NV_ERR_[A-Z_]+)\]")
_PID = re.compile(r"\bpid[= ]'?(\d+)")
_ALLOC_FAILED = re.compile(r"(?i)(?:cannot|can't|unable to|failed to|fail(?:ed)? to) (?:alloc|allocate)\b")

# kind label of sparkwatch_kernel_nvrm_errors_total. The first three are allocation failures the guard corroborates.
NVRM_KINDS = ("no_memory", "insufficient_resources", "alloc_failed", "assertion", "other")
ALLOC_KINDS = frozenset({"no_memory", "alloc_failed"})
_ERR_LEVEL = 3  # KERN_ERR: "other" counts NVRM lines at error level or worse, not the driver's notices


@dataclass(frozen=True, slots=True)
class XidLine:
    device: str  # "PCI:0000:01:00"
    code: int
    pid: int | None
    process: str | None
    message: str


@dataclass(frozen=True, slots=True)
class NvrmError:
    kind: str  # one of NVRM_KINDS
    status: str | None  # "NV_ERR_NO_MEMORY"
    message: str
    pid: int | None = None  # where the line names one ("pid=1234"); else the record's caller, if the kernel says

    @property
    def is_alloc_failure(self) -> bool:
        return self.kind in ALLOC_KINDS


def parse_nvrm(text: str, level: int = _ERR_LEVEL) -> XidLine | NvrmError | None:
    """An Xid or an NVRM error line; None for everything else (the driver's notices, other subsystems)."""
    at = text.find("NVRM")
    if at < 0:
        return None
    text = text[at:]
    m = _XID.match(text)
    if m is not None:
        device, code, rest = m.group(1), int(m.group(2)), m.group(3)
        pid: int | None = None
        process: str | None = None
        pm = _XID_PID.match(rest)
        if pm is not None:
            pid = int(pm.group(1)) if pm.group(1).isdigit() else None
            name = pm.group(2).strip()
            process = None if name in ("", "<unknown>") else name
            rest = rest[pm.end() :]
        return XidLine(device, code, pid, process, rest.strip())
    status_m = _NV_ERR.search(text)
    status = status_m.group(1) if status_m else None
    pid_m = _PID.search(text)
    pid = int(pid_m.group(1)) if pid_m else None
    if status == "NV_ERR_NO_MEMORY":
        return NvrmError("no_memory", status, text, pid)
    if status == "NV_ERR_INSUFFICIENT_RESOURCES":
        return NvrmError("insufficient_resources", status, text, pid)
    if _ALLOC_FAILED.search(text):
        return NvrmError("alloc_failed", status, text, pid)
    if "Assertion failed" in text or "Check failed" in text:
        return NvrmError("assertion", status, text, pid)
    if level <= _ERR_LEVEL:
        return NvrmError("other", status, text, pid)
    return None


# --- the Xid catalogue: which codes need a GPU reset or a reboot (a human), which are the application's

RESET_GPU = "reset_gpu"
REBOOT = "reboot"
RESTART_APP = "restart_app"
CHECK_APP = "check_app"
INFO = "info"
PAGING_ACTIONS = frozenset({RESET_GPU, REBOOT})


@dataclass(frozen=True, slots=True)
class XidInfo:
    name: str
    action: str  # RESET_GPU, REBOOT, RESTART_APP, CHECK_APP or INFO

    @property
    def pages(self) -> bool:
        """A human must act on the GPU (reset or reboot): the alert pages, not just informs."""
        return self.action in PAGING_ACTIONS


# From NVIDIA's Xid catalogue (docs.nvidia.com/deploy/xid-errors, "Xid error listing" and its recommended actions)
# and the repair actions gpud assigns (leptonai/gpud components/accelerator/nvidia/xid). Codes not listed are INFO.
XID_CATALOGUE: Mapping[int, XidInfo] = {
    8: XidInfo("GPU stopped processing", RESTART_APP),
    13: XidInfo("Graphics Engine Exception", CHECK_APP),
    31: XidInfo("GPU memory page fault", CHECK_APP),
    32: XidInfo("Invalid or corrupted push buffer stream", CHECK_APP),
    38: XidInfo("Driver firmware error", REBOOT),
    43: XidInfo("GPU stopped processing", RESTART_APP),
    45: XidInfo("Preemptive cleanup, due to previous errors", INFO),
    48: XidInfo("Double Bit ECC Error", RESET_GPU),
    56: XidInfo("Display Engine error", REBOOT),
    57: XidInfo("Error programming video memory interface", REBOOT),
    61: XidInfo("Internal micro-controller breakpoint/warning", RESET_GPU),
    62: XidInfo("Internal micro-controller halt", RESET_GPU),
    63: XidInfo("ECC page retirement or row remapping recording event", RESET_GPU),
    64: XidInfo("ECC page retirement or row remapper recording failure", RESET_GPU),
    68: XidInfo("NVDEC0 Exception", CHECK_APP),
    69: XidInfo("Graphics Engine class error", CHECK_APP),
    74: XidInfo("NVLINK Error", RESET_GPU),
    79: XidInfo("GPU has fallen off the bus", REBOOT),
    92: XidInfo("High single-bit ECC error rate", CHECK_APP),
    94: XidInfo("Contained ECC error", RESTART_APP),
    95: XidInfo("Uncontained ECC error", RESET_GPU),
    109: XidInfo("Context Switch Timeout Error", CHECK_APP),
    119: XidInfo("GSP RPC Timeout", RESET_GPU),
    120: XidInfo("GSP Error", RESET_GPU),
    121: XidInfo("C2C Link Error", RESET_GPU),
    140: XidInfo("Unrecovered ECC Error", RESET_GPU),
    143: XidInfo("GPU Initialization Failure", RESET_GPU),
    154: XidInfo("GPU Recovery Action Changed", INFO),  # the line itself says what is needed: see xid_info
}


def xid_info(xid: XidLine) -> XidInfo:
    """The catalogue entry; Xid 154 names the action in its own text ("... to 0x1 (GPU Reset Required)")."""
    if xid.code == 154:
        m = _RECOVERY.search(xid.message)
        wanted = (m.group(1) if m else "").lower()
        if "reboot" in wanted:
            return XidInfo(f"GPU recovery action: {m.group(1) if m else ''}", REBOOT)
        if "reset" in wanted:
            return XidInfo(f"GPU recovery action: {m.group(1) if m else ''}", RESET_GPU)
    return XID_CATALOGUE.get(xid.code, XidInfo("Xid", INFO))


# --- corroboration: the guard's second signal

# One allocation failure prints 2-4 NVRM lines within a millisecond (Check failed, Cannot allocate sysmem, Assertion
# failed: issue reports on open-gpu-kernel-modules show the triple); lines closer than this are one failure.
ALLOC_EPISODE_GAP_S = 5.0

FIRE = "fire"
ALERT = "alert"
TRIGGER = Trigger.DRIVER_ALLOC_FAILED


@dataclass(frozen=True, slots=True)
class CorroborationParams:
    floor_bytes: int
    warn_headroom_bytes: int
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class CorroborationState:
    last_failure_t: float | None = None  # the last allocation-failure line seen, for episodes
    last_fire_t: float | None = None  # the last FIRE: lines within ALLOC_EPISODE_GAP_S of it are the same failure


@dataclass(frozen=True, slots=True)
class Corroboration:
    action: str | None  # FIRE: count as a floor crossing; ALERT: record and alert, no kill; None: nothing new
    trigger: str = TRIGGER
    in_band: bool = False
    new_episode: bool = False


def corroborate(
    state: CorroborationState,
    params: CorroborationParams,
    t: float,
    available_bytes: int | None,
    failure: NvrmError,
    *,
    guard_armed: bool,
) -> tuple[CorroborationState, Corroboration]:
    """Feed one driver allocation failure seen at monotonic `t`, with the MemAvailable of that guard tick.

    Within warn_headroom of the floor it is a floor crossing (FIRE) when the guard is armed: the driver has run out
    while the kernel still counts memory as available (a GB10 showed 22.5 GiB available at NV_ERR_NO_MEMORY). One
    failure prints several lines, and a guard that fired without victims re-arms at once above floor +
    rearm_headroom: lines within ALLOC_EPISODE_GAP_S of a FIRE never fire again.
    Outside that band, disabled, disarmed after a kill, or with no MemAvailable to judge by, it only alerts (once per
    episode). Anything that is not an allocation failure changes nothing.
    """
    if not failure.is_alloc_failure:
        return state, Corroboration(None)
    new_episode = state.last_failure_t is None or t - state.last_failure_t > ALLOC_EPISODE_GAP_S
    state = replace(state, last_failure_t=t)
    in_band = available_bytes is not None and available_bytes <= params.floor_bytes + params.warn_headroom_bytes
    recently_fired = state.last_fire_t is not None and t - state.last_fire_t <= ALLOC_EPISODE_GAP_S
    if params.enabled and in_band and guard_armed and not recently_fired:
        return replace(state, last_fire_t=t), Corroboration(FIRE, in_band=True, new_episode=new_episode)
    if new_episode:
        return state, Corroboration(ALERT, in_band=in_band, new_episode=True)
    return state, Corroboration(None, in_band=in_band)
