"""The llumlet's engine and migration code import in one direction: each engine package may use
the engine-neutral migration contract (`migration/ops.py`), migration never imports an engine,
and no import cycle exists among the llumlet's modules, counting imports inside functions and
under TYPE_CHECKING (a lazy import that closes a cycle is still a cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

LLUMLET = Path(__file__).resolve().parents[2] / "services" / "llumlet"


def _imports() -> dict[str, set[str]]:
    modules = {}
    for path in LLUMLET.rglob("*.py"):
        name = ".".join(path.relative_to(LLUMLET.parents[1]).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def test_migration_never_imports_an_engine() -> None:
    graph = _imports()
    offending = {(m, t) for m, targets in graph.items() if m.startswith("services.llumlet.migration")
                 for t in targets if t.startswith("services.llumlet.engines")}
    assert not offending


def test_no_import_cycle_among_the_llumlets_modules() -> None:
    graph = _imports()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append([*path[path.index(target):], target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles
