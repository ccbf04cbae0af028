"""The package's wings import downward only (docs/design.md, "Package layout").

Every import of one odcfn module by another (module level or lazy, inside a function; relative or
absolute; ``importlib.import_module("odcfn...")`` with a literal name too) is an edge between two
wings. The rules are data: ``LAYERS`` lists the wings from the bottom up, a wing may import its
own modules and any wing of a lower layer, and the applications (the top layer) may also import
one another. ``FORBIDDEN`` spells out the promises docs/design.md makes in words, and ``BENCH``
keeps the benchmark harness out of the library's import graph. A module of a wing no layer names
fails the test: add the new wing to ``LAYERS`` (an application such as ``rl``, ``rollout`` or ``rewards``
already has its place).

A wing is a top-level module or package of odcfn (``transport``, ``tree``), or a sub-package or
module named here on its own when it sits at another height than its package (``preference.lora``
imports the LoRA wing, which sits above the preference pairs); a module belongs to the longest
name that prefixes it. ``""`` is ``odcfn/__init__.py``, the public face.

Privacy: a module never reaches a ``_private`` module or name of another top-level wing (below
the wing's own name: ``odcfn._check``, the one vocabulary for bad arguments, is itself a wing)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "odcfn"

APPLICATIONS = ("sft", "rl", "rollout", "rewards", "bench", "cli")

# bottom first; a wing may import any wing of a lower layer (and the applications each other)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_check", "tree", "batch", "trace"),  # the vocabulary every wing speaks
    ("moe",),  # routers and expert math over plain tensors
    ("model",),  # Unit / Model
    ("sharding", "kernels"),  # where every byte lives; compute kernels
    ("schedule", "optim", "trainable"),  # cost models, balancers, plans, the simulator; updates; frozen units
    ("transport", "preference"),  # how bytes move; preference pairs as data and their schedule
    ("losses", "launch", "data"),  # token and preference losses; launching ranks; datasets
    ("models",),  # the decoder families, HF import/export
    ("step",),  # TrainState, the executor, train_step, log_probs, staleness
    ("lora", "reference", "checkpoint"),  # adapters; the single-process oracle; checkpoints
    ("preference.lora",),  # the LoRA reference of a preference run
    ("",),  # odcfn/__init__.py: the public face, re-exports only
    APPLICATIONS,  # odcfn train / rl / rollout / bench and the command line
)

LEVEL = {w: i for i, layer in enumerate(LAYERS) for w in layer}

STEP_AND_ABOVE = tuple(w for w, level in LEVEL.items() if level >= LEVEL["step"])
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "kernels": ("transport", "step", "checkpoint", *APPLICATIONS),
    "transport": STEP_AND_ABOVE,
}
BENCH, BENCH_ALLOWED = "bench", ("bench", "cli")  # only the command line imports the benchmarks


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = f
    return out


def imports(mod: str, source: str, is_pkg: bool,
            mods: dict[str, Path] | None = None) -> list[tuple[str, str]]:
    """(target module, imported name or "") for each odcfn import in ``source``."""
    mods = modules() if mods is None else mods
    out: list[tuple[str, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub, "") if sub in mods else (base, a.name))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")):
            out.append((node.args[0].value, ""))
    return [(t, n) for t, n in out if t == "odcfn" or t.startswith("odcfn.")]


def wing(module: str) -> str:
    """The wing of a dotted module path (``odcfn.transport.gpu.cuda_ipc`` -> ``transport``)."""
    rest = module.split(".")[1:]
    if not rest:
        return ""
    for k in range(len(rest), 0, -1):
        name = ".".join(rest[:k])
        if name in LEVEL:
            return name
    return rest[0]


def violations(importer: str, target: str, name: str) -> list[str]:
    """What is wrong with ``importer`` importing ``name`` from ``target`` (module paths)."""
    a, b = wing(importer), wing(target)
    found = []
    for w in (a, b):
        if w not in LEVEL:
            found.append(f"{importer}: wing {w!r} has no layer: add it to LAYERS in {Path(__file__).name}")
    if found or a == b:
        return found
    if b in FORBIDDEN.get(a.split(".")[0], ()):
        found.append(f"{importer} imports {target}: {a} must import nothing from {b}")
    elif b == BENCH and a not in BENCH_ALLOWED:
        found.append(f"{importer} imports {target}: only the command line imports the benchmarks")
    elif LEVEL[b] > LEVEL[a] or (LEVEL[b] == LEVEL[a] and a not in APPLICATIONS):
        found.append(f"{importer} imports {target}: {a!r} (layer {LEVEL[a]}) may not import "
                     f"{b!r} (layer {LEVEL[b]})")
    top_a, top_b = importer.split(".")[1:2], target.split(".")[1:2]
    inner = target.split(".")[2:] + ([name] if name else [])
    if top_a != top_b and any(c.startswith("_") and not c.startswith("__") for c in inner):
        found.append(f"{importer} reaches {target}{'.' + name if name else ''}: private to {b!r}")
    return found


def test_the_wings_import_downward_only():
    mods = modules()
    found = [v for mod, path in sorted(mods.items())
             for target, name in imports(mod, path.read_text(), path.name == "__init__.py", mods)
             for v in violations(mod, target, name)]
    assert not found, "\n".join(found)


def test_every_wing_has_a_layer():
    unknown = sorted({wing(m) for m in modules()} - set(LEVEL))
    assert not unknown, f"wings without a layer in LAYERS: {unknown}"


def test_the_rules_catch_what_they_are_for():
    """Each rule fails the edge it exists for (a check that cannot fail proves nothing), and
    passes the ordinary downward ones."""
    bad = [
        ("odcfn.kernels.fused_head", "odcfn.transport.base", ""),
        ("odcfn.kernels.fused_head", "odcfn.checkpoint.sharded", ""),
        ("odcfn.transport.shm", "odcfn.step.state", ""),
        ("odcfn.transport.local", "odcfn.losses", "cross_entropy"),
        ("odcfn.step.train", "odcfn.bench.runner", ""),
        ("odcfn.sft.loop", "odcfn.bench", ""),
        ("odcfn.step.train", "odcfn.rl", ""),
        ("odcfn.losses.tokens", "odcfn.lora", ""),
        ("odcfn.step.execute", "odcfn.transport.gpu._engine", ""),
        ("odcfn.checkpoint.commit", "odcfn.transport.shm_sync", "_wait"),
        ("odcfn.newwing.x", "odcfn.tree", ""),
    ]
    for edge in bad:
        assert violations(*edge), edge
    good = [
        ("odcfn.step.execute", "odcfn.transport.base", "Transport"),
        ("odcfn.transport.gpu.cuda_ipc", "odcfn.transport.gpu._engine", ""),
        ("odcfn.transport.gpu._compile", "odcfn.kernels.triton_ops", ""),
        ("odcfn.losses.tokens", "odcfn.losses.head", "check_head"),
        ("odcfn.rl.loop", "odcfn.step.train", ""),
        ("odcfn.rollout.engine", "odcfn.losses", "policy_gradient"),
        ("odcfn.rl.loop", "odcfn.sft.config", ""),
        ("odcfn.cli", "odcfn.bench", ""),
        ("odcfn.sft.loop", "odcfn", ""),
        ("odcfn.step.train", "odcfn._check", "check_int"),
        ("odcfn.preference.lora", "odcfn.lora", "adapter_units"),
    ]
    for edge in good:
        assert not violations(*edge), (edge, violations(*edge))
    src = "import importlib\ndef f():\n    importlib.import_module('odcfn.bench.runner')\n"
    assert imports("odcfn.step.x", src, False) == [("odcfn.bench.runner", "")]
