"""Pure decisions over frozen dataclasses, importable by every process and the CLI.

Nothing in this package does I/O or imports a module that does (the banned-api rule in sparkwatch/core/ruff.toml,
proved to fire by tests/test_lint.py), and it imports no other sparkwatch package (import-linter, pyproject.toml):
time, files and processes come in as arguments.

The basics every feature uses live here (model, enums, eventkinds, units, words, bounded, redact, urls,
userregex, livecache); each feature has a package of its own: engines/, kill/, launch/, driver/, postmortem/,
report/ (README.md, Layout, says what each module does).
"""
