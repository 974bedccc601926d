"""The package's layers, as docs/ARCHITECTURE.md draws them: every module in one layer, no import
cycle (imports inside functions count: they only defer a cycle to run time), no import from a
layer to one above it except the known ones the page lists, and no stale line in that list."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "diffexport"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (a `from X import Y` whose Y is a
    submodule counts as an import of X.Y; so does `lazy_import("X")`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_import" and node.args
                and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)  # core/lazy.py: imported at first use, an import all the same
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def layer_table() -> list[tuple[str, list[str]]]:
    """(layer, module prefixes), top to bottom, from the page's table."""
    text = ARCHITECTURE.read_text()
    table = re.search(r"<!-- layers -->(.*?)<!-- /layers -->", text, re.S).group(1)
    rows = []
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows.append((cells[0], re.findall(r"`([\w.]+)`", cells[1])))
    assert rows, "no layer rows in docs/ARCHITECTURE.md"
    return rows


def rank_of(module: str, table) -> int | None:
    """The layer's height (0 = bottom) by the longest prefix that names the module."""
    best, best_len = None, -1
    for height, (_, prefixes) in enumerate(reversed(table)):
        for prefix in prefixes:
            # "diffexport" (the package's own __init__) names only itself: a new module must be placed
            if (module == prefix or ("." in prefix and module.startswith(prefix + "."))) and len(prefix) > best_len:
                best, best_len = height, len(prefix)
    return best


def known_upward() -> set[tuple[str, str]]:
    text = ARCHITECTURE.read_text()
    block = re.search(r"<!-- upward -->(.*?)<!-- /upward -->", text, re.S).group(1)
    return set(re.findall(r"^- `([\w.]+)` -> `([\w.]+)`", block, re.M))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    table = layer_table()
    missing = [m for m in modules() if rank_of(m, table) is None]
    assert not missing, f"modules in no layer of docs/ARCHITECTURE.md: {missing}"


def test_no_import_cycle():
    found = cycles(graph())
    assert not found, "import cycles (in-function imports included): " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_go_down_the_layers():
    table = layer_table()
    upward = {(a, b) for a, deps in graph().items() for b in deps if rank_of(b, table) > rank_of(a, table)}
    listed = known_upward()
    new = sorted(upward - listed)
    assert not new, ("imports from a layer to one above it (docs/ARCHITECTURE.md): "
                     + ", ".join(f"{a} -> {b}" for a, b in new))
    stale = sorted(listed - upward)
    assert not stale, ("docs/ARCHITECTURE.md lists upward imports that no longer exist (remove the lines): "
                       + ", ".join(f"{a} -> {b}" for a, b in stale))


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The checks above can fail: a planted cycle and a planted upward import are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    table = layer_table()
    assert rank_of("diffexport.cli", table) > rank_of("diffexport.validation", table)
    assert rank_of("diffexport.validation", table) > rank_of("diffexport.format.names", table)
    assert rank_of("diffexport.format.names", table) > rank_of("diffexport.core.contract", table)
    assert rank_of("diffexport.validation.decoder", table) == rank_of("diffexport.validation.inspect_onnx", table)


def test_a_lazy_import_is_an_import(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('from diffexport.core.lazy import lazy_import\n\nnames = '
                       'lazy_import("diffexport.format.names")\n')
    known = modules()
    assert imports_of("diffexport.planted", planted, known) == {"diffexport.core.lazy", "diffexport.format.names"}


MODULE_LINES = 800  # docs/ARCHITECTURE.md, "Module sizes"
CLI_LINES = 600


def line_limit(name: str) -> int:
    return CLI_LINES if name == "diffexport.cli" or name.startswith("diffexport.cli.") else MODULE_LINES


def known_oversize() -> set[str]:
    block = re.search(r"<!-- oversize -->(.*?)<!-- /oversize -->", ARCHITECTURE.read_text(), re.S).group(1)
    return set(re.findall(r"^- `([\w.]+)`", block, re.M))


def test_no_module_outgrows_its_limit():
    over = {name for name, path in modules().items() if len(path.read_text().splitlines()) > line_limit(name)}
    listed = known_oversize()
    assert not over - listed, ("modules over their line limit (docs/ARCHITECTURE.md, Module sizes): "
                               + ", ".join(sorted(over - listed)))
    assert not listed - over, ("docs/ARCHITECTURE.md lists modules within their limit (remove the lines): "
                               + ", ".join(sorted(listed - over)))


def test_the_readmes_layout_is_the_layer_table():
    """README's layout table names the same layers, in the same order, with each layer's folders."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| path | layer | what |"):].split("\n\n")[0]
    readme = []
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[1]:
            paths = re.findall(r"`(diffexport/[\w./]*)`", cells[0])
            readme.append((cells[1], [p.removesuffix(".py").removesuffix("/").replace("/", ".") for p in paths]))
    expected = [(layer, [p for p in prefixes if p != "diffexport"]) for layer, prefixes in layer_table()]
    assert readme == expected
