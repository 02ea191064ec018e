"""The guard process: the unit's main PID, mlocked, small. It keeps the box alive.

What runs here: the pool watch (`poolwatch`: MemAvailable through a kept-open fd, the trigger, the kill policy),
the killer and reaper (`killer`, and `ttynote`: one line on a killed engine's terminal), per-engine budgets
(`budgets`), the engines `sparkwatch launch` declared (`launchwatch`), the flight recorder (`recorder`), the
kernel-log hook (`kernlog`), sd_notify and the watchdog, and the supervisor of the telemetry process (`supervisor`,
with what telemetry reports in `gpuboard`). `process` wires them and handles signals and reloads; `start` execs
`python -m sparkwatch.guard`, the one way in, for `sparkwatch run` and for a restart over the RSS cap.

What it may import: the standard library, `sparkwatch.core` (pure decisions) and `sparkwatch.common` (stdlib-only
I/O both processes share). Never pydantic, NVML, prometheus_client, rich, HTTP or TLS, nor
`sparkwatch.telemetry`, `sparkwatch.config`, `sparkwatch.cli` or `sparkwatch.tui`: `scripts/lint` checks it
transitively (import-linter, pyproject.toml), and a test holds the modules the process really loads to an allow list.
"""
