"""trnkit's import graph, drawn from the code: data flows one way (harness -> qwen3 -> overrides -> kernels ->
nki_api -> nkisim), no package imports back up that line, no two packages import each other (directly or
round a longer loop), no two modules do either (inside a package too), and DESIGN.md's drawing is this graph."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trnkit"
LAYERS = ("harness", "qwen3", "overrides", "kernels", "nki_api", "nkisim")  # each imports only those after it
Graph = dict[str, dict[str, set[str]]]  # unit -> {unit it imports: {"m" module level, "f" inside a function}}


def _unit(module: str) -> str:
    """The top-level package or module of ``trnkit.<unit>...`` (``trnkit`` for the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "trnkit"


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The modules an import statement runs: ``from p import name`` is module ``p.name`` where that is one."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]


def import_graph(package: Path = PACKAGE, unit: Callable[[str], str] = _unit) -> Graph:
    """Every edge between the units of ``package`` (its top-level packages and modules; ``unit=str``: every
    module); imports under ``if TYPE_CHECKING`` do not run and are left out."""
    paths = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: Graph = defaultdict(lambda: defaultdict(set))
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        source = unit(module)

        def visit(node: ast.AST, lazy: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _imported(child, module, is_package, set(paths)):
                        if (target == "trnkit" or target.startswith("trnkit.")) and unit(target) != source:
                            graph[source][unit(target)].add("f" if inner else "m")
                visit(child, inner)

        visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return {unit: dict(targets) for unit, targets in graph.items()}


def cycles(graph: Graph) -> list[list[str]]:
    """Each import loop between units, as the path that closes it."""
    found, done = [], set()

    def walk(unit: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(unit, {})):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                walk(nxt, path + [nxt])
        done.add(unit)

    for unit in sorted(graph):
        walk(unit, [unit])
    return found


def drawn_graph(text: str) -> Graph:
    """The graph DESIGN.md draws: the lines ``unit -> target (m), target (f+m), ...`` of the first text block
    under "Dependency graph" (``#`` starts a comment)."""
    section = text.split("## Dependency graph", 1)[1]
    block = section.split("```text", 1)[1].split("```", 1)[0]
    graph: Graph = {}
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            unit, targets = (s.strip() for s in line.split("->", 1))
            graph[unit] = {m.group(1): set(m.group(2).split("+"))
                           for m in re.finditer(r"([\w.]+) \(([fm+]+)\)", targets)}
    return graph


def test_no_back_edge_along_the_data_path() -> None:
    graph = import_graph()
    back = [(a, b) for i, a in enumerate(LAYERS) for b in LAYERS[:i] if b in graph.get(a, {})]
    assert back == []


def test_no_import_cycle_between_packages() -> None:
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_modules() -> None:
    assert cycles(import_graph(unit=str)) == []


def test_the_checks_see_a_back_edge_and_a_cycle(tmp_path: Path) -> None:
    (tmp_path / "trnkit" / "kernels").mkdir(parents=True)
    (tmp_path / "trnkit" / "__init__.py").write_text("")
    (tmp_path / "trnkit" / "kernels" / "__init__.py").write_text("from ..overrides import ops\n")
    (tmp_path / "trnkit" / "overrides.py").write_text("def f():\n    from trnkit import kernels\n")
    graph = import_graph(tmp_path / "trnkit")
    assert graph == {"kernels": {"overrides": {"m"}}, "overrides": {"kernels": {"f"}}}
    assert cycles(graph) == [["kernels", "overrides", "kernels"]]
    # inside one package: its __init__ imports a module that imports the package back (lazily)
    (tmp_path / "trnkit" / "kernels" / "__init__.py").write_text("from .tiles import helper\n")
    (tmp_path / "trnkit" / "kernels" / "tiles.py").write_text("def helper():\n    from trnkit import kernels\n")
    (tmp_path / "trnkit" / "overrides.py").write_text("from trnkit.kernels import tiles\n")
    assert cycles(import_graph(tmp_path / "trnkit")) == []
    assert import_graph(tmp_path / "trnkit", unit=str)["trnkit.overrides"] == {"trnkit.kernels.tiles": {"m"}}
    assert cycles(import_graph(tmp_path / "trnkit", unit=str)) == [
        ["trnkit.kernels", "trnkit.kernels.tiles", "trnkit.kernels"]]


def test_design_md_draws_the_graph_of_the_code() -> None:
    drawn, code = drawn_graph((ROOT / "DESIGN.md").read_text(encoding="utf-8")), import_graph()
    stale = sorted(u for u in drawn.keys() | code.keys() if drawn.get(u) != code.get(u))
    lines = [f"{u} -> " + ", ".join(f"{t} ({'+'.join(sorted(k))})" for t, k in sorted(code.get(u, {}).items()))
             for u in stale]
    assert not stale, "DESIGN.md's dependency graph differs from the code; the code's lines:\n" + "\n".join(lines)


def test_only_packaged_imports_tomllib() -> None:
    """pyproject allows Python 3.10, which has no ``tomllib``: ``trnkit.packaged`` falls back to ``tomli`` there,
    and every other module reads TOML through it (``trnkit.harness.config`` imported tomllib itself)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if "tomllib" in names and path.name != "packaged.py":
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
