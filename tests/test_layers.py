"""The import layers of docs/architecture.md, enforced: every module of edgefl/ has exactly one
layer in the page's table, no import goes up the table, and no chain of imports is a cycle.

Imports are read with `ast`, not by importing: module-level ones and those inside functions
(a lazy import is still a dependency), relative and absolute, and `importlib.import_module`
with a literal name. The compiled core's Cython source is read for its Python imports too.
An import of edgefl.a.b is an import of the package edgefl.a as well (its __init__ runs
first), unless the importer is inside edgefl.a.
The checker itself is tested on made-up graphs, so a checker that finds nothing cannot pass
for a clean tree."""
from __future__ import annotations

import ast
import fnmatch
import os
import re
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "edgefl")
DOC = os.path.join(ROOT, "docs", "architecture.md")

# Upward imports or cycles tolerated while their fix is under way, each with its reason.
# test_known_violations_are_still_there fails as soon as a listed edge is gone, so an entry
# cannot outlive its fix.
KNOWN: dict = {}


# ---------------------------------------------------------------------------------------
# the layer table
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    number: int
    name: str
    patterns: tuple


def read_layers(text: str) -> list[Layer]:
    """The rows of the table under "## Layers": | number | name | `pattern`, ... | text |."""
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        raise ValueError("docs/architecture.md has no '## Layers' section")
    layers = []
    for line in section.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue                                     # prose, the header, the rule
        patterns = tuple(re.findall(r"`([^`]+)`", cells[2]))
        if not patterns:
            raise ValueError(f"layer {cells[0]} ({cells[1]}) names no module patterns")
        layers.append(Layer(int(cells[0]), cells[1], patterns))
    if not layers:
        raise ValueError("the '## Layers' section of docs/architecture.md has no table rows")
    numbers = [layer.number for layer in layers]
    if numbers != list(range(1, len(layers) + 1)):
        raise ValueError(f"layers are numbered {numbers}, not 1..{len(layers)} in order")
    return layers


def layers_of(module: str, layers: list[Layer]) -> list[Layer]:
    return [layer for layer in layers
            if any(fnmatch.fnmatchcase(module, p) for p in layer.patterns)]


# ---------------------------------------------------------------------------------------
# reading imports
# ---------------------------------------------------------------------------------------

def module_files(package_dir: str = PACKAGE) -> dict:
    """{dotted module name: source path} of every .py (and the core's .pyx) under edgefl/."""
    out = {}
    base = os.path.dirname(package_dir)
    for directory, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if ext not in (".py", ".pyx"):
                continue
            parts = os.path.relpath(os.path.join(directory, stem), base).split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = os.path.join(directory, name)
    return out


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if level - 1 > len(parts) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package")
    base = parts[:len(parts) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_in(source: str, module: str, is_package: bool, known: set) -> dict:
    """{imported edgefl module: first line number} of one module's source. `from X import
    name` is an import of X.name when that is a module in `known`, else of X."""
    tree = ast.parse(source)
    found: dict = {}

    def add(target: str, line: int) -> None:
        if target == "edgefl" or target.startswith("edgefl."):
            found.setdefault(target, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module if node.level == 0 else \
                _resolve_relative(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
        elif isinstance(node, ast.Call) and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name == "import_module":
                add(node.args[0].value, node.lineno)
    found.pop(module, None)
    return found


_PYX_IMPORT = re.compile(r"^[ \t]*(?:from\s+(\.*[\w.]*)\s+import\s+([\w, ()]+)|import\s+([\w.]+))",
                         re.M)


def pyx_imports(source: str, module: str, known: set) -> dict:
    """The Python-level imports of a Cython file (its `cimport`s are C, not modules)."""
    found: dict = {}
    for match in _PYX_IMPORT.finditer(source):
        line = source.count("\n", 0, match.start()) + 1
        if match.group(3):
            targets = [match.group(3)]
        else:
            dots = len(match.group(1)) - len(match.group(1).lstrip("."))
            base = match.group(1) if dots == 0 else \
                _resolve_relative(module, False, dots, match.group(1)[dots:] or None)
            names = [n.strip() for n in match.group(2).strip("() ").split(",") if n.strip()]
            targets = [f"{base}.{n}" if f"{base}.{n}" in known else base for n in names]
        for target in targets:
            if target == "edgefl" or target.startswith("edgefl."):
                found.setdefault(target, line)
    return found


def import_graph(package_dir: str = PACKAGE) -> dict:
    """{module: {imported module: line}} over edgefl/, with the packages each import runs
    (with_packages)."""
    files = module_files(package_dir)
    known = set(files)
    graph = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            source = f.read()
        if path.endswith(".pyx"):
            graph[module] = pyx_imports(source, module, known)
        else:
            graph[module] = imports_in(source, module, path.endswith("__init__.py"), known)
    return with_packages(graph)


def packages_of(module: str) -> set:
    """The packages above a dotted module name: edgefl.a.b -> {edgefl, edgefl.a}."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def with_packages(graph: dict) -> dict:
    """Each import of edgefl.a.b is also one of edgefl.a, at the same line: Python runs
    edgefl/a/__init__.py before edgefl/a/b.py, so the importer depends on what that imports.
    Not of the importer's own packages (edgefl itself, for every module): they are running
    already when it imports, and a package's __init__ that imports its own modules is no
    cycle."""
    out = {}
    for module, targets in graph.items():
        running = packages_of(module) | {module}
        edges = dict(targets)
        for target, line in targets.items():
            for package in sorted(packages_of(target) - running):
                edges.setdefault(package, line)
        out[module] = edges
    return out


# ---------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------

def unplaced(modules, layers: list[Layer]) -> list[str]:
    """A message for each module matched by no layer or by more than one."""
    out = []
    for module in sorted(modules):
        matched = layers_of(module, layers)
        if not matched:
            out.append(f"{module}: no layer in docs/architecture.md names it")
        elif len(matched) > 1:
            out.append(f"{module}: named by layers "
                       f"{', '.join(f'{m.number} ({m.name})' for m in matched)}")
    return out


def missing_modules(graph: dict) -> list[str]:
    """A message for each import of an edgefl module that does not exist (a relative import
    left one level short when its module moved into a package, say): Python would only say
    so when that line runs."""
    return [f"{m} imports {t} at line {line}, which is no module of edgefl"
            for m, targets in sorted(graph.items()) for t, line in sorted(targets.items())
            if t not in graph]


def upward_imports(graph: dict, layers: list[Layer], allowed=frozenset()) -> list[str]:
    """A message for each import of a module in a higher layer than the importer's."""
    out = []
    for module in sorted(graph):
        own = layers_of(module, layers)
        for target, line in sorted(graph[module].items()):
            theirs = layers_of(target, layers)
            if (module, target) in allowed or len(own) != 1 or len(theirs) != 1:
                continue                       # unplaced modules are reported on their own
            if theirs[0].number > own[0].number:
                # a package the line imports only by importing a module of it (with_packages)
                via = next((t for t in sorted(graph[module]) if t.startswith(target + ".")),
                           None)
                out.append(f"{module} (layer {own[0].number}, {own[0].name}) imports {target} "
                           f"(layer {theirs[0].number}, {theirs[0].name}) at line {line}"
                           + (f" (its __init__, run by importing {via})" if via else ""))
    return out


def cycles(graph: dict, allowed=frozenset()) -> list[list[str]]:
    """One cycle (a closed chain of modules) for each strongly connected component of more
    than one module (Tarjan's algorithm, iteratively: no recursion limit)."""
    edges = {m: sorted(t for t in targets if t in graph and (m, t) not in allowed)
             for m, targets in graph.items()}
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(edges[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(set(component))
    return [_chain_within(component, edges) for component in components]


def _chain_within(component: set, edges: dict) -> list[str]:
    """A shortest closed chain start -> ... -> start inside a strongly connected component."""
    start = min(component)
    previous, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in edges[node]:
                if nxt == start:
                    chain = [node]
                    while previous[chain[-1]] is not None:
                        chain.append(previous[chain[-1]])
                    return [start] + chain[::-1][1:] + [start] if len(chain) > 1 \
                        else [start, start]
                if nxt in component and nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


# ---------------------------------------------------------------------------------------
# the tree
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layers():
    with open(DOC, encoding="utf-8") as f:
        return read_layers(f.read())


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_every_module_has_exactly_one_layer(graph, layers):
    problems = unplaced(graph, layers)
    assert not problems, "\n".join(problems)


def test_every_import_names_a_module_that_exists(graph):
    problems = missing_modules(graph)
    assert not problems, "\n".join(problems)


def test_the_checker_reports_an_import_of_a_missing_module():
    graph = {"edgefl.sim": {}, "edgefl.sim.over_broker": {"edgefl.sim.roles": 35}}
    assert missing_modules(graph) == ["edgefl.sim.over_broker imports edgefl.sim.roles at "
                                      "line 35, which is no module of edgefl"]


def test_no_import_goes_up_the_layers(graph, layers):
    problems = upward_imports(graph, layers, KNOWN)
    assert not problems, "imports that go up docs/architecture.md's layers:\n" + \
        "\n".join(problems)


def test_no_import_cycles(graph):
    found = cycles(graph, KNOWN)
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_known_violations_are_still_there(graph):
    gone = sorted(edge for edge in KNOWN if edge[1] not in graph.get(edge[0], {}))
    assert not gone, f"fixed: remove {gone} from KNOWN in tests/test_layers.py"


def test_the_graph_reads_the_tree():
    """A guard against a checker that sees nothing: known edges of today's tree are found,
    including a relative import, an import inside a function and the compiled core's."""
    g = import_graph()
    assert "edgefl.sim" in g and "edgefl._core" in g and "edgefl.transport" in g
    assert "edgefl.errors" in g["edgefl._core"]                       # .pyx, relative
    assert "edgefl.kernels" in g["edgefl"]                            # package root
    assert "edgefl.transport.wire" in g["edgefl.roles.state"]         # from ..transport import
    assert "edgefl.roles.onnx_channel" in g["edgefl.roles.aggregator"]   # inside a method


# ---------------------------------------------------------------------------------------
# the checker on made-up input
# ---------------------------------------------------------------------------------------

TABLE = """# x

## Layers

| layer | name | modules | what |
|---|---|---|---|
| 1 | low | `edgefl.low`, `edgefl.low.*` | bottom |
| 2 | high | `edgefl.high` | top |

## Next
| 3 | not | `edgefl.elsewhere` | not part of the table |
"""


def test_read_layers_takes_only_the_layers_section():
    layers = read_layers(TABLE)
    assert [(layer.number, layer.name, layer.patterns) for layer in layers] == \
        [(1, "low", ("edgefl.low", "edgefl.low.*")), (2, "high", ("edgefl.high",))]
    with pytest.raises(ValueError, match="no '## Layers' section"):
        read_layers("# nothing\n")
    with pytest.raises(ValueError, match=r"numbered \[1, 3\]"):
        read_layers(TABLE.replace("| 2 | high", "| 3 | high"))


def test_the_checker_reports_a_cycle_and_an_upward_import():
    layers = read_layers(TABLE)
    graph = {"edgefl.low": {"edgefl.low.a": 3},
             "edgefl.low.a": {"edgefl.low.b": 5},
             "edgefl.low.b": {"edgefl.high": 7},                  # up, and closes a cycle
             "edgefl.high": {"edgefl.low": 1}}
    assert cycles(graph) == [["edgefl.high", "edgefl.low", "edgefl.low.a", "edgefl.low.b",
                              "edgefl.high"]]
    assert upward_imports(graph, layers) == [
        "edgefl.low.b (layer 1, low) imports edgefl.high (layer 2, high) at line 7"]
    # an allowed edge is neither a violation nor part of a cycle
    allowed = {("edgefl.low.b", "edgefl.high")}
    assert cycles(graph, allowed) == [] and upward_imports(graph, layers, allowed) == []
    # a cycle inside one layer is still a cycle
    assert cycles({"edgefl.low.a": {"edgefl.low.b": 1}, "edgefl.low.b": {"edgefl.low.a": 1}}) \
        == [["edgefl.low.a", "edgefl.low.b", "edgefl.low.a"]]


# a made-up package whose package edgefl.pkg sits above its module edgefl.pkg.leaf
TREE_TABLE = """## Layers

| layer | name | modules | what |
|---|---|---|---|
| 1 | low | `edgefl`, `edgefl.low`, `edgefl.pkg.leaf`, `edgefl.pkg.sibling` | bottom |
| 2 | high | `edgefl.high`, `edgefl.pkg` | top |
"""
TREE = {
    "__init__.py": "",
    "low.py": "import edgefl.pkg.leaf\n",
    "high.py": "",
    "pkg/__init__.py": "from edgefl import high\nfrom . import sibling\n",
    "pkg/leaf.py": "",
    "pkg/sibling.py": "from .leaf import x\n",
}


def write_tree(root, files: dict) -> str:
    for name, text in files.items():
        path = root / "edgefl" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root / "edgefl")


def test_an_import_of_a_module_runs_its_packages_init(tmp_path):
    """`import edgefl.pkg.leaf` runs edgefl/pkg/__init__.py first, so edgefl.low depends on
    what that imports (edgefl.high, a layer up) as surely as if it imported it itself. The
    importer's own packages (edgefl, for every module; edgefl.pkg for its sibling) are
    running already when it imports: no edge to them, or every package that imports its
    own modules would be a cycle."""
    layers = read_layers(TREE_TABLE)
    graph = import_graph(write_tree(tmp_path, TREE))
    assert graph["edgefl.low"] == {"edgefl.pkg.leaf": 1, "edgefl.pkg": 1}
    assert graph["edgefl.pkg.sibling"] == {"edgefl.pkg.leaf": 1}
    assert upward_imports(graph, layers) == [
        "edgefl.low (layer 1, low) imports edgefl.pkg (layer 2, high) at line 1 (its "
        "__init__, run by importing edgefl.pkg.leaf)"]
    assert cycles(graph) == []
    # and a package's __init__ that imports its importer closes a cycle
    graph = import_graph(write_tree(tmp_path, {"pkg/__init__.py": "import edgefl.low\n"}))
    assert cycles(graph) == [["edgefl.low", "edgefl.pkg", "edgefl.low"]]


def test_the_checker_reports_unplaced_and_doubly_placed_modules():
    layers = read_layers(TABLE.replace("`edgefl.high` |", "`edgefl.high`, `edgefl.low.x` |"))
    assert unplaced(["edgefl.low.a", "edgefl.low.x", "edgefl.nowhere"], layers) == [
        "edgefl.low.x: named by layers 1 (low), 2 (high)",
        "edgefl.nowhere: no layer in docs/architecture.md names it"]


def test_imports_are_read_in_every_form():
    source = """
import os
import edgefl.kernels
from . import sibling, pkg
from .. import __version__
from ..transport import wire
from edgefl.data import datasets as d

def later():
    from ..sim import run_aggregator
    import importlib
    importlib.import_module("edgefl.export.onnx")
    return run_aggregator
"""
    known = {"edgefl.roles.sibling", "edgefl.transport.wire", "edgefl.data.datasets"}
    found = imports_in(source, "edgefl.roles.state", False, known)
    assert found == {"edgefl.kernels": 3, "edgefl.roles.sibling": 4, "edgefl.roles": 4,
                     "edgefl": 5, "edgefl.transport.wire": 6, "edgefl.data.datasets": 7,
                     "edgefl.sim": 10, "edgefl.export.onnx": 12}
    # in a package's __init__, `.` is the package itself
    assert imports_in("from .kernels import backend\n", "edgefl", True, {"edgefl.kernels"}) \
        == {"edgefl.kernels": 1}
    pyx = "from libc.stdint cimport int8_t\ncimport numpy as cnp\nimport threading\n" \
          "from .errors import KernelError, NonFiniteError\n"
    assert pyx_imports(pyx, "edgefl._core", {"edgefl.errors"}) == {"edgefl.errors": 4}


# ---------------------------------------------------------------------------------------
# the page's list of long modules
# ---------------------------------------------------------------------------------------

LONG = 600          # "A module should stay under about 600 lines"


def long_module_list(text: str) -> set:
    """The edgefl/... files the "## Modules over 600 lines" section names."""
    section = re.search(r"^## Modules over 600 lines\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    if section is None:
        raise ValueError("docs/architecture.md has no '## Modules over 600 lines' section")
    return set(re.findall(r"`(edgefl/[\w/]+\.pyx?)`", section.group(1)))


def test_every_long_module_is_explained():
    """A module past the mark is named, with its reason, in the page's list, and one named
    there is still past it: the list says which modules are long today."""
    with open(DOC, encoding="utf-8") as f:
        named = long_module_list(f.read())
    lengths = {}
    for path in module_files().values():
        with open(path, encoding="utf-8") as f:
            lengths[os.path.relpath(path, ROOT)] = sum(1 for _ in f)
    long = {path for path, n in lengths.items() if n > LONG}
    unexplained = sorted(f"{p} ({lengths[p]} lines)" for p in long - named)
    stale = sorted(f"{p} ({lengths.get(p, 'no such file')} lines)" for p in named - long)
    assert not unexplained and not stale, (
        f"docs/architecture.md 'Modules over {LONG} lines': not listed: {unexplained}; "
        f"listed but not over {LONG}: {stale}")


def test_the_long_module_list_is_read():
    text = "# x\n\n## Modules over 600 lines\n\n- `edgefl/a.py`: why\n- `edgefl/b/c.pyx` " \
           "(about 700)\n\n## Next\n\n- `edgefl/d.py`\n"
    assert long_module_list(text) == {"edgefl/a.py", "edgefl/b/c.pyx"}
    with pytest.raises(ValueError, match="no '## Modules over 600 lines' section"):
        long_module_list("# x\n")
