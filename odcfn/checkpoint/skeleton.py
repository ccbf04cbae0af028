"""A checkpoint's pytrees as a JSON skeleton plus named tensors, and back.

``encode`` turns params and optimizer state into the manifest's ``tree`` (dicts, lists, tuples,
scalars as JSON; tensors as names into the rank files), ``decode`` rebuilds them from a
manifest with the caller's readers, ``nodes`` walks a skeleton (what verification and the
memory tier across nodes ask of it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from odcfn.sharding import Layout

__all__ = ["decode", "encode", "nodes"]

_SCALARS = (bool, int, float, str, type(None))


def encode(tree: Any, key: str, layout: Layout, tensors: dict[str, torch.Tensor], rank0: bool) -> Any:
    """JSON skeleton of ``tree``; its tensors go into ``tensors`` under ``key``-derived names.

    A dict keyed by exactly the unit names whose values are shard-sized 1-D tensors is a
    sharded group (saved by every writer); any other tensor is replicated (saved by rank 0).
    """
    if isinstance(tree, Mapping):
        if set(tree) == set(layout.names) and all(
            isinstance(tree[u.name], torch.Tensor) and tree[u.name].shape == (u.shard_size,)
            for u in layout.units
        ):
            for u in layout.units:
                tensors[f"{key}/{u.name}"] = tree[u.name].detach().contiguous().clone()
            return {"type": "sharded", "key": key}
        items = {}
        for k, v in tree.items():
            if not isinstance(k, str) or "/" in k:
                raise TypeError(f"checkpoint: dict key {k!r} under {key!r} must be a str without '/'")
            items[k] = encode(v, f"{key}/{k}", layout, tensors, rank0)
        return {"type": "dict", "items": items}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {
            "type": kind,
            "items": [encode(v, f"{key}/{i}", layout, tensors, rank0) for i, v in enumerate(tree)],
        }
    if isinstance(tree, torch.Tensor):
        if rank0:
            tensors[key] = tree.detach().contiguous().clone()
        return {"type": "tensor", "key": key}
    if isinstance(tree, _SCALARS):
        return {"type": "value", "value": tree}
    raise TypeError(f"checkpoint: cannot save a {type(tree).__name__} at {key!r}")


def decode(node: dict, read_sharded, read_tensor) -> Any:
    kind = node["type"]
    if kind == "dict":
        return {k: decode(v, read_sharded, read_tensor) for k, v in node["items"].items()}
    if kind in ("list", "tuple"):
        items = [decode(v, read_sharded, read_tensor) for v in node["items"]]
        return items if kind == "list" else tuple(items)
    if kind == "sharded":
        return read_sharded(node["key"])
    if kind == "tensor":
        return read_tensor(node["key"])
    if kind == "value":
        return node["value"]
    raise ValueError(f"checkpoint manifest has an unknown node type {kind!r}")


def nodes(tree: Any) -> Iterator[dict]:
    """Every node of a manifest's skeleton (``{"params": ..., "opt_state": ...}`` or one of its
    subtrees), depth first; malformed parts (not dicts) are skipped."""
    if not isinstance(tree, dict):
        return
    if "type" not in tree:  # the manifest's top level
        for k in ("params", "opt_state"):
            yield from nodes(tree.get(k))
        return
    yield tree
    items = tree.get("items", ())
    for v in items.values() if isinstance(items, dict) else items if isinstance(items, list) else ():
        yield from nodes(v)
