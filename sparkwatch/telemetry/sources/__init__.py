"""Read-only adapters only the telemetry process (and the CLI) use: NVML (one module owns it), udev, the JIT caches,
the driver packages, process environments. Each takes its root as an argument."""
