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


MAX_C_LINES = 1200


def test_c_kernels_are_one_unit_of_small_pieces():
    """_cpu_kernels.c only #includes the pieces in kernels/c/ and their header (one translation unit: inlining and the build
    cache work as one file), each piece at most MAX_C_LINES, every piece included once."""
    kernels = SRC / "kernels"
    unity = [ln for ln in (kernels / "_cpu_kernels.c").read_text().splitlines() if ln.startswith("#")]
    included = [ln.split('"')[1] for ln in unity]
    assert all(ln.startswith('#include "c/') for ln in unity), unity
    pieces = sorted(p.name for p in [*(kernels / "c").glob("*.c"), *(kernels / "c").glob("*.h")])
    assert sorted(i.removeprefix("c/") for i in included) == pieces
    long = {
        p.name: n for p in (kernels / "c").glob("*.c") if (n := len(p.read_text().splitlines())) > MAX_C_LINES
    }
    assert not long, f"split along a seam: C pieces over {MAX_C_LINES} lines: {long}"


def test_family_files_do_not_pick_ffn_classes():
    """models/ asks the loader's make_ffn for each FFN and calls it as ffn(x, seq): never isinstance on one."""
    for path in (SRC / "models").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                assert "FFN" not in ast.unparse(node), f"{path.name}: {ast.unparse(node)}"


# ---------------------------------------------------------------- names the checkout puts on sys.path

CHECKOUT = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("hotcold", "tests", "benchmarks")


def taken_top_level_names() -> set[str]:
    """Top-level import names of the standard library and of every installed distribution."""
    import importlib.metadata
    import sys

    return set(sys.stdlib_module_names) | set(importlib.metadata.packages_distributions())


def test_script_folders_shadow_no_installed_package():
    """`python benchmarks/x.py` puts benchmarks/ first on sys.path (scripts/*/ likewise): a file there named
    like an installed package replaces it for every library that imports it (benchmarks/kernels.py once
    hid Hugging Face's `kernels` from transformers, failing 340 tests)."""
    taken = taken_top_level_names()
    folders = [CHECKOUT / "benchmarks", *(p for p in (CHECKOUT / "scripts").iterdir() if p.is_dir())]
    clashes = sorted(
        str(p.relative_to(CHECKOUT))
        for folder in folders
        for p in folder.iterdir()
        if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.stem != "__init__" and p.stem in taken
    )
    assert not clashes, f"rename these: their names are taken by installed packages or the stdlib: {clashes}"


def test_collecting_and_importing_benchmarks_keeps_our_modules_in_our_packages():
    """After collecting every test and importing every benchmark (what a full run does), each module loaded
    from inside the checkout is under hotcold, tests or benchmarks: nothing of ours took a top-level name
    that a dependency could import."""
    import json
    import subprocess
    import sys

    probe = f"""
import importlib, json, sys, pathlib, pytest
checkout = pathlib.Path({str(CHECKOUT)!r})
rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(checkout / "tests")])
for p in sorted((checkout / "benchmarks").glob("*.py")):
    if p.stem != "__init__":
        importlib.import_module("benchmarks." + p.stem)
ours = {{}}
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None)
    # (absolute paths only: torch.ops and torch.classes carry bare names such as "_ops.py")
    if f and pathlib.Path(f).is_absolute() and pathlib.Path(f).resolve().is_relative_to(checkout) and name.split(".")[0] not in {OUR_PACKAGES!r}:
        ours[name] = f
print("RESULT " + json.dumps({{"rc": int(rc), "stray": ours}}))
"""
    res = subprocess.run(
        [sys.executable, "-c", probe], cwd=CHECKOUT, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"the probe failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["rc"] == 0, f"collection failed:\n{res.stdout[-3000:]}"
    assert not result["stray"], f"modules of the checkout under a top-level name not ours: {result['stray']}"


def test_readme_links_resolve_and_its_figures_are_the_results_page_figures():
    """The README's links point at files that exist, and each headline figure is, verbatim, the figure of a
    row of benchmarks/RESULTS.md (the page a user reads): the README never quotes a number the page lacks."""
    import re

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    if not (root / "benchmarks" / "RESULTS.md").exists():
        return  # an installed package without the checkout: nothing to compare
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if not target.startswith("http"):
            assert (root / target).exists(), f"README links to {target}, which does not exist"
    results = (root / "benchmarks" / "RESULTS.md").read_text()
    headline = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [
        r
        for r in headline.splitlines()
        if r.startswith("| ") and not r.startswith("| claim") and "---" not in r
    ]
    assert len(rows) >= 4
    for row in rows:
        claim, figure = (c.strip() for c in row.strip("|").split("|")[:2])
        if figure.startswith("not measured"):
            continue
        assert f"| {claim} | {figure} |" in results, (
            f"README figure not on the results page: {claim}: {figure}"
        )
