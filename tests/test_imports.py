"""No import circles inside odcfn: every import (module level or lazy, inside a function) of
one odcfn module by another is an edge, and the graph must be acyclic. A package is its
``__init__``; ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "odcfn"


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circles():
    graph = _edges(_modules())
    # the top-level package only re-exports; a module that imports ``odcfn`` lazily for the
    # public names (the SFT loop, the CLI) is a user of the API, not part of a circle
    for deps in graph.values():
        deps.discard("odcfn")
    cycle = _cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_checker_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _private_reaches(mods: dict[str, Path]) -> list[str]:
    """Imports of a private name (``_x``) from another module, or of a private module from
    outside the package that holds it: what a second file needs should be public, or both users
    should live in one package."""

    def private(seg: str) -> bool:
        return seg.startswith("_") and not seg.startswith("__")

    bad = []
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("odcfn"):
                continue
            segs = node.module.split(".")
            # a private module is private to the package that holds it (and its subpackages)
            if any(private(s) and not mod.startswith(".".join(segs[:i]) + ".") for i, s in enumerate(segs)):
                bad.append(f"{mod} imports {node.module}")
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if private(a.name) and not (sub in mods and node.module == pkg):
                    bad.append(f"{mod} imports {sub}")
    return sorted(set(bad))


def test_no_private_names_cross_files():
    assert _private_reaches(_modules()) == []


def test_the_private_checker_finds_a_reach(tmp_path):
    pkg = tmp_path / "odcfn"
    (pkg / "a").mkdir(parents=True)
    (pkg / "a" / "m.py").write_text("def _x(): ...\n")
    (pkg / "a" / "_p.py").write_text("")
    (pkg / "a" / "n.py").write_text("from odcfn.a import _p\n")  # same package: fine
    (pkg / "b.py").write_text("from odcfn.a.m import _x\nfrom odcfn.a._p import y\n")
    (pkg / "a" / "s").mkdir()
    (pkg / "a" / "s" / "k.py").write_text("from odcfn.a._p import y\n")  # a subpackage: fine
    mods = {"odcfn.a.m": pkg / "a" / "m.py", "odcfn.a._p": pkg / "a" / "_p.py",
            "odcfn.a.n": pkg / "a" / "n.py", "odcfn.b": pkg / "b.py", "odcfn.a.s.k": pkg / "a" / "s" / "k.py"}
    assert _private_reaches(mods) == ["odcfn.b imports odcfn.a._p", "odcfn.b imports odcfn.a.m._x"]


def _reaches(graph: dict[str, set[str]], low: str, high: str) -> list[str]:
    """Edges (module level or lazy) from the wing ``low`` into the wing ``high``."""
    inside = lambda m, w: m == w or m.startswith(w + ".")  # noqa: E731
    edges = ((m, n) for m, deps in graph.items() if inside(m, low) for n in deps)
    return sorted(f"{m} -> {n}" for m, n in edges if inside(n, high))


def test_the_step_wing_never_imports_lora():
    # LoRA composes the step's functions (odcfn.lora.gather_adapters / gather_merged); the step
    # must not know its callers, not even through a lazy import inside a function
    assert _reaches(_edges(_modules()), "odcfn.step", "odcfn.lora") == []


def test_the_direction_checker_sees_lazy_imports(tmp_path):
    pkg = tmp_path / "odcfn"
    (pkg / "step").mkdir(parents=True)
    (pkg / "lora").mkdir()
    (pkg / "lora" / "core.py").write_text("")
    (pkg / "step" / "x.py").write_text("def f():\n    from odcfn.lora.core import g\n")
    mods = {"odcfn.step.x": pkg / "step" / "x.py", "odcfn.lora.core": pkg / "lora" / "core.py"}
    assert _reaches(_edges(mods), "odcfn.step", "odcfn.lora") == ["odcfn.step.x -> odcfn.lora.core"]
