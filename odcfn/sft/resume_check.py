"""May this config resume that checkpoint? What ``odcfn train`` compares on resume.

- **Paths are compared by what they hold, not as typed.** The same config resumed from another
  working directory, or through an absolute config path, names its files differently; a
  checkpoint records the paths resolved to absolute ones (``stored_config``) and digests of
  what they hold (``path_digests``), and a resume compares the contents: ``data.path`` by the
  sha256 of the file, ``data.tokenizer`` and ``model.hf_path`` by ``tree_digest``. A
  checkpoint that records no digest (written before this) falls back to the resolved paths.
  ``data.cache_dir`` is a cache and never blocks a resume.
- **What ``--resume-anyway`` relaxes, and what it does not.** It lets a run go on with changed
  hyperparameters or data (each difference is printed, so the log shows what changed). It never
  lets a checkpoint be loaded as another model: the model's architecture and the LoRA adapters'
  shape (``STRUCTURAL``) are refused whatever the flag says, with a message naming them — that
  would not be the same run continued, and at best it fails later with a shape error.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from odcfn.sft.config import SFTConfig

__all__ = ["STRUCTURAL", "check_resume", "path_digests", "resume_conflicts", "stored_config", "tree_digest"]

# what may change when a run resumes: how long, on how many ranks, how it logs and checkpoints,
# whether it recomputes activations (the same math), how samples are balanced over ranks (the
# loss and gradient do not depend on it)
_RESUMABLE = {
    "train.steps", "train.world_size", "train.backend", "train.timeout", "train.max_restarts", "train.remat",
    "train.balance", "data.cache_dir", "model.seed",  # seed: only the initial weights, which resume replaces
    "data.eval_path",  # what is evaluated, not what is trained
}
_RESUMABLE_SECTIONS = {"log", "checkpoint"}
# the shape of the trained state: another value here is another model
STRUCTURAL = {
    "model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.d_ff",
    "model.head_dim", "model.qk_norm", "model.o_bias", "model.tie_embeddings", "model.qkv_bias",
    "lora.rank", "lora.targets",
}
# paths compared by content; data.path has its own digest (the manifest's data_sha256)
_DIGESTED = ("data.tokenizer", "model.hf_path")
_PATHS = {"model.hf_path", "data.path", "data.sources", "data.eval_path", "data.tokenizer", "data.cache_dir",
          "checkpoint.export_hf"}
_WHOLE = 64 << 20  # files up to this size are hashed whole; larger ones (weights) by name and size


def tree_digest(path: str | os.PathLike) -> str:
    """A digest of a file or directory's contents, independent of where it lies: every file's
    relative name and bytes, except that files over 64 MiB (model weights) count by size only —
    a resume takes the weights from the checkpoint, and a LoRA base is verified in full by
    ``odcfn.checkpoint.frozen`` anyway."""
    root, h = Path(path), hashlib.sha256()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.relative_to(root) if f != root else ''}\0{size}\0".encode())
        if size <= _WHOLE:
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
    return h.hexdigest()


def path_digests(cfg: SFTConfig) -> dict[str, str]:
    """``tree_digest`` of each of the run's digested paths that is set and exists."""
    doc, out = asdict(cfg), {}
    for key in _DIGESTED:
        section, name = key.split(".")
        value = doc[section][name]
        if value and Path(value).exists():
            out[key] = tree_digest(value)
    return out


def stored_config(cfg: SFTConfig) -> dict[str, Any]:
    """The config as a checkpoint records it: ``asdict`` with every path made absolute, so the
    record means the same from any working directory (resume, ``odcfn export``)."""
    doc = asdict(cfg)
    doc["out_dir"] = os.path.abspath(doc["out_dir"])
    for key in _PATHS:
        section, name = key.split(".")
        if isinstance(doc[section].get(name), str):
            doc[section][name] = os.path.abspath(doc[section][name])
    return doc


def _same_path(key: str, was: Any, now: Any, digests: tuple[dict, dict]) -> bool:
    if key in ("data.path", "data.sources"):
        return True  # compared by content (and the sources' weights), data_sha256 (check_resume)
    if not (isinstance(was, str) and isinstance(now, str)):
        return was == now
    then, current = digests[0].get(key), digests[1].get(key)
    if then is not None and current is not None:
        return then == current
    return os.path.realpath(was) == os.path.realpath(now)


def resume_conflicts(
    stored: dict[str, Any], cfg: SFTConfig, digests: tuple[dict[str, str], dict[str, str]] = ({}, {})
) -> list[str]:
    """The settings in which ``cfg`` differs from the stored config of the run it would resume
    (``asdict`` form), as ``"train.lr 0.001 -> 0.01"``; empty if it may resume. ``digests``:
    (the checkpoint's ``path_digests``, this config's)."""
    now, out = asdict(cfg), []
    for section, values in now.items():
        if section in _RESUMABLE_SECTIONS or not isinstance(values, dict):
            continue
        old = stored.get(section, {})
        for key, value in values.items():
            name, was = f"{section}.{key}", old.get(key, value)
            # a preference or RL run's reference is its initial model: there model.seed is not resumable
            if name in _RESUMABLE and not (name == "model.seed" and cfg.train.task in ("dpo", "rl")):
                continue
            same = _same_path(name, was, value, digests) if name in _PATHS else was == value
            if not same:
                out.append(f"{name} {old.get(key)!r} -> {value!r}")
    return out


def check_resume(cfg: SFTConfig, extra: dict[str, Any], data_sha256: str, where: str) -> None:
    """Refuse to resume checkpoint ``where`` (its manifest's ``extra``) as another model, and
    with another config or dataset unless ``checkpoint.resume_anyway`` (then say what differs)."""
    digests = (extra.get("path_digests") or {}, path_digests(cfg))
    diff = resume_conflicts(extra.get("config", {}), cfg, digests)
    if extra.get("data_sha256", data_sha256) != data_sha256:
        what = f"data.path {cfg.data.path}" if cfg.data.path else "[[data.sources]] (or their weights)"
        diff.append(f"the contents of {what} (sha256 differs)")
    model = [d for d in diff if d.split(" ", 1)[0] in STRUCTURAL]
    if model:
        raise ValueError(
            f"odcfn train: {where} belongs to a run with another config: {'; '.join(model)}. That is "
            "another model, and a checkpoint resumes only as the model it was trained as "
            "(--resume-anyway does not change that): use another out_dir, or --no-resume to start over"
        )
    if diff and not cfg.checkpoint.resume_anyway:
        raise ValueError(
            f"odcfn train: {where} belongs to a run with another config: {'; '.join(diff)}. Use "
            "another out_dir, --no-resume to start over, or --resume-anyway to continue it"
        )
    if diff:
        print(f"odcfn train: resuming {where} anyway (checkpoint.resume_anyway) although: "
              f"{'; '.join(diff)}", file=sys.stderr, flush=True)
