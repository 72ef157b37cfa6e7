"""No import circles among pagedllm's modules (issue 33, item 18).

The graph is read from the source with `ast`, not by importing: an edge A -> B
for every `import`/`from ... import` of B anywhere in A, at module level or
inside a function (a function-level import is a circle that only waits for
its first call), and inside `if TYPE_CHECKING:` too (a type checker follows
it). `from pkg import name` is an edge to `pkg.name` when that is a module,
else to `pkg` (its `__init__`). Importing `pkg.sub` is not counted as an edge
to `pkg`: every submodule would otherwise form a circle with a package whose
`__init__` re-exports it.

Circles are found as strongly connected components (Tarjan). A component of
more than one module is a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Circles known and left to other work: none. A component found must lie inside one
# of these (a known circle may shrink or vanish; nothing else may appear). The one
# through cli.py is gone (cli_errors.py), and so is the one through ops/__init__.py
# (the kernel-chain switch lives in ops/kernel_chain.py).
KNOWN_CYCLES: dict[str, frozenset[str]] = {}


def module_files(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package `__init__`), for every .py under root/package."""
    mods: dict[str, tuple[Path, bool]] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports (anywhere in its source)."""
    mods = module_files(root, package)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        base = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from . import x, from ..y import z
                    anchor = base
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    source = f"{anchor}.{node.module}" if node.module else anchor
                else:
                    source = node.module or ""
                for alias in node.names:
                    if f"{source}.{alias.name}" in mods:
                        edges[name].add(f"{source}.{alias.name}")
                    elif source in mods:
                        edges[name].add(source)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred nodes deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\n")
    (pkg / "c.py").write_text("import pkg.a\n")  # into the circle, not part of it
    edges = import_graph(tmp_path, "pkg")
    assert edges["pkg.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.a"}
    assert cycles(edges) == [frozenset({"pkg.a", "pkg.sub.b"})]


def test_the_runner_imports_no_circle() -> None:
    """runner/model_runner.py and runner/tp_workers.py imported each other; the
    runner now names the workers' shape (`RankWorkers`) instead."""
    edges = import_graph(SRC, "pagedllm")
    assert "pagedllm.runner.model_runner" in edges["pagedllm.runner.tp_workers"]
    assert "pagedllm.runner.tp_workers" not in edges["pagedllm.runner.model_runner"]
    runner = [c for c in cycles(edges) if any(m.startswith("pagedllm.runner.") for m in c)]
    assert runner == []


def test_no_import_circle_in_the_package_but_the_known_ones() -> None:
    found = cycles(import_graph(SRC, "pagedllm"))
    new = [sorted(c) for c in found if not any(c <= known for known in KNOWN_CYCLES.values())]
    assert new == [], f"import circles: {new}"
