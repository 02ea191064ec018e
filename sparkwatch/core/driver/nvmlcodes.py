"""NVML's return codes: the one list sparkwatch uses (nvml.h names; tests hold them to pynvml's own constants).

telemetry.sources.nvml is the one adapter that calls NVML; the drift verdict (core.driver.drift), the exporter's help
text and the status view read the codes from here, so "9" and "18" are written once.
"""

from __future__ import annotations

from enum import IntEnum


class NvmlReturn(IntEnum):
    SUCCESS = 0
    ERROR_UNINITIALIZED = 1
    ERROR_NOT_SUPPORTED = 3  # a GB10 answers it for memory info, the memory clock and the power limit
    ERROR_DRIVER_NOT_LOADED = 9  # the kernel module is not loaded: a stranded driver after a kernel update
    ERROR_LIBRARY_NOT_FOUND = 12  # no libnvidia-ml.so
    ERROR_LIB_RM_VERSION_MISMATCH = 18  # the user-space library and the loaded module differ (until a reboot)


# NVML as a whole is unusable, not one field of one GPU: report down, shut down, initialise again next cycle.
FATAL_CODES: frozenset[int] = frozenset(
    {
        NvmlReturn.ERROR_UNINITIALIZED,
        NvmlReturn.ERROR_DRIVER_NOT_LOADED,
        NvmlReturn.ERROR_LIBRARY_NOT_FOUND,
        NvmlReturn.ERROR_LIB_RM_VERSION_MISMATCH,
    }
)

# Codes that prove an NVIDIA driver is installed even when nothing else could be read: NVML's library answered.
DRIVER_INSTALLED_CODES: frozenset[int] = frozenset(
    {NvmlReturn.ERROR_DRIVER_NOT_LOADED, NvmlReturn.ERROR_LIB_RM_VERSION_MISMATCH}
)

# What sparkwatch_gpu_nvml_return_code's values mean, for its help text and docs/contract.md.
RETURN_CODE_MEANINGS: tuple[tuple[NvmlReturn, str], ...] = (
    (NvmlReturn.SUCCESS, "success"),
    (NvmlReturn.ERROR_DRIVER_NOT_LOADED, "driver not loaded"),
    (NvmlReturn.ERROR_LIBRARY_NOT_FOUND, "library not found"),
    (NvmlReturn.ERROR_LIB_RM_VERSION_MISMATCH, "driver/library version mismatch"),
)


def meanings_text() -> str:
    """'0 success, 9 driver not loaded, 12 library not found, 18 driver/library version mismatch'."""
    return ", ".join(f"{int(code)} {text}" for code, text in RETURN_CODE_MEANINGS)
