"""The telemetry process: everything that watches and reports, supervised by the guard and restarted when it stalls.

What runs here: the telemetry loop (`loop`: the /proc census, compilers, JIT caches, NVML), the metrics endpoint
(`exporter/`), the alert outbox (`outbox/`), the driver check (`driver`) and its udev trigger, the low-headroom
alerts (`headroom`), and the guard's state as the channel carries it (`remote`). `process` wires them;
`python -m sparkwatch.telemetry` starts it (the guard does, with its end of the channel).

What it may import: anything but `sparkwatch.guard` (the two processes share only `sparkwatch.common` and
`sparkwatch.core`; import-linter holds them independent). Sources only telemetry reads are in `sources/`.
"""
