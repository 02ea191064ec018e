"""The long-running loops, one thread (or two) each: they read through sources, decide through core and act through
actuators. guard (the kill loop, never waiting on anything else), telemetry (the snapshot the exporter and `status`
read), driverwatch (driver drift every minute and on udev events), headroom (low-headroom alerts)."""
