"""The reference log-probs of a preference run: one sharded forward-only pass over the dataset
before the first step (``odcfn.log_probs`` of the reference state, ``data.batch_size`` pairs
per call, one sync each), cached in ``<out_dir>/reference_logprobs.safetensors``.

The cache is keyed by what decides its values: the data file's sha256, the tokenized pairs'
digest (the tokenizer and the length policy), the reference's digest (the base Hugging Face
checkpoint's file digests, as LoRA checkpoints record them, or a fresh model's initial params)
and the compute dtype; and it carries the sha256 of its own values. A cache whose key differs,
whose values do not hash to the recorded digest or that cannot be read is named and recomputed,
never used. A rerun or resume with a valid cache runs no reference pass.

The reference is the policy's starting point: a fresh run's initial state itself; with LoRA the
same state with its adapters zero (``odcfn.lora_reference``: the base, no second model); a full
fine-tuning run resumed without a valid cache rebuilds its initial params for the pass and drops
them before the first step.

Every rank decides alone whether the cache serves, from the same file; only rank 0 writes it,
after the pass's last sync, which no rank passes before every rank has decided: so the ranks
never disagree on whether to run the (collective) pass.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from odcfn.sft.config import SFTConfig
from odcfn.sft.preference import PreparedPairs

__all__ = ["CACHE_NAME", "attach_reference", "cache_key", "read_cache", "reference_pass", "reference_sha256",
           "write_cache"]

CACHE_NAME = "reference_logprobs.safetensors"
_FORMAT = "1"


def reference_sha256(cfg: SFTConfig, model: Any, qcfg: Any) -> str:
    """The reference weights' digest: a base Hugging Face checkpoint's file digests (hashed once
    per process, as the LoRA checkpoints' base check does), or a fresh model's initial params."""
    h = hashlib.sha256()
    if cfg.model.hf_path:
        from odcfn.checkpoint.frozen import base_reference

        h.update(json.dumps(base_reference(model, cfg.model.hf_path)["sha256"], sort_keys=True).encode())
        return h.hexdigest()
    from odcfn.models import init_params
    from odcfn.tree import tree_flatten_with_path

    names, leaves, _ = tree_flatten_with_path(init_params(qcfg, seed=cfg.model.seed))
    for name, leaf in zip(names, leaves):
        h.update(f"{name}{tuple(leaf.shape)}{leaf.dtype}".encode())
        h.update(leaf.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_key(cfg: SFTConfig, data: PreparedPairs, data_sha: str, ref_sha: str) -> dict[str, str]:
    return {"format": _FORMAT, "data_sha256": data_sha, "tokens_sha256": data.tokens_sha256(),
            "reference_sha256": ref_sha, "compute_dtype": cfg.train.compute_dtype}


def _values_sha(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


_WHAT = {"data_sha256": "another data file", "tokens_sha256": "another tokenization of the data",
         "reference_sha256": "another reference model", "compute_dtype": "another compute_dtype",
         "format": "another cache format"}


def read_cache(
    path: Path, key: dict[str, str], lengths: list[int]
) -> tuple[tuple[torch.Tensor, ...] | None, str]:
    """``(per-sample log-probs, "")`` if ``path`` is a valid cache for ``key``, else
    ``(None, why not)``."""
    from safetensors import safe_open

    if not path.is_file():
        return None, "none yet"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            flat = f.get_tensor("logprobs")
    except Exception as e:  # any unreadable file: a truncated write, another format, garbage
        return None, f"{path} is unreadable ({type(e).__name__}: {e})"
    for k, v in key.items():
        if meta.get(k) != v:
            return None, f"{path} was made for {_WHAT.get(k, k)} ({k} differs)"
    if flat.dtype != torch.float32 or flat.shape != (sum(lengths),):
        return None, f"{path} holds {tuple(flat.shape)} values, the data has {sum(lengths)} tokens"
    if meta.get("values_sha256") != _values_sha(flat):
        return None, f"{path} is corrupted (its values do not hash to the recorded sha256)"
    return tuple(torch.split(flat, lengths)), ""


def write_cache(path: Path, key: dict[str, str], values: tuple[torch.Tensor, ...]) -> None:
    """Atomically: a reader sees the old file or the whole new one, never half of it."""
    from safetensors.torch import save_file

    flat = torch.cat([v.float().reshape(-1) for v in values]).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({"logprobs": flat}, str(tmp), metadata={**key, "values_sha256": _values_sha(flat)})
    os.replace(tmp, path)


def reference_pass(
    ref_state: Any, data: PreparedPairs, per_pass: int
) -> tuple[tuple[torch.Tensor, ...], int]:
    """Every sample's reference log-probs, ``per_pass`` pairs per ``odcfn.log_probs`` call."""
    import odcfn
    from odcfn.batch import Batch

    out: list[torch.Tensor] = []
    samples = data.samples
    passes = 0
    for at in range(0, len(samples), 2 * per_pass):
        out.extend(odcfn.log_probs(ref_state, Batch(samples[at:at + 2 * per_pass])))
        passes += 1
    return tuple(out), passes


def _reference_state(cfg: SFTConfig, state: Any, resumed: bool, initial: Callable[[], Any]) -> Any:
    import odcfn

    if cfg.lora.rank:
        return odcfn.lora_reference(state)  # the base: adapters zero, the same base shards
    if not resumed:
        return state  # a fresh run's state is its initial params: the reference
    # a resumed full fine-tuning run without a valid cache: its initial params, for this pass
    # only (plain SGD allocates no optimizer state)
    return odcfn.TrainState.create(params=initial(), model=state.model, optimizer=odcfn.sgd(0.0),
                                   transport=state.transport, config=state.config)


def attach_reference(
    cfg: SFTConfig, state: Any, data: PreparedPairs, data_sha: str, qcfg: Any, *, resumed: bool,
    initial: Callable[[], Any],
) -> tuple[PreparedPairs, dict[str, Any]]:
    """``data`` with the reference log-probs (cached, or computed and cached), and what was
    done: ``{"source": "cache" | "computed" | "none", "passes": n, "why": ...}``. ``initial``:
    this rank's initial shards (only called for a resumed full fine-tuning run that must
    recompute)."""
    data, info = _attach(cfg, state, data, data_sha, qcfg, resumed, initial)
    if state.mesh.rank == 0:
        print(f"odcfn train: {describe(info)}", flush=True)
    return data, info


def _attach(
    cfg: SFTConfig, state: Any, data: PreparedPairs, data_sha: str, qcfg: Any, resumed: bool,
    initial: Callable[[], Any],
) -> tuple[PreparedPairs, dict[str, Any]]:
    if not cfg.dpo.uses_reference:
        return data, {"source": "none", "passes": 0, "why": "reference-free loss"}
    path = Path(cfg.out_dir) / CACHE_NAME
    key = cache_key(cfg, data, data_sha, reference_sha256(cfg, state.model, qcfg))
    lengths = [s.length for s in data.samples]
    ref, why = read_cache(path, key, lengths)
    # one reference state for both sets, built only if a pass runs (a resume may rebuild it)
    ref_state = functools.cache(lambda: _reference_state(cfg, state, resumed, initial))
    from odcfn.sft.evaluate import attach_eval_reference

    data, held_out = attach_eval_reference(cfg, data, key, ref_state)  # [eval]'s pairs: their own cache
    if ref is not None:
        return replace(data, ref=ref), {"source": "cache", "passes": 0, "why": "", "path": str(path),
                                        "eval": held_out}
    t0 = time.perf_counter()
    ref, passes = reference_pass(ref_state(), data, cfg.data.batch_size)
    if state.mesh.rank == 0:  # the values are the same on every rank (the sync's sum)
        write_cache(path, key, ref)
    info = {"source": "computed", "passes": passes, "why": why, "path": str(path),
            "seconds": time.perf_counter() - t0, "eval": held_out}
    return replace(data, ref=ref), info


def describe(info: dict[str, Any]) -> str:
    """The run's line about its reference log-probs."""
    held_out = f"; {info['eval']}" if info.get("eval") else ""
    if info["source"] == "none":
        return f"reference log-probs: none ({info['why']})"
    if info["source"] == "cache":
        return f"reference log-probs: read from {info['path']} (verified; no reference pass){held_out}"
    return (f"reference log-probs: computed in {info['passes']} forward pass(es), "
            f"{info['seconds']:.1f}s, cached in {info['path']} (cache: {info['why']}){held_out}")
