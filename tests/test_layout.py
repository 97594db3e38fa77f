"""The package's layout: no import circles (deferred imports included), no module over
500 lines, few modules at the top, and a thin command line that imports no private
module (see the contributing guide, "The layout")."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "xattn"
MAX_LINES = 500
MAX_TOP_LEVEL = 14  # modules and packages directly in src/xattn/
MAX_CLI_SHARE = 0.30


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The xattn modules that ``name`` imports anywhere in its body (inside functions
    too): ``from a import b`` counts ``a.b`` where that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in known and target != name)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imported_modules(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circles():
    graph = import_graph()
    # a package's __init__ that re-exports its own modules is not a circle of code
    graph = {name: {target for target in targets
                    if not (name.startswith(target + ".") and modules()[target].name
                            == "__init__.py")}
             for name, targets in graph.items()}
    assert circles(graph) == []


def test_no_module_over_500_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {name: size for name, size in sizes.items() if size > MAX_LINES} == {}


def test_few_modules_at_the_top():
    top = [path.name for path in PACKAGE.iterdir()
           if path.suffix == ".py" or (path.is_dir() and (path / "__init__.py").exists())]
    assert len(top) <= MAX_TOP_LEVEL, sorted(top)


def test_a_thin_command_line_of_public_imports():
    known = modules()
    lines = {name: len(path.read_text().splitlines()) for name, path in known.items()}
    cli = [name for name in known if name == "xattn.cli" or name.startswith("xattn.cli.")]
    share = sum(lines[name] for name in cli) / sum(lines.values())
    assert share <= MAX_CLI_SHARE
    private = {name: sorted(target for target in imported_modules(name, known[name], known)
                            if any(part.startswith("_") and not part.startswith("__")
                                   for part in target.split("."))
                            and not target.startswith("xattn.cli"))
               for name in cli}
    assert {name: targets for name, targets in private.items() if targets} == {}
