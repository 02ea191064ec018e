"""What people read in a terminal: `engines`, `events` and `status`. Only the CLI imports it (rich stays out of both
daemon processes: import-linter, pyproject.toml).

Views are pure: they take records and return rich renderables or strings, so tests render them without a terminal.
Only `console.py` knows about the output stream.
"""
