"""Sharded checkpoints: one safetensors file per rank plus a JSON manifest, resharded on load.

Layout of a checkpoint directory::

    manifest.json            written last (temp + rename): its presence means "committed"
    rank-00000.safetensors   rank 0's parameter shards, optimizer-state shards, replicated tensors
    rank-00001.safetensors   ...

Every rank of one shard group calls ``save`` (under hybrid sharding the replicas on other nodes
hold identical shards, so only node 0 writes). Each rank writes its own file atomically; rank 0
waits until every file of this step is on disk and then commits the manifest. There is no
communication: the file system is the barrier, so ``save`` works the same on any transport.

``load`` reads the manifest and cuts the saved flat units into the shards of *any* mesh: each
rank reads only the byte ranges of the old shards that overlap its new one. Optimizer states
are pytrees of dicts/lists/tuples whose tensors are either per-unit shards (a dict keyed by
exactly the model's unit names, like the params) or replicated; scalars go into the manifest.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from odcfn.model import Model
from odcfn.sharding import Layout, Mesh, make_layout
from odcfn.sharding.layout import check_shards

__all__ = ["load", "read_manifest", "save", "latest"]

FORMAT = "odcfn-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_SCALARS = (bool, int, float, str, type(None))


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# --- pytree <-> (JSON skeleton, tensors) ---------------------------------------------------


def _encode(tree: Any, key: str, layout: Layout, tensors: dict[str, torch.Tensor], rank0: bool) -> Any:
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
            items[k] = _encode(v, f"{key}/{k}", layout, tensors, rank0)
        return {"type": "dict", "items": items}
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {
            "type": kind,
            "items": [_encode(v, f"{key}/{i}", layout, tensors, rank0) for i, v in enumerate(tree)],
        }
    if isinstance(tree, torch.Tensor):
        if rank0:
            tensors[key] = tree.detach().contiguous().clone()
        return {"type": "tensor", "key": key}
    if isinstance(tree, _SCALARS):
        return {"type": "value", "value": tree}
    raise TypeError(f"checkpoint: cannot save a {type(tree).__name__} at {key!r}")


def _decode(node: dict, read_sharded, read_tensor) -> Any:
    kind = node["type"]
    if kind == "dict":
        return {k: _decode(v, read_sharded, read_tensor) for k, v in node["items"].items()}
    if kind in ("list", "tuple"):
        items = [_decode(v, read_sharded, read_tensor) for v in node["items"]]
        return items if kind == "list" else tuple(items)
    if kind == "sharded":
        return read_sharded(node["key"])
    if kind == "tensor":
        return read_tensor(node["key"])
    if kind == "value":
        return node["value"]
    raise ValueError(f"checkpoint manifest has an unknown node type {kind!r}")


# --- save --------------------------------------------------------------------------------


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")


def _fsync(path: Path) -> None:
    """Data on disk before the rename publishes it (a crash then leaves the old name or the
    whole new file, never a truncated one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = _tmp_name(path)
    tmp.write_text(text)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)  # the rename itself


def _file_step(path: Path) -> int | None:
    try:
        with safe_open(str(path), framework="pt") as f:
            return int((f.metadata() or {}).get("step", -1))
    except Exception:  # noqa: BLE001 - absent, half-visible or foreign file: not ours yet
        return None


def _wait(pred, what, timeout: float) -> None:
    """Poll ``pred`` until true; ``what()`` describes what is still missing on timeout."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"checkpoint: timed out after {timeout}s waiting for {what()}")
        time.sleep(0.01)


def _writers(mesh: Mesh) -> tuple[int, ...]:
    """The ranks whose files make up a checkpoint: node 0's shard group (all ranks if full)."""
    return mesh.with_rank(0).shard_group


def save(
    path: str | os.PathLike,
    params: Mapping[str, torch.Tensor],
    opt_state: Any,
    step: int,
    *,
    model: Model,
    mesh: Mesh,
    extra: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
) -> Path:
    """Write this rank's part of a checkpoint of ``(params, opt_state, step)`` into ``path``.

    Called by every rank. Returns once the checkpoint is committed (the manifest exists), on
    every rank. ``extra`` is JSON metadata stored in the manifest (e.g. the data position).
    Use one directory per step: overwriting a committed checkpoint in place is not atomic.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
    layout = make_layout(model, mesh)
    check_shards(params, layout, model.dtype)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    manifest = root / MANIFEST
    if mesh.rank == 0 and manifest.exists():
        manifest.unlink()  # from now on the directory is uncommitted until we rewrite it
    writers = _writers(mesh)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {
        "params": _encode(dict(params), "params", layout, tensors, mesh.rank == 0),
        "opt_state": _encode(opt_state, "opt_state", layout, tensors, mesh.rank == 0),
    }
    if skeleton["params"]["type"] != "sharded":  # pragma: no cover - check_shards guarantees it
        raise ValueError("checkpoint: params are not this mesh's shards")
    if mesh.rank in writers:
        target = root / _rank_file(mesh.rank)
        tmp = _tmp_name(target)
        meta = {"step": str(step), "rank": str(mesh.rank), "format": FORMAT}
        save_file(tensors, str(tmp), metadata=meta)
        _fsync(tmp)
        os.replace(tmp, target)
    if mesh.rank == 0:
        missing = lambda: [r for r in writers if _file_step(root / _rank_file(r)) != step]  # noqa: E731
        _wait(
            lambda: not missing(),
            lambda: f"the files of ranks {missing()} for step {step} in {root} (did every rank call save?)",
            timeout,
        )
        doc = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "mesh": {
                "world_size": mesh.world_size,
                "ranks_per_node": mesh.ranks_per_node,
                "sharding": mesh.sharding,
                "shard_count": mesh.shard_count,
            },
            "files": [_rank_file(r) for r in writers],
            "units": {
                u.name: {
                    "numel": u.numel,
                    "shard_size": u.shard_size,
                    "paths": list(u.paths),
                    "shapes": [list(s) for s in u.shapes],
                }
                for u in layout.units
            },
            "tree": skeleton,
            "extra": dict(extra or {}),
        }
        _atomic_write_text(manifest, json.dumps(doc, indent=1))
    else:
        _wait(lambda: _manifest_step(manifest) == step, lambda: f"rank 0 to commit {manifest}", timeout)
    return root


def _manifest_step(manifest: Path) -> int | None:
    try:
        return int(json.loads(manifest.read_text())["step"])
    except (OSError, ValueError, KeyError):
        return None


# --- load --------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict:
    """The committed manifest of checkpoint ``path`` (raises if it is not committed)."""
    manifest = Path(path) / MANIFEST
    if not manifest.exists():
        raise FileNotFoundError(f"{manifest} does not exist: {path} is not a committed odcfn checkpoint")
    doc = json.loads(manifest.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{manifest} is not an odcfn checkpoint manifest (format={doc.get('format')!r})")
    if doc.get("version") != VERSION:
        raise ValueError(f"{manifest} has version {doc.get('version')}, this odcfn reads {VERSION}")
    return doc


def latest(root: str | os.PathLike) -> Path | None:
    """The committed checkpoint with the highest step among ``root``'s subdirectories."""
    best: tuple[int, Path] | None = None
    root = Path(root)
    if not root.is_dir():
        return None
    for d in root.iterdir():
        step = _manifest_step(d / MANIFEST) if d.is_dir() else None
        if step is not None and (best is None or step > best[0]):
            best = (step, d)
    return None if best is None else best[1]


def _check_units(doc: dict, layout: Layout, path: Path) -> None:
    saved = doc["units"]
    if set(saved) != set(layout.names):
        raise ValueError(f"checkpoint {path} has units {sorted(saved)}, the model has {sorted(layout.names)}")
    for u in layout.units:
        s = saved[u.name]
        if s["paths"] != list(u.paths) or [tuple(x) for x in s["shapes"]] != list(u.shapes):
            raise ValueError(f"checkpoint {path}: unit {u.name!r} has different parameters than the model")


def load(path: str | os.PathLike, *, model: Model, mesh: Mesh) -> tuple[dict[str, torch.Tensor], Any, int]:
    """This rank's ``(params, opt_state, step)`` from checkpoint ``path``, resharded for ``mesh``
    (which may have a different world size or sharding than the one that saved it)."""
    root = Path(path)
    doc = read_manifest(root)
    layout = make_layout(model, mesh)
    _check_units(doc, layout, root)
    files = [root / f for f in doc["files"]]
    for f in files:
        if _file_step(f) != doc["step"]:
            raise ValueError(f"checkpoint {root}: {f.name} is missing or is not from step {doc['step']}")
    handles: dict[int, Any] = {}

    def handle(i: int):
        if i not in handles:
            handles[i] = safe_open(str(files[i]), framework="pt")
        return handles[i]

    def read_sharded(key: str) -> dict[str, torch.Tensor]:
        out = {}
        for u in layout.units:
            old = doc["units"][u.name]["shard_size"]
            lo, hi = u.shard_range(mesh.shard_index)
            pieces, end = [], min(hi, u.numel)  # beyond numel is padding: zeros
            pos = lo
            while pos < end:
                i = pos // old
                take = min(end, (i + 1) * old) - pos
                t = handle(i).get_slice(f"{key}/{u.name}")[pos - i * old : pos - i * old + take]
                pieces.append(t)
                pos += take
            dtype = pieces[0].dtype if pieces else _slice_dtype(handle(0), f"{key}/{u.name}")
            shard = torch.zeros(u.shard_size, dtype=dtype)
            if pieces:
                got = torch.cat(pieces)
                shard[: got.numel()] = got
            out[u.name] = shard
        return out

    def read_tensor(key: str) -> torch.Tensor:
        return handle(0).get_tensor(key)

    try:
        params = _decode(doc["tree"]["params"], read_sharded, read_tensor)
        opt_state = _decode(doc["tree"]["opt_state"], read_sharded, read_tensor)
    finally:
        handles.clear()
    check_shards(params, layout, model.dtype, what=f"params loaded from {root}")
    return params, opt_state, int(doc["step"])


def _slice_dtype(f: Any, key: str) -> torch.dtype:
    return f.get_slice(key)[0:0].dtype
