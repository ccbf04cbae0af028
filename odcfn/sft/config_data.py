"""The ``[data]`` section's checks beyond one key's type (``odcfn.sft.keys``): ``data.path`` or a
mixture of ``[[data.sources]]`` (each a table ``{path, weight}``, weight > 0, default 1), the held-out
``data.eval_path``, and, once the config names real paths (``check_inputs``), that each names data
``odcfn.data.sources`` reads: a JSONL or parquet file, a folder of them, or a datasets directory."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from odcfn._check import is_number

__all__ = ["check_data_paths", "check_data_section", "check_data_task", "data_paths", "data_sha256"]

_SOURCE_KEYS = ("path", "weight")


def check_data_section(d: Any) -> None:
    """``[data]``'s own rules; fills each source's default weight (so the stored config says it)."""
    if d.sources is None:
        return
    if d.path:
        raise ValueError("config: give data.path or [[data.sources]], not both (a single dataset is "
                         "data.path; several mixed by weight are [[data.sources]] tables)")
    if not d.sources:
        raise ValueError("config: [[data.sources]] is empty: give at least one {path, weight} table")
    filled = []
    for i, s in enumerate(d.sources):
        name = f"config: [[data.sources]] entry {i + 1}"
        if not isinstance(s, dict):
            raise ValueError(f"{name} must be a table with 'path' and 'weight', got {type(s).__name__} {s!r}")
        unknown = sorted(set(s) - set(_SOURCE_KEYS))
        if unknown:
            raise ValueError(f"{name}: unknown keys {unknown}; known: {list(_SOURCE_KEYS)}")
        path = s.get("path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{name}: 'path' is required, a string (a data file, folder or datasets "
                             f"directory), got {path!r}")
        w = s.get("weight", 1.0)
        if not is_number(w) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"{name} ({path}): 'weight' must be a number > 0 (its share of each minibatch, "
                             f"relative to the other sources' weights), got {w!r}")
        filled.append({"path": path, "weight": float(w)})
    object.__setattr__(d, "sources", filled)


def check_data_task(cfg: Any) -> None:
    """What the task's data reader supports: mixtures and held-out sets are read for SFT (and
    a held-out set of pairs for DPO); RL's prompts come from one data.path."""
    d, task = cfg.data, cfg.train.task
    if d.sources is not None and task != "sft":
        raise ValueError(f"config: [[data.sources]] mixes datasets for train.task = \"sft\"; with "
                         f"train.task = {task!r} give one data.path")
    if d.eval_path is not None and task == "rl":
        raise ValueError("config: data.eval_path is a held-out set for train.task = \"sft\" or \"dpo\" "
                         "(losses on held-out samples); RL has none: remove it")


def data_paths(cfg: Any) -> list[tuple[str, str]]:
    """``(key, path)`` of every dataset the run reads: the training data, then the held-out set."""
    d = cfg.data
    out = ([(f"[[data.sources]] entry {i + 1} path", s["path"]) for i, s in enumerate(d.sources)]
           if d.sources else [("data.path", d.path)])
    return out + ([("data.eval_path", d.eval_path)] if d.eval_path else [])


def check_data_paths(cfg: Any) -> None:
    """Each dataset path names data that can be read (a ValueError naming the key)."""
    from odcfn.data.sources import resolve

    for key, path in data_paths(cfg):
        try:
            resolve(path)
        except ValueError as e:
            raise ValueError(f"config: {key} {e}") from None


def data_sha256(cfg: Any) -> str:
    """A digest of the training data (a checkpoint's ``data_sha256``: a resume on other data is
    named): data.path's contents (for a file, its bytes' sha256, as before mixtures), or every
    source's contents and weight."""
    from odcfn.data.sources import source_sha256

    d = cfg.data
    if not d.sources:
        return source_sha256(d.path)
    h = hashlib.sha256(b"odcfn-mixture")
    for s in d.sources:
        h.update(f"{source_sha256(s['path'])}\0{s['weight']!r}\0".encode())
    return h.hexdigest()
