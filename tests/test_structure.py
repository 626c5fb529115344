"""The package's shape, checked from its source: no import circles, no module past ~450 lines, and family
files that describe math only (no choosing between FFN classes at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

import hotcold

SRC = Path(hotcold.__file__).parent
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in SRC.rglob("*.py")}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """hotcold modules `path` imports anywhere (top level or inside functions, `from x import y` counted
    as x.y when that is a module)."""
    out = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in known}


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports_of(p, set(mods)) - {m} for m, p in mods.items()}
    # a package's __init__ importing its submodules is not a cycle with them; drop parent -> child edges
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d) :] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_modules_stay_small():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split by concept: modules over {MAX_LINES} lines: {long}"


def test_family_files_do_not_pick_ffn_classes():
    """models/ asks the loader's make_ffn for each FFN and calls it as ffn(x, seq): never isinstance on one."""
    for path in (SRC / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                assert "FFN" not in ast.unparse(node), f"{path.name}: {ast.unparse(node)}"
