"""README.md's Layout names every package and module under sparkwatch/, one line each, and nothing that is not there;
no two modules share a file name; and core/'s purity rule reaches every feature package of core/."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sparkwatch"
EXEMPT = {"__init__.py", "__main__.py"}  # a package's own files: their names repeat by design


def layout_lines() -> list[str]:
    """The lines of the fenced block that ends README.md's Layout section."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert blocks, "README.md's Layout section has no fenced block"
    return str(blocks[-1]).splitlines()


def listed() -> tuple[set[str], set[str]]:
    """(packages and directories, modules) the Layout names, as paths relative to the repository root."""
    dirs: set[str] = set()
    modules: set[str] = set()
    current = ""
    for line in layout_lines():
        head = re.match(r"^(\S+/)\s{2,}\S", line)
        module = re.match(r"^  (\S+\.py)\s{2,}\S", line)
        if head:
            current = head[1]
            dirs.add(current)
        elif module:
            assert current, f"a module line before any directory: {line!r}"
            modules.add(current + module[1])
        else:
            assert re.match(r"^\S+/$", line), f"not a Layout line (path, two spaces, what it does): {line!r}"
            current = line
    return dirs, modules


def in_tree() -> tuple[set[str], set[str]]:
    """(packages, modules) under sparkwatch/; a probe a test writes for a moment (_probe_*) is not part of it."""
    files = [p for p in PACKAGE.rglob("*.py") if not p.name.startswith("_probe") and "__pycache__" not in p.parts]
    packages = {p.parent.relative_to(ROOT).as_posix() + "/" for p in files if p.name == "__init__.py"}
    modules = {p.relative_to(ROOT).as_posix() for p in files if p.name != "__init__.py"}
    return packages, modules


def test_every_module_and_package_has_its_line() -> None:
    dirs, modules = listed()
    packages, tree_modules = in_tree()
    assert sorted(tree_modules - modules) == [], "modules missing from README.md's Layout"
    assert sorted(packages - dirs) == [], "packages missing from README.md's Layout"


def test_the_layout_names_nothing_that_is_not_there() -> None:
    dirs, modules = listed()
    assert sorted(m for m in modules if not (ROOT / m).is_file()) == []
    assert sorted(d for d in dirs if not (ROOT / d).is_dir()) == []


def test_file_names_are_unique_across_packages() -> None:
    _, modules = in_tree()
    by_name: dict[str, list[str]] = {}
    for module in sorted(modules):
        name = module.rsplit("/", 1)[-1]
        if name not in EXEMPT:
            by_name.setdefault(name, []).append(module)
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}


def test_core_purity_rule_reaches_every_feature_package() -> None:
    """sparkwatch/core/ruff.toml bans I/O in core; ruff takes the nearest config, so a probe in each feature package
    (core/kill/, core/launch/, ...) must be refused too (test_lint.py proves it for core/ itself)."""
    features = sorted(p.parent for p in (PACKAGE / "core").glob("*/__init__.py"))
    assert features, "core/ has no feature packages"
    probes = [feature / "_probe_impure.py" for feature in features]
    try:
        for probe in probes:
            probe.write_text("import os\n\nCWD = os.getcwd()\n")
        out = subprocess.run(
            [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "json", *map(str, probes)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)
    refused = {Path(d["filename"]) for d in json.loads(out.stdout) if d["code"] == "TID251"}
    assert refused == set(probes), out.stdout


def test_launch_is_by_its_parts() -> None:
    """`sparkwatch launch` is a package of small parts (cli/launch/__init__.py names each): no module over 400 lines,
    and the package's own list names every one."""
    parts = sorted((PACKAGE / "cli" / "launch").glob("*.py"))
    too_long = {p.name: n for p in parts if (n := len(p.read_text().splitlines())) > 400}
    assert too_long == {}
    listed_there = (PACKAGE / "cli" / "launch" / "__init__.py").read_text()
    assert [p.name for p in parts if p.name not in EXEMPT and p.name not in listed_there] == []
