"""Pytree helpers. Every other module goes through these, never through optree directly.

optree sorts dict keys when flattening; all flat orders in odcfn (layouts, optimizer states,
checkpoints) are therefore the *sorted key path* order defined here, and nothing mixes in
``torch.utils._pytree`` (which keeps insertion order).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

PyTree = Any
NAMESPACE = "odcfn"  # odcfn's own registered node types (TrainState) flatten under this namespace

__all__ = [
    "PyTree",
    "key_path_str",
    "register_dataclass",
    "tree_allclose",
    "tree_assert_allclose",
    "tree_flatten",
    "tree_flatten_with_path",
    "tree_leaves",
    "tree_map",
    "tree_named_leaves",
    "tree_structure",
    "tree_unflatten",
]


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    return optree.tree_map(fn, tree, *rest, namespace=NAMESPACE)


def tree_leaves(tree: PyTree) -> list[Any]:
    return optree.tree_leaves(tree, namespace=NAMESPACE)


def tree_flatten(tree: PyTree) -> tuple[list[Any], Any]:
    return optree.tree_flatten(tree, namespace=NAMESPACE)


def tree_unflatten(treedef: Any, leaves: list[Any]) -> PyTree:
    return optree.tree_unflatten(treedef, leaves)


def tree_structure(tree: PyTree) -> Any:
    return optree.tree_structure(tree, namespace=NAMESPACE)


def register_dataclass(cls: type, children: tuple[str, ...], static: tuple[str, ...]) -> type:
    """Register a frozen dataclass as a pytree node: ``children`` are subtrees, ``static`` fields
    ride in the tree definition (compared by identity/equality, never traversed)."""

    def flatten(obj: Any) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[str, ...]]:
        return tuple(getattr(obj, f) for f in children), tuple(getattr(obj, f) for f in static), children

    def unflatten(meta: tuple[Any, ...], kids: tuple[Any, ...]) -> Any:
        return cls(**dict(zip(children, kids)), **dict(zip(static, meta)))

    optree.register_pytree_node(cls, flatten, unflatten, namespace=NAMESPACE)
    return cls


def key_path_str(path: tuple[Any, ...]) -> str:
    """('layers.0', 'mlp', 'up_proj', 'weight') -> 'layers.0.mlp.up_proj.weight'."""
    return ".".join(str(p) for p in path)


def tree_flatten_with_path(tree: PyTree) -> tuple[list[str], list[Any], Any]:
    """Leaves with dotted key paths, in optree's (sorted-key) order."""
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [key_path_str(p) for p in paths], leaves, treedef


def tree_named_leaves(tree: PyTree) -> Iterator[tuple[str, Any]]:
    names, leaves, _ = tree_flatten_with_path(tree)
    return zip(names, leaves)


def _mismatch(a: PyTree, b: PyTree, rtol: float, atol: float) -> str | None:
    names_a, leaves_a, def_a = tree_flatten_with_path(a)
    names_b, leaves_b, def_b = tree_flatten_with_path(b)
    if def_a != def_b:
        only_a = sorted(set(names_a) - set(names_b))
        only_b = sorted(set(names_b) - set(names_a))
        return f"tree structures differ: only in first {only_a}, only in second {only_b}"
    for name, x, y in zip(names_a, leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            x, y = torch.as_tensor(x), torch.as_tensor(y)
            if x.shape != y.shape:
                return f"{name}: shapes differ {tuple(x.shape)} vs {tuple(y.shape)}"
            xd, yd = x.detach().double(), y.detach().double()
            if not torch.allclose(xd, yd, rtol=rtol, atol=atol):
                err = (xd - yd).abs()
                rel = (err / yd.abs().clamp_min(atol)).max().item()
                return (
                    f"{name}: max abs err {err.max().item():.3e}, max rel err {rel:.3e} "
                    f"(rtol={rtol}, atol={atol})"
                )
        elif x != y:
            return f"{name}: {x!r} != {y!r}"
    return None


def tree_allclose(a: PyTree, b: PyTree, *, rtol: float = 1e-5, atol: float = 1e-7) -> bool:
    return _mismatch(a, b, rtol, atol) is None


def tree_assert_allclose(
    a: PyTree, b: PyTree, *, rtol: float = 1e-5, atol: float = 1e-7, what: str = ""
) -> None:
    """Like ``tree_allclose`` but raises ``AssertionError`` naming the first bad key path."""
    msg = _mismatch(a, b, rtol, atol)
    if msg is not None:
        raise AssertionError(f"{what + ': ' if what else ''}{msg}")
