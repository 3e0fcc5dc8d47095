"""The repository's text stands on its own: no tracked file cites the founding design page,
the per-paper specification files or the shared folder beside the checkout. Those lived
outside the repository while edgefl was written; a person who clones it has none of them,
so a citation of them leads nowhere. Cite the paper itself (its own section, equation,
figure or table numbers) or the repository's docs/ instead.

The patterns are assembled from pieces so that this file does not match itself.

The documents also read as written: no tracked Markdown file holds an ASCII control
character but the line feed. Formulas written through a Python or shell string lose their
backslashes that way (LaTeX's \\frac became a form feed and "rac"; \\tau would become a
tab and "au"), and the page then renders a broken formula with nothing to show why.
"""
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The design page's file name, the spec folder, and the relative path to the shared folder.
OUTSIDE = re.compile("|".join(re.escape(p) for p in (
    "DESIGN" + ".md",
    "spec" + "s/",
    ".." + "/shared",
)))


def tracked_files():
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], check=True,
                             capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout, or git is missing ({exc}): no list of tracked files")
    return [REPO / name for name in out.decode("utf-8").split("\0") if name]


def text_of(path: Path):
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def outside_citations(files, root: Path = REPO) -> list:
    """'file:line: text' of every line that cites something outside the repository."""
    found = []
    for path in files:
        if not path.is_file():            # tracked but deleted in the work tree
            continue
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), start=1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return found


def test_the_pattern_finds_each_kind_of_citation(tmp_path):
    """The check can fail: each of the three citations is found, with its file and line."""
    cases = {"a.py": "# see " + "DESIGN" + ".md", "b.md": "x\nper " + "spec" + "s/mfl.md §7",
             "c.yaml": "# ../" + "../" + "shared/papers", "d.txt": "docs/algorithms.md#mfl",
             "e.bin": "\0" + "spec" + "s/"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    found = outside_citations(sorted(tmp_path.iterdir()), tmp_path)
    assert [f.split(":")[:2] for f in found] == [["a.py", "1"], ["b.md", "2"], ["c.yaml", "1"]]


def test_no_tracked_file_cites_what_is_outside_the_repository():
    found = outside_citations(tracked_files())
    assert not found, (f"{len(found)} line(s) cite files outside the repository; cite the "
                       f"paper or docs/ instead:\n" + "\n".join(found))


# ASCII control characters but the line feed: the docs hold no tab or carriage return either
# (\tau and \rho lose their backslash as a tab and a carriage return)
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f]")


def test_no_tracked_markdown_file_holds_a_control_character():
    found = []
    for path in tracked_files():
        if path.suffix != ".md" or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
            for hit in CONTROL.finditer(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {hit.group()!r} before "
                             f"{line[hit.end():hit.end() + 20]!r}")
    assert not found, (f"{len(found)} control character(s) in the docs (a backslash escape "
                       f"lost on the way in, e.g. \\f of \\frac):\n" + "\n".join(found))
