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

The reference's digest is recorded in every checkpoint (``reference_sha256``, from the run's
start). A resume whose reference now hashes otherwise (the weights at ``model.hf_path`` were
replaced: the resume check compares files over 64 MiB by size only) is refused before any pass,
whether or not the cache survived: recomputing would change the objective mid-run. With
``checkpoint.recompute_reference`` (``--recompute-reference``) it recomputes from the new weights,
says so, and records the new digest.

Every rank decides alone whether the cache serves, from the same file; only rank 0 writes it,
after the pass's last sync, which no rank passes before every rank has decided: so the ranks
never disagree on whether to run the (collective) pass.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from odcfn.sft.config import SFTConfig
from odcfn.sft.preference import PreparedPairs

__all__ = ["CACHE_NAME", "EVAL_CACHE_NAME", "REFERENCE_SHA", "attach_eval_reference", "attach_reference",
           "cache_key", "check_reference", "read_cache", "reference_pass", "reference_sha256", "write_cache"]

CACHE_NAME = "reference_logprobs.safetensors"
REFERENCE_SHA = "reference_sha256"  # the checkpoint manifest's extra entry: the run's reference
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


def check_reference(cfg: SFTConfig, recorded: tuple[str, str | None] | None, now: str) -> str | None:
    """Refuse a resume whose reference differs from the one its run started with
    (``recorded``: the checkpoint and its ``reference_sha256``; None for a fresh run, and a
    checkpoint written before the record has none); a note to print when
    ``checkpoint.recompute_reference`` lets it through, else None. The same files on every rank:
    every rank decides alike."""
    if recorded is None or recorded[1] is None or recorded[1] == now:
        return None
    where, was = recorded
    what = (f"the weights at model.hf_path {cfg.model.hf_path}" if cfg.model.hf_path
            else f"the initial model of model.seed {cfg.model.seed}")
    change = f"reference sha256 {was[:12]}... -> {now[:12]}..."
    if not cfg.checkpoint.recompute_reference:
        raise ValueError(
            f"odcfn train: {where} was trained against another reference: {what} differ from those the run "
            f"started from ({change}). A preference loss measures the policy against that start, so resuming "
            "against other weights changes the objective mid-run. Restore the original weights, use "
            "--no-resume to start over, or --recompute-reference (checkpoint.recompute_reference) to "
            "resume against reference log-probs recomputed from these"
        )
    return (f"warning: resuming {where} against a new reference (checkpoint.recompute_reference): {what} "
            f"changed since the run started ({change}); its log-probs are recomputed from them")


def attach_reference(
    cfg: SFTConfig, state: Any, data: PreparedPairs, data_sha: str, qcfg: Any, *, resumed: bool,
    initial: Callable[[], Any], recorded: tuple[str, str | None] | None = None,
) -> tuple[PreparedPairs, dict[str, Any]]:
    """``data`` with the reference log-probs (cached, or computed and cached), and what was
    done: ``{"source": "cache" | "computed" | "none", "passes": n, "why": ..., "sha256": the
    reference's digest}``. ``initial``: this rank's initial shards (only called for a resumed
    full fine-tuning run that must recompute); ``recorded``: the resumed checkpoint and the
    reference digest it recorded (``check_reference``)."""
    data, info = _attach(cfg, state, data, data_sha, qcfg, resumed, initial, recorded)
    if state.mesh.rank == 0:
        print(f"odcfn train: {describe(info)}", flush=True)
    return data, info


def _attach(
    cfg: SFTConfig, state: Any, data: PreparedPairs, data_sha: str, qcfg: Any, resumed: bool,
    initial: Callable[[], Any], recorded: tuple[str, str | None] | None,
) -> tuple[PreparedPairs, dict[str, Any]]:
    if not cfg.dpo.uses_reference:
        return data, {"source": "none", "passes": 0, "why": "reference-free loss"}
    path = Path(cfg.out_dir) / CACHE_NAME
    ref_sha = reference_sha256(cfg, state.model, qcfg)  # hashed in full: not by size, as the resume check
    note = check_reference(cfg, recorded, ref_sha)  # before the cache: a valid one of new weights too
    if note is not None and state.mesh.rank == 0:
        print(f"odcfn train: {note}", file=sys.stderr, flush=True)
    key = cache_key(cfg, data, data_sha, ref_sha)
    lengths = [s.length for s in data.samples]
    ref, why = read_cache(path, key, lengths)
    # one reference state for both sets, built only if a pass runs (a resume may rebuild it)
    ref_state = functools.cache(lambda: _reference_state(cfg, state, resumed, initial))
    data, held_out = attach_eval_reference(cfg, data, key, ref_state)  # [eval]'s pairs: their own cache
    if ref is not None:
        return replace(data, ref=ref), {"source": "cache", "passes": 0, "why": "", "path": str(path),
                                        "eval": held_out, "sha256": ref_sha}
    t0 = time.perf_counter()
    ref, passes = reference_pass(ref_state(), data, cfg.data.batch_size)
    if state.mesh.rank == 0:  # the values are the same on every rank (the sync's sum)
        write_cache(path, key, ref)
    info = {"source": "computed", "passes": passes, "why": why, "path": str(path),
            "seconds": time.perf_counter() - t0, "eval": held_out, "sha256": ref_sha}
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


EVAL_CACHE_NAME = "reference_logprobs_eval.safetensors"  # [eval]'s held-out pairs


def attach_eval_reference(
    cfg: Any, data: Any, key: dict[str, str], ref_state: Callable[[], Any],
) -> tuple[Any, str]:
    """``data`` (``PreparedPairs``) with the reference log-probs of its held-out pairs, read from
    their cache or computed with ``ref_state()`` (called only then) and cached; and what was done.
    ``key``: the training set's cache key, whose data entries are replaced by the held-out set's."""
    from odcfn.data.sources import source_sha256
    from odcfn.sft.preference import PreparedPairs

    if not cfg.eval.every or data.eval is None:
        return data, ""
    held_out = PreparedPairs(data.eval, cfg.data.eval_path, (), 1)
    key = {**key, "data_sha256": source_sha256(cfg.data.eval_path), "tokens_sha256": held_out.tokens_sha256()}
    path = Path(cfg.out_dir) / EVAL_CACHE_NAME
    ref, why = read_cache(path, key, [s.length for s in held_out.samples])
    if ref is not None:
        return replace(data, eval_ref=ref), f"held-out set's read from {path}"
    state = ref_state()
    ref, passes = reference_pass(state, held_out, cfg.data.batch_size)
    if state.mesh.rank == 0:
        write_cache(path, key, ref)
    return replace(data, eval_ref=ref), f"held-out set's computed in {passes} pass(es) ({why})"
