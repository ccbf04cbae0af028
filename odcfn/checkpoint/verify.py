"""Checking a checkpoint's files against its manifest before a byte of them is used.

A manifest records, per rank file, its name, rank, size and sha256, and per unit its numel and
shard size. ``check_files`` checks the list against the mesh the manifest records (one file per
shard, rank i's at position i); ``open_verified`` checks a file's bytes, its embedded step and
rank and every sharded tensor's shape before ``load`` reads from it.

A process hashes a file once (``matches``): a restart verifies the snapshot it picks and then
opens the same files, so the digest is kept, keyed on the file's identity and times, and reused
while they stay the same. ``files_read`` says which files a rank of a mesh reads, so that each
rank verifies those only.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Any

from safetensors import safe_open

from odcfn.checkpoint.skeleton import nodes
from odcfn.sharding import Layout

__all__ = ["check_files", "check_units", "files_read", "matches", "open_verified", "rank_file", "sha256"]


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# (path, device, inode, size, mtime_ns, ctime_ns) -> sha256 this process computed
_HASHED: dict[tuple, str] = {}
# A digest is kept only for a file whose times were this much older than the hashing: the
# kernel stamps times from a coarse clock (ms), so a file rewritten within the same tick as its
# last write could keep its stat; a file already settled when hashed cannot change unseen
# (any later write or utime moves its ctime past the tick it was hashed in).
_SETTLED_NS = 2_000_000_000
_MAX_KEPT = 4096


def matches(f: Path, entry: dict) -> bool:
    """Whether ``f`` is a file of the size and sha256 that ``entry`` (a manifest's file entry)
    records. Hashed at most once per process while the file stays the same."""
    try:
        st = f.stat()
    except OSError:
        return False
    if not f.is_file() or st.st_size != entry.get("bytes"):
        return False
    key = (str(f.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    digest = _HASHED.get(key)
    if digest is None:
        started = time.time_ns()
        digest = sha256(f)
        if max(st.st_mtime_ns, st.st_ctime_ns) < started - _SETTLED_NS:
            if len(_HASHED) >= _MAX_KEPT:  # a long run's old snapshots: forget them all
                _HASHED.clear()
            _HASHED[key] = digest
    return digest == entry.get("sha256")


def files_read(doc: dict, shard_index: int, shard_count: int) -> set[int]:
    """The positions in ``doc["files"]`` whose files shard ``shard_index`` of ``shard_count``
    reads when it loads the checkpoint (``sharded.read_shards`` cuts the saved flat units into
    the new mesh's shards: ceil(numel / shard_count) each): the saved shards its range
    overlaps, and rank 0's file where the tree has replicated tensors or its range is all
    padding (the dtype is read there), and its own file where the checkpoint holds error-feedback
    residuals (saved and loaded at the same world size)."""
    out: set[int] = set()
    for u in doc["units"].values():
        old, numel = u["shard_size"], u["numel"]
        new = max(1, math.ceil(numel / shard_count))
        lo, hi = shard_index * new, min((shard_index + 1) * new, numel)
        if lo >= hi:
            out.add(0)
        else:
            out.update(range(lo // old, (hi - 1) // old + 1))
    if any(n.get("type") == "tensor" for n in nodes(doc["tree"])):
        out.add(0)
    if (doc.get("extra") or {}).get("push_feedback") is not None:
        out.add(shard_index)  # its own file: each rank's error-feedback residuals (checkpoint/feedback.py)
    return out


def check_units(doc: dict, layout: Layout, path: Path) -> None:
    saved = doc["units"]
    if set(saved) != set(layout.names):
        raise ValueError(f"checkpoint {path} has units {sorted(saved)}, the model has {sorted(layout.names)}")
    for u in layout.units:
        s = saved[u.name]
        if s["paths"] != list(u.paths) or [tuple(x) for x in s["shapes"]] != list(u.shapes):
            raise ValueError(f"checkpoint {path}: {_first_difference(u, s)}")
        if s["numel"] != u.numel:
            raise ValueError(f"checkpoint {path}: unit {u.name!r} has numel {s['numel']}, model {u.numel}")


# the model config fields that decide a parameter's shape, by the parameter's name
_SHAPED_BY = [
    ("embed_tokens", "vocab_size, d_model"), ("lm_head", "vocab_size, d_model"),
    ("q_proj", "d_model, n_heads, head_dim"), ("k_proj", "d_model, n_kv_heads, head_dim"),
    ("v_proj", "d_model, n_kv_heads, head_dim"), ("o_proj", "d_model, n_heads, head_dim"),
    ("q_norm", "head_dim"), ("k_norm", "head_dim"), ("mlp", "d_model, d_ff"), ("norm", "d_model"),
    ("lora_A", "lora.rank, d_model"), ("lora_B", "lora.rank, d_model"),
]


def _first_difference(u: Any, saved: dict) -> str:
    """The first parameter in which the checkpoint's unit and the model's differ: its name, both
    shapes, and the config fields that decide that shape."""
    have = {p: tuple(x) for p, x in zip(saved["paths"], saved["shapes"])}
    want = dict(zip(u.paths, u.shapes))
    for p in list(want) + [p for p in have if p not in want]:
        if have.get(p) == want.get(p):
            continue
        fields = next((f for key, f in _SHAPED_BY if key in p), "the model's config")
        if p not in have:
            what = f"parameter {u.name}.{p} {tuple(want[p])} of the model is not in the checkpoint"
        elif p not in want:
            what = f"parameter {u.name}.{p} {tuple(have[p])} of the checkpoint is not in the model"
        else:
            what = (f"parameter {u.name}.{p} has shape {tuple(have[p])} in the checkpoint, "
                    f"{tuple(want[p])} in the model")
        return f"{what}: the model's config differs from the saved one in {fields}"
    return f"unit {u.name!r} orders its parameters differently than the model"


def check_files(doc: dict, root: Path) -> list[Path]:
    """The rank files, in shard order, after checking the manifest's list against the mesh it
    records: one file per shard, rank i's in position i, every shard-sized unit covered."""
    count = doc["mesh"]["shard_count"]
    entries = doc["files"]
    if not isinstance(count, int) or count < 1 or not isinstance(entries, list) or len(entries) != count:
        raise ValueError(f"the manifest lists {len(entries)} files for {count} shards")
    for i, e in enumerate(entries):
        if e.get("name") != rank_file(i) or e.get("rank") != i:
            got = f"{e.get('name')!r} of rank {e.get('rank')}"
            raise ValueError(f"files[{i}] is {got}, expected {rank_file(i)} of rank {i}")
    for name, u in doc["units"].items():
        size = u["shard_size"]
        if not isinstance(size, int) or size < 1 or size * count < u["numel"]:
            raise ValueError(f"unit {name!r}: {count} shards of {size} cannot hold numel {u['numel']}")
    return [root / e["name"] for e in entries]


def open_verified(f: Path, entry: dict, doc: dict) -> Any:
    """``f`` opened for reading after checking its bytes, step, rank and tensor shapes."""
    if entry.get("sha256") is None:
        raise ValueError(f"{f.name} is not held by this part of a snapshot (another node keeps it)")
    if not f.is_file():
        raise ValueError(f"{f.name} is missing")
    if not matches(f, entry):
        raise ValueError(f"{f.name} does not match the sha256 in the manifest (corrupted or replaced)")
    h = safe_open(str(f), framework="pt")
    meta = h.metadata() or {}
    if meta.get("step") != str(doc["step"]) or meta.get("rank") != str(entry["rank"]):
        raise ValueError(f"{f.name} is rank {meta.get('rank')}'s of step {meta.get('step')}, the manifest "
                         f"says rank {entry['rank']} of step {doc['step']}")
    for key in h.keys():
        unit = key.rsplit("/", 1)[-1]
        if unit in doc["units"] and _is_sharded_key(doc["tree"], key):
            shape = tuple(h.get_slice(key).get_shape())
            if shape != (doc["units"][unit]["shard_size"],):
                raise ValueError(f"{f.name}: {key} has shape {shape}, the manifest's shard_size is "
                                 f"{doc['units'][unit]['shard_size']}")
    return h


def _is_sharded_key(tree: dict, key: str) -> bool:
    group = key.rsplit("/", 1)[0]
    return any(n.get("type") == "sharded" and n.get("key") == group for n in nodes(tree))
