"""What pyproject.toml states about the package, read as setuptools reads it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

try:
    import tomllib
except ImportError:                                  # Python < 3.11
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# setuptools' own reading of `attr:` (static first: a failed import would be tried next),
# in a fresh interpreter, saying whether it had to import edgefl to get the value
_READ_VERSION = """\
import json, sys
from setuptools.config.expand import read_attr
version = read_attr("edgefl.__version__", root_dir=sys.argv[1])
print(json.dumps([version, "edgefl" in sys.modules]))
"""


def test_the_version_is_stated_once_in_the_package_and_read_from_there_without_importing():
    """pyproject.toml said `version = "0.1.0"` and edgefl/__init__.py `__version__ =
    "0.1.0"`: two homes for one fact, one of them bound to be forgotten at a release. The
    package's is the one: pyproject declares the version dynamic and setuptools reads
    edgefl.__version__ from the source, statically (a build need not import edgefl, whose
    import loads the compiled core)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        doc = tomllib.load(f)
    project = doc["project"]
    assert "version" not in project, f"pyproject.toml states version {project['version']!r}"
    assert "version" in project.get("dynamic", ())
    assert doc["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "edgefl.__version__"}
    out = subprocess.run([sys.executable, "-c", _READ_VERSION, ROOT], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    version, imported = json.loads(out.stdout)
    import edgefl
    assert (version, imported) == (edgefl.__version__, False)
