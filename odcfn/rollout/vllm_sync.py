"""The weight sync of ``odcfn.rollout.vllm_engine.VLLMEngine``: how ``update_weights`` streams a
trainer's state into a running vLLM engine (``sync_weights``), bucket by bucket (``sync_plan``),
each bucket written into one shared-memory file (``bucket_layout``, ``write_bucket``, ``shm_dir``).
``odcfn.rollout.vllm_engine`` re-exports these names.

The units are gathered a bucket at a time (``odcfn.gather_params(state, units=...)``, every rank
in the same order), named as Hugging Face names them (``odcfn.models.hf_names.hf_state_dict``; a
LoRA state's adapters folded into their base weights first), and pushed into the engine, which
loads each bucket with vLLM's in-place ``reload_weights``. A bucket is never smaller than one of
vLLM's modules (a decoder layer's projections; a sparse layer with all its experts), because
vLLM can only rebuild a module from all of its weights at once; see ``sync_plan``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import odcfn
from odcfn.models.hf_names import hf_state_dict

__all__ = ["SyncStats", "bucket_layout", "shm_dir", "sync_plan", "sync_weights", "write_bucket"]


@dataclass(frozen=True)
class SyncStats:
    """One ``update_weights``: wall time (``gather_s`` of it in ``gather_params``, ``push_s`` in
    vLLM's reload), bytes sent, buckets, the largest bucket, and the engine process's RSS (current
    before, peak during) when the platform reports it."""

    seconds: float
    gather_s: float
    push_s: float
    bytes: int
    buckets: int
    max_bucket_bytes: int
    engine_rss_before: int
    engine_peak_rss: int


def _groups(model: odcfn.Model) -> list[list[str]]:
    """The model's units, in model order, grouped so that no vLLM module spans two groups: a
    sparse layer with its experts (vLLM fuses them into one module), every other unit alone.
    LoRA adapter units are not listed (they travel folded into their base units)."""
    ads = odcfn.lora.adapter_units(model)
    owner = {e: layer for layer, es in model.routed for e in es}
    out: dict[str, list[str]] = {}
    for name in model.unit_names:
        if name in ads:
            continue
        out.setdefault(owner.get(name, name), []).append(name)
    return list(out.values())


def _nbytes(model: odcfn.Model, unit: str, dtype: torch.dtype) -> int:
    shapes = model.unit(unit).shapes
    leaves = [s for s in _leaves(shapes)]
    return sum(int(torch.Size(s).numel()) for s in leaves) * torch.empty((), dtype=dtype).element_size()


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, Mapping):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


def sync_plan(model: odcfn.Model, dtype: torch.dtype, bucket_bytes: int) -> list[list[str]]:
    """The units of each bucket ``update_weights`` gathers and sends, in order: whole groups
    (``_groups``) packed while they fit ``bucket_bytes``; a group larger than that goes alone, so
    a bucket's size is at most ``max(bucket_bytes, the largest group)``."""
    buckets: list[list[str]] = []
    size = 0
    for g in _groups(model):
        n = sum(_nbytes(model, u, dtype) for u in g)
        if buckets and size + n <= bucket_bytes:
            buckets[-1] += g
            size += n
        else:
            buckets.append(list(g))
            size = n
    return buckets


def _fold_lora(model: odcfn.Model, full: dict, adapters: Mapping[str, Any]) -> dict:
    """``full`` (some base units) with ``W + scale * B @ A`` folded into the adapted weights of
    those units, in fp64 as ``odcfn.lora.merge`` (which needs every base unit at once)."""
    for name, ad in odcfn.lora.adapter_units(model).items():
        if ad.base not in full:
            continue
        for path in ad.paths:
            node, src = full[ad.base], adapters[name]
            for k in path.split("."):
                node, src = node[k], src[k]
            w = node["weight"]
            delta = ad.spec.scale * (src["lora_B"].double() @ src["lora_A"].double())
            node["weight"] = (w.double() + delta).to(w.dtype)
    return full


_ALIGN = 64  # byte alignment of each tensor in the bucket file


def bucket_layout(named: list[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, str, list[int], int]], int]:
    """Where each named tensor sits in a bucket file: ``[(name, dtype, shape, offset)]`` and the
    file's size."""
    meta, off = [], 0
    for name, t in named:
        meta.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), off))
        off += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return meta, off


def write_bucket(buf: torch.Tensor, meta: list, named: list[tuple[str, torch.Tensor]]) -> None:
    for (_, _, _, off), (_, x) in zip(meta, named):
        buf[off: off + x.numel() * x.element_size()].view(x.dtype).view(x.shape).copy_(x)


def sync_weights(state: Any, bucket_bytes: int, push: Any = None) -> SyncStats:
    """The collective half of ``VLLMEngine.update_weights``: gather ``state``'s units bucket by
    bucket (``sync_plan``; every rank calls this with the same ``bucket_bytes``), name them as
    Hugging Face does, write each bucket into one shared-memory file and have ``push`` load it.
    ``push(op, *args)`` drives the engine (``begin_sync(path, nbytes)``, ``load_bucket(meta)``,
    ``end_sync()``); a rank that hosts no engine passes None and only takes part in the gathers."""
    t0 = time.perf_counter()
    model = state.model
    lora = bool(odcfn.lora.adapter_units(model))
    dtype = state.config.compute_dtype or model.dtype  # what gather_params sends by default
    adapters = odcfn.lora.gather_adapters(state) if lora else {}
    plan = sync_plan(model, dtype, bucket_bytes)
    cap = max(sum(-(-_nbytes(model, u, dtype) // _ALIGN) * _ALIGN + _ALIGN * _n_leaves(model, u) for u in b)
              for b in plan)
    path, buf = None, None
    if push is not None:
        fd, path = tempfile.mkstemp(prefix="odcfn-vllm-sync-", dir=shm_dir())
        try:
            os.ftruncate(fd, cap)
        finally:
            os.close(fd)
    gather_s = push_s = 0.0
    sent = biggest = 0
    report: dict[str, Any] = {"missing": [], "rss_before": 0, "peak_rss": 0}
    try:
        if push is not None:
            buf = torch.from_file(path, shared=True, size=cap, dtype=torch.uint8)
            push("begin_sync", path, cap)
        for units in plan:
            t = time.perf_counter()
            full = odcfn.gather_params(state, units=units)
            if lora:
                full = _fold_lora(model, full, adapters)
            named = list(hf_state_dict(full).items())
            del full
            gather_s += time.perf_counter() - t
            meta, n = bucket_layout(named)
            sent, biggest = sent + n, max(biggest, n)
            if push is not None:
                t = time.perf_counter()
                write_bucket(buf, meta, named)
            del named  # before the next gather: one gathered bucket alive at a time
            if push is not None:
                push("load_bucket", meta)
                push_s += time.perf_counter() - t
        if push is not None:
            report = push("end_sync")
    finally:
        buf = None
        if path is not None:
            os.unlink(path)
    if report["missing"]:
        missing = report["missing"]
        raise RuntimeError(f"VLLMEngine.update_weights: vLLM parameters no bucket loaded: {missing[:8]}")
    return SyncStats(time.perf_counter() - t0, gather_s, push_s, sent, len(plan), biggest,
                     report["rss_before"], report["peak_rss"])


def _n_leaves(model: odcfn.Model, unit: str) -> int:
    return len(_leaves(model.unit(unit).shapes))


def shm_dir() -> str | None:
    """Where bucket files go: /dev/shm (memory, visible to the engine's processes) when it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None
