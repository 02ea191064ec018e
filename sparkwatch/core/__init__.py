"""Pure decisions over frozen dataclasses. Nothing in this package does I/O or imports a module that does
(enforced by the banned-api rule in sparkwatch/core/ruff.toml)."""
