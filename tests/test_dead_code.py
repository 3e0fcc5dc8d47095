"""No dead code in edgefl/: every function, class, method and upper-case constant that a
module defines is named somewhere else in the repository (the package, the tests, the tools,
the docs, the C core). A name that appears only where it is defined is called by nothing,
documented nowhere and tested by nothing: it is removed, or listed below with what calls it
by name.

Names are read with `ast` and looked for as whole words in the repository's text files, so
a use through an attribute, a string or a doc counts; a name that is a common word elsewhere
passes even when dead (the check finds the sure cases, not all). The checker is also run on
made-up source, so a checker that finds nothing cannot pass for a clean tree."""
from __future__ import annotations

import ast
import fnmatch
import os
import re
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "edgefl")
SEARCHED = ("edgefl", "tests", "tools", "docs", "csrc", "devices", "broker", "README.md",
            "setup.py", "pyproject.toml")
TEXT = (".py", ".pyx", ".pxd", ".md", ".c", ".h", ".yaml", ".yml", ".sh", ".toml", ".txt",
        ".cfg", ".service", ".html", ".js", ".css", ".conf", ".json")
THIS = os.path.abspath(__file__)

# Names that something calls by name without writing it out, with what does.
CALLED_BY_NAME = {
    "_cmd_*": "roles/daemon.py dispatches a control command to getattr(self, f'_cmd_{name}')",
}

# Dead names tolerated while their removal is under way, as "path:qualified name".
# test_known_dead_names_are_still_there fails as soon as one is gone.
KNOWN_DEAD: set = set()


def definitions(source: str) -> list:
    """(qualified name, name) of a module's top-level functions, classes and upper-case
    constants, and of its classes' methods (not dunders; not what a function defines inside
    it, such as a callback class). A class registered through a
    decorator (a strategy's @register) is used by its registration."""
    out = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if not (node.name.startswith("__") and node.name.endswith("__")):
                    out.append((prefix + node.name, node.name))
            elif isinstance(node, ast.ClassDef):
                if not node.decorator_list or prefix:
                    out.append((prefix + node.name, node.name))
                visit(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and not prefix:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and target.id.lstrip("_").isupper():
                        out.append((target.id, target.id))

    visit(ast.parse(source).body, "")
    return out


def word_counts(root: str = ROOT, searched=SEARCHED, skip=(THIS,)) -> Counter:
    """How often each identifier-like word occurs in the repository's text files."""
    counts = Counter()
    paths = []
    for entry in searched:
        top = os.path.join(root, entry)
        if os.path.isfile(top):
            paths.append(top)
        for directory, dirs, files in os.walk(top):
            dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
            paths.extend(os.path.join(directory, f) for f in files if f.endswith(TEXT))
    for path in paths:
        if os.path.abspath(path) in skip:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            counts.update(re.findall(r"\w+", f.read()))
    return counts


def dead_names(sources: dict, counts: Counter, called_by_name=CALLED_BY_NAME) -> list:
    """Sorted "path:qualified name" of each definition whose name occurs only once (its
    definition) in `counts`."""
    dead = []
    for path, source in sorted(sources.items()):
        for qualified, name in definitions(source):
            if counts[name] <= 1 and not any(fnmatch.fnmatchcase(name, pattern)
                                             for pattern in called_by_name):
                dead.append(f"{path}:{qualified}")
    return sorted(dead)


def package_sources() -> dict:
    """{path relative to the repository: source} of every .py under edgefl/."""
    from test_one_home import python_files

    return python_files(PACKAGE)


@pytest.fixture(scope="module")
def dead():
    return dead_names(package_sources(), word_counts())


def test_nothing_in_edgefl_is_dead(dead):
    found = [name for name in dead if name not in KNOWN_DEAD]
    assert not found, "defined, but named nowhere else in the repository (remove it, or " \
        "say in CALLED_BY_NAME what calls it):\n" + "\n".join(found)


def test_known_dead_names_are_still_there(dead):
    gone = sorted(KNOWN_DEAD - set(dead))
    assert not gone, f"removed: take {gone} out of KNOWN_DEAD in tests/test_dead_code.py"


def test_names_called_by_name_are_still_defined():
    defined = {name for source in package_sources().values()
               for _, name in definitions(source)}
    missing = [p for p in CALLED_BY_NAME if not fnmatch.filter(defined, p)]
    assert not missing, f"CALLED_BY_NAME lists {missing}, which edgefl/ no longer defines"


def test_the_checker_finds_a_name_used_nowhere(tmp_path):
    source = ("LIMIT = 3\n_SPARE = 4\nx = 1\n"
              "def used():\n    return LIMIT\n"
              "def unused():\n    pass\n"
              "class Thing:\n    def __init__(self):\n        pass\n"
              "    def method(self):\n        return used()\n"
              "    def _cmd_go(self):\n        pass\n"
              "@register('x')\nclass Registered:\n    def helper(self):\n        pass\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(source)
    (tmp_path / "doc.md").write_text("`Thing().method()` does it.\n")
    counts = word_counts(str(tmp_path), ("pkg", "doc.md"), skip=())
    assert dead_names({"pkg/m.py": source}, counts, {"_cmd_*": "dispatch"}) == [
        "pkg/m.py:Registered.helper", "pkg/m.py:_SPARE", "pkg/m.py:unused"]
