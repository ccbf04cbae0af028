"""Checkpoints of a state with frozen units (LoRA): only what changes, plus a reference to the base.

The frozen units (the base model) never change, so a checkpoint holds the trained units and
their optimizer state only, with a reference to where the base came from: its path and the
sha256 of its files (``odcfn.save(path, state, base=hf_dir)``). Loading verifies that the base
files still hash the same (every rank reads the same files, so every rank raises alike) and
keeps the state's own frozen shards. Each process hashes a base file once and reuses the digest
while the file's size, inode and modification time stay the same.

A base that records its own files' digests is not hashed at all (a base is GBs, and every
process of every save and load would read it whole): an odcfn checkpoint's manifest (its
rank files' sha256; the small manifest itself is hashed, so the reference pins the digests it
holds) and a Hugging Face cache snapshot (its large files are links to blobs named by their
content's sha256). Those digests name the base's identity; its bytes are checked where the base
is read (an odcfn checkpoint's files by ``read_shards``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from odcfn.checkpoint import sharded
from odcfn.model import Model, Unit

__all__ = ["KEY", "base_reference", "load_parts", "trained_model", "verify_base"]

KEY = "frozen_base"  # the manifest's extra entry


def trained_model(model: Model) -> Model:
    """The model's trained units alone (the checkpoint's layout); their reads of frozen units
    (tied weights) do not concern the checkpoint."""
    units = tuple(Unit(u.name, u.fwd, u.shapes) for u in model.units if u.name not in model.frozen)
    return Model(units, dtype=model.dtype, vocab_size=model.vocab_size, config_key=model.config_key)


def _files(base: Path) -> list[Path]:
    if base.is_file():
        return [base]
    if not base.is_dir():
        raise FileNotFoundError(f"the base {base} does not exist")
    return sorted(p for p in base.rglob("*") if p.is_file() and not p.name.startswith("."))


# (resolved path, device, inode, size, mtime_ns) -> sha256: a base is GBs and every save of a
# LoRA state references it, so each process hashes each base file once, again only if it changed
_DIGESTS: dict[tuple, str] = {}


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = _hash_file(path)
    return _DIGESTS[key]


_HEX64 = re.compile(r"[0-9a-f]{64}")


def _recorded(root: Path) -> dict[str, str]:
    """Name -> sha256 of the base's files whose digest the base itself records (see above)."""
    out: dict[str, str] = {}
    if root.is_dir():
        try:
            doc = json.loads((root / sharded.MANIFEST).read_text())
        except (OSError, ValueError):
            doc = None
        ours = isinstance(doc, dict) and doc.get("format") == sharded.FORMAT
        for e in doc.get("files") if ours and isinstance(doc.get("files"), list) else ():
            if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("sha256"), str):
                out[e["name"]] = e["sha256"]
        for p in _files(root):
            target = Path(os.readlink(p)) if p.is_symlink() else None
            if target is not None and target.parent.name == "blobs" and _HEX64.fullmatch(target.name):
                out[str(p.relative_to(root))] = target.name
    return out


def _digests(root: Path) -> dict[str, str]:
    """Name -> sha256 of every file of the base: recorded where the base records it, else hashed."""
    known = _recorded(root)
    return {
        (name := str(p.relative_to(root)) if p != root else p.name): known.get(name) or _sha256(p)
        for p in _files(root)
    }


def base_reference(model: Model, base: str | os.PathLike | None) -> dict[str, Any]:
    """What the manifest records about the frozen units and the base they came from."""
    if base is not None and not isinstance(base, (str, os.PathLike)):
        raise TypeError(
            f"odcfn.save: base must be a path (the base checkpoint) or None, got {type(base).__name__}"
        )
    ref: dict[str, Any] = {"units": list(model.frozen), "path": None, "sha256": {}}
    if base is not None:
        root = Path(base)
        ref["path"] = str(root.resolve())
        ref["sha256"] = _digests(root)
    return ref


def verify_base(ref: Any, model: Model, where: Path, base: str | os.PathLike | None) -> None:
    """Raise a ValueError naming the file if the base differs from the one the checkpoint
    was trained on (``base``: its location now; None: the recorded path)."""
    if not isinstance(ref, dict):
        raise ValueError(f"checkpoint {where} holds only trained units but records no base ({KEY!r})")
    if list(ref.get("units", [])) != list(model.frozen):
        raise ValueError(
            f"checkpoint {where} was saved with frozen units {ref.get('units')}, "
            f"the state freezes {list(model.frozen)}"
        )
    want = ref.get("sha256") or {}
    if not want:
        return  # saved without base=: nothing to verify against (the model config was checked)
    root = Path(base) if base is not None else Path(ref.get("path") or "")
    got = _digests(root)
    for name, digest in sorted(want.items()):
        if name not in got:
            raise ValueError(
                f"checkpoint {where}: its base file {root / name} is missing (the base has changed)"
            )
        if got[name] != digest:
            raise ValueError(
                f"checkpoint {where}: base file {root / name} differs from the one the adapters were trained "
                "on (sha256 mismatch): a LoRA checkpoint only makes sense on its own base"
            )


def load_parts(
    path: str | os.PathLike, model: Model, mesh: Any, frozen_shards: Any,
    base: str | os.PathLike | None = None,
) -> tuple[dict[str, Any], Any, int]:
    """``(params, opt_state, step)`` of checkpoint ``path`` for ``model``: with frozen units,
    the checkpoint's trained units next to ``frozen_shards`` (this rank's base shards), after
    ``verify_base``; without, the checkpoint's params as they are."""
    if not model.frozen:
        return sharded.read_shards(path, model=model, mesh=mesh)
    ref = sharded.read_manifest(path).get("extra", {}).get(KEY)
    verify_base(ref, model, Path(path), base)
    params, opt_state, step = sharded.read_shards(path, model=trained_model(model), mesh=mesh)
    return {**{k: frozen_shards[k] for k in model.frozen}, **params}, opt_state, step
