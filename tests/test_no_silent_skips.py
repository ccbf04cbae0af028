"""A missing requirement fails the tests; it never turns them into skips.

``pip install -e '.[dev,gpu]'`` is the test command's install: every package of the core
dependencies and of the dev and gpu extras is a hard requirement of the tests that use it, and
odcfn's own modules are imported directly (an import error of the package is a failure). So no
test file may call ``pytest.importorskip``, skip from an ``except ImportError`` handler, swallow
an ``ImportError``, or make a ``skipif`` condition out of whether something imports."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def _name(node: ast.AST) -> str:
    """``pytest.importorskip`` -> "importorskip"; ``skip`` -> "skip"; else ""."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def silent_skips(source: str, filename: str = "<test>") -> list[str]:
    """Each place in ``source`` where a missing import would skip (or pass) instead of fail."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call) and _name(node.func) == "importorskip":
            found.append(f"{filename}:{node.lineno}: importorskip")
        elif isinstance(node, ast.ExceptHandler) and node.type is not None:
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            if IMPORT_ERRORS & {_name(t) for t in types}:
                found.append(f"{filename}:{node.lineno}: except ImportError")
        elif isinstance(node, ast.Call) and _name(node.func) == "skipif":
            cond = ast.unparse(node.args[0]) if node.args else ""
            if re.search(r"find_spec|import|find_loader", cond):
                found.append(f"{filename}:{node.lineno}: skipif on an import")
    return found


def test_no_test_skips_on_a_missing_import():
    found = [hit for path in sorted(ROOT.glob("tests/**/*.py"))
             for hit in silent_skips(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "import the package directly (a missing requirement must fail):\n" + "\n".join(found)


def test_the_check_sees_each_way_of_skipping():
    cases = {
        'import pytest\nshm = pytest.importorskip("odcfn.transport.shm")\n': "importorskip",
        'from pytest import importorskip\nimportorskip("transformers")\n': "importorskip",
        "def f():\n    try:\n        import peft\n    except ImportError:\n        pytest.skip('no peft')\n":
            "except ImportError",
        "try:\n    import triton\nexcept (OSError, ModuleNotFoundError):\n    triton = None\n":
            "except ImportError",
        "import importlib.util\n"
        "@pytest.mark.skipif(importlib.util.find_spec('nbclient') is None, reason='')\n"
        "def test_x():\n    pass\n": "skipif on an import",
    }
    for source, kind in cases.items():
        assert [h.split(": ", 1)[1] for h in silent_skips(source)] == [kind], source
    hardware = "import pytest\n@pytest.mark.skipif(True, reason='a GPU is present')\ndef t():\n  pass\n"
    assert silent_skips(hardware) == []


def _requirement_names(reqs: list[str]) -> list[str]:
    """Distribution names, without the ones behind an environment marker (tomli on < 3.11)."""
    return [re.split(r"[\s<>=!~\[]", r, maxsplit=1)[0] for r in reqs if ";" not in r]


def test_the_test_install_is_complete():
    """Every distribution the test command installs is installed: a CI that lacks one fails here,
    by name, rather than through the tests that need it."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    names = _requirement_names(meta["dependencies"] + extras["dev"] + extras["gpu"])
    assert {"transformers", "peft", "hypothesis", "nbclient", "triton"} <= set(names), names
    missing = []
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    assert not missing, f"not installed: {missing}; the tests need pip install -e '.[dev,gpu]'"
