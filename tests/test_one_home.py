"""Each concern has one home (docs/architecture.md, "Where each concern lives"), checked on
the source with `ast`, not by importing:

- no two functions or methods of edgefl/ have the same body (the docstring aside): a copy
  is a second home that drifts from the first when one of them is fixed;

Each checker is also run on made-up source, so a checker that finds nothing cannot pass for
a clean tree."""
from __future__ import annotations

import ast
import os
from collections import defaultdict

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "edgefl")

# A body this small (counted in AST nodes) may well be the same twice by chance: a property
# returning len(x), a one-line delegation to a shared helper, an http handler's log_message.
MIN_NODES = 20

# Groups of identical functions tolerated while their merge is under way, each as the set
# of "path:qualified name". test_known_duplicates_are_still_there fails as soon as one is
# gone, so an entry cannot outlive its fix.
KNOWN_DUPLICATES: list = [
]


def python_files(package_dir: str = PACKAGE) -> dict:
    """{path relative to the repository: source} of every .py under edgefl/."""
    out = {}
    for directory, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                with open(path, encoding="utf-8") as f:
                    out[os.path.relpath(path, os.path.dirname(package_dir))] = f.read()
    return out


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def duplicate_functions(sources: dict, min_nodes: int = MIN_NODES) -> list:
    """Sorted groups (sorted lists of "path:name") of functions whose arguments and body,
    the docstring left out, are the same, for bodies of at least `min_nodes` AST nodes."""
    groups = defaultdict(list)
    for path, source in sorted(sources.items()):
        for name, node in _functions(ast.parse(source)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                body = body[1:]
            module = ast.Module(body=body, type_ignores=[])
            if sum(1 for _ in ast.walk(module)) < min_nodes:
                continue
            groups[ast.dump(node.args) + ast.dump(module)].append(f"{path}:{name}")
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


# ---------------------------------------------------------------------------------------
# the tree
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def duplicates():
    return duplicate_functions(python_files())


def test_no_function_is_written_twice(duplicates):
    known = [sorted(g) for g in KNOWN_DUPLICATES]
    found = [g for g in duplicates if g not in known]
    assert not found, "the same function in two places (give it one home and call it " \
        "from both):\n" + "\n".join(" = ".join(g) for g in found)


def test_known_duplicates_are_still_there(duplicates):
    gone = [sorted(g) for g in KNOWN_DUPLICATES if sorted(g) not in duplicates]
    assert not gone, f"merged: remove {gone} from KNOWN_DUPLICATES in tests/test_one_home.py"


# ---------------------------------------------------------------------------------------
# the checkers on made-up input
# ---------------------------------------------------------------------------------------

def test_the_checker_finds_a_copied_function_whatever_its_docstring():
    body = "    total = 0\n    for b in buffers.values():\n        total += b.nbytes * 2\n" \
           "    return total + len(buffers) - 1\n"
    a = "def size(buffers):\n    '''One.'''\n" + body
    b = "class T:\n    def size(buffers):\n        '''Two.'''\n" + \
        "".join("    " + line + "\n" for line in body.splitlines())
    other = "def size(buffers):\n" + body.replace("* 2", "* 3")
    found = duplicate_functions({"a.py": a, "b.py": b, "c.py": other}, min_nodes=5)
    assert found == [["a.py:size", "b.py:T.size"]]
    # below the size bound a coincidence is not reported
    assert duplicate_functions({"a.py": a, "b.py": b}, min_nodes=10_000) == []
