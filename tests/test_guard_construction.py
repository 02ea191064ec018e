"""The guard process is built in one direction (gpud's New()): each part from those built before it, given in its
constructor. No late-bound lambda closes a cycle back to the GuardProcess, and its constructor stays short."""

from __future__ import annotations

import ast
import inspect
import textwrap

from sparkwatch.guard import poolwatch, process


def _init(cls: type) -> ast.FunctionDef:
    source = textwrap.dedent(inspect.getsource(cls))
    (node,) = [n for n in ast.parse(source).body[0].body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]  # type: ignore[attr-defined]
    return node


def test_guard_process_init_is_under_50_lines() -> None:
    node = _init(process.GuardProcess)
    assert node.end_lineno is not None
    assert node.end_lineno - node.lineno + 1 < 50


def test_no_lambda_in_the_guard_process_init_reads_the_process_itself() -> None:
    """`lambda: self.guard.…` read an attribute assigned later in the same constructor: a cycle closed late."""
    for lam in (n for n in ast.walk(_init(process.GuardProcess)) if isinstance(n, ast.Lambda)):
        names = {n.id for n in ast.walk(lam.body) if isinstance(n, ast.Name)}
        assert "self" not in names, ast.unparse(lam)


def test_the_pool_watch_builds_none_of_its_collaborators() -> None:
    """Its meminfo reader, scanner, records, launched engines, kill path, kernel-log hook and budgets come in
    PoolParts, built before it."""
    calls = {
        n.func.id
        for n in ast.walk(_init(poolwatch.PoolWatch))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    built = {"MeminfoReader", "ProcScanner", "KillRecords", "KillPath", "KernelLogWatch", "BudgetWatch", "KillInbox"}
    assert not calls & built
    assert "LaunchedEngines" not in ast.unparse(_init(poolwatch.PoolWatch))


def test_the_config_schema_never_imports_the_loader() -> None:
    """config.settings imports the schema (lazily, for pydantic's sake); the schema imports config.errors and
    config.defaults, never the loader back: schema ↔ settings is no cycle."""
    import grimp

    graph = grimp.build_graph("sparkwatch", cache_dir=None)
    assert graph.find_shortest_chain(importer="sparkwatch.config.schema", imported="sparkwatch.config.settings") is None
    assert graph.find_shortest_chain(importer="sparkwatch.config.settings", imported="sparkwatch.config.schema")
