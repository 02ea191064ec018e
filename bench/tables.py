"""What the benches share: the end of every bench (print the result text, write it to --out as bench/RESULTS-*.md),
and, for those that compare two trees, the baseline commit written out with `git archive`."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


def publish(text: str | Sequence[str], out: Path | None) -> str:
    """Print the result (lines are joined, ending with a newline) and write it to `out` when there is one."""
    if not isinstance(text, str):
        text = "\n".join(text) + "\n"
    print(text)
    if out is not None:
        out.write_text(text)
    return text


def git_short(root: Path, baseline: str) -> tuple[str, str, bool]:
    """(the baseline's short hash, HEAD's, whether sparkwatch/ has uncommitted changes)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout

    return (
        git("rev-parse", "--short", baseline).strip(),
        git("rev-parse", "--short", "HEAD").strip(),
        bool(git("status", "--porcelain", "sparkwatch").strip()),
    )


def archive_tree(root: Path, commit: str, dest: Path) -> Path:
    """The commit's sparkwatch/ package, written out under `dest` (`git archive`): a tree to put on PYTHONPATH."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", commit, "sparkwatch"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest
