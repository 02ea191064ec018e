"""What both processes (and the CLI) share, standard library only: the channel and its typed messages, the guard's
config as it travels (`guardconfig`), logging, syscalls, durable state files, the event log, the alert spool, the
systemd protocols, the component lifecycle, and the /proc readers in `sources/`.

What it may import: the standard library and `sparkwatch.core`. Never a third-party package, nor the guard,
telemetry, config, CLI or TUI packages (import-linter, pyproject.toml).
"""
