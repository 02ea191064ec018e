"""The guard process (and the telemetry process) is built in one direction (gpud's New()): each part from those built
before it, given in its constructor. No late-bound lambda closes a cycle back to the process object, and the guard's
constructor stays short."""

from __future__ import annotations

import ast
import inspect
import textwrap

from sparkwatch.guard import poolwatch, process
from sparkwatch.telemetry import telemetryprocess


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


def test_each_part_is_built_once() -> None:
    """No part is built and then rebuilt with one more field (`replace(links, recorder=…)`): each constructor call in
    GuardProcess.__init__ makes a part that is final."""
    calls = [
        ast.unparse(n.func)
        for n in ast.walk(_init(process.GuardProcess))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    ]
    assert "replace" not in calls


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
    config.defaults, never the loader back: schema ↔ settings is no cycle. Nor defaults ↔ schema: the stand-ins that
    build a real Settings on demand are config.standins, which the schema never imports."""
    import grimp

    graph = grimp.build_graph("sparkwatch", cache_dir=None)
    assert graph.find_shortest_chain(importer="sparkwatch.config.schema", imported="sparkwatch.config.settings") is None
    assert graph.find_shortest_chain(importer="sparkwatch.config.settings", imported="sparkwatch.config.schema")
    assert graph.find_shortest_chain(importer="sparkwatch.config.defaults", imported="sparkwatch.config.schema") is None
    assert graph.find_shortest_chain(importer="sparkwatch.config.schema", imported="sparkwatch.config.standins") is None


def test_no_module_imports_itself_back() -> None:
    """The package's import graph, lazy imports included, has no cycle: each strongly connected component (Tarjan's,
    iterative) is one module."""
    import grimp

    graph = grimp.build_graph("sparkwatch", cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, at = work.pop()
            if at == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for pos in range(at, len(edges[node])):
                nxt = edges[node][pos]
                if nxt not in index:
                    work += [(node, pos + 1), (nxt, 0)]
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    assert cycles == []


def test_no_lambda_in_the_telemetry_process_reads_the_process_itself() -> None:
    """The telemetry process is built the same way: each watch is given the parts built before it (the loop's
    `latest_engines`, the remote guard's `near_floor`), never a lambda that reads the process back."""
    source = textwrap.dedent(inspect.getsource(telemetryprocess.TelemetryProcess))
    for lam in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Lambda)):
        names = {n.id for n in ast.walk(lam.body) if isinstance(n, ast.Name)}
        assert "self" not in names, ast.unparse(lam)
