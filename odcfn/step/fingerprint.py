"""Do all ranks run the same minibatch? A fingerprint that rides the one sync.

Every rank must pass the same global batch and config to ``train_step``; a rank that does not
would train on silently (each reporting its own loss). So each rank hashes what it was given
into a few small words — the sample lengths and loss-token count, the token ids and loss masks,
the step config, the layout and model — and appends each word ``f`` and its square ``f²`` to
the stats of the sync it already makes (no extra round trip). After the sum over W ranks,
``W·Σf² == (Σf)²`` holds exactly when every rank had the same ``f`` (Cauchy-Schwarz), so every
rank sees the same verdict and raises the same error before the optimizer step. Words have 20
bits so that the sums stay exact integers in float64 for up to 8192 ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from odcfn.batch import Batch

__all__ = ["BITS", "GATHER_WHAT", "WHAT", "check_agreement", "encode", "gather_words", "layout_key",
           "minibatch_words", "stable_repr"]

BITS = 20
WHAT = ("the sample lengths / loss-token count", "the token ids / loss masks", "the step config",
        "the parameter layout / model config")
GATHER_WHAT = ("the request (dst / units)", "the parameter layout / model config / step")
_MAX_WORLD = 1 << 13  # W * (2^20)^2 <= 2^53: exact in float64


def stable_repr(x: Any) -> str:
    """A description of ``x`` that is the same in every process (no ids or addresses)."""
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype)):
        return repr(x)
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__}({', '.join(stable_repr(v) for v in x)})"
    if isinstance(x, dict):
        items = sorted(x.items(), key=str)
        return "{" + ", ".join(f"{stable_repr(k)}: {stable_repr(v)}" for k, v in items) + "}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        inner = ", ".join(f"{f.name}={stable_repr(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__qualname__}({inner})"
    if hasattr(x, "func") and hasattr(x, "args"):  # functools.partial
        return f"partial({stable_repr(x.func)}, {stable_repr(x.args)}, {stable_repr(x.keywords)})"
    return f"{getattr(type(x), '__module__', '')}.{getattr(x, '__qualname__', type(x).__qualname__)}"


def _word(*parts: bytes | str) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return int.from_bytes(h.digest(), "little") & ((1 << BITS) - 1)


def _extra_bytes(key: str, v: torch.Tensor) -> bytes:
    """Key, dtype, shape and raw bytes of one extra: an int64 and an int32 tensor with the same
    values (or the same bytes in two shapes) differ, as they would in the microbatches."""
    head = f"{key}|{v.dtype}|{tuple(v.shape)}|".encode()
    # a byte view works for every dtype (numpy has no bfloat16 / unsigned 16-64 for .numpy())
    raw = v.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return head + raw.numpy().tobytes()


def minibatch_words(batch: Batch, config: Any, layout_key: str) -> list[int]:
    """This rank's fingerprint words, in the order of ``WHAT``."""
    tokens = hashlib.blake2b(digest_size=16)
    for s in batch.samples:
        tokens.update(s.tokens.to("cpu", torch.int64).contiguous().numpy().tobytes())
        mask = s.loss_mask
        tokens.update(b"-" if mask is None else mask.to("cpu", torch.uint8).contiguous().numpy().tobytes())
        for k in sorted(s.extras):  # RL rollout data (advantages, routed experts) must agree too
            tokens.update(_extra_bytes(k, s.extras[k]))
    return [
        _word(repr(tuple(batch.lengths)), str(batch.num_loss_tokens)),
        _word(tokens.digest()),
        _word(stable_repr(config)),
        _word(layout_key),
    ]


def layout_key(state: Any, layout: Any, step: int | None = None) -> str:
    """What must agree about the model and its sharding (and the step, when it keys randomness)."""
    m, mesh = state.model, state.mesh
    key = (f"{[(u.name, u.shard_size) for u in layout.units]} W={mesh.world_size} "
           f"{mesh.sharding}/{mesh.node_size} {m.dtype} {m.config_key}")
    if m.frozen:  # ranks that disagree on what is trained would push into missing accumulators
        key += f" frozen={list(m.frozen)}"
    if step is not None:  # ranks at different steps would draw different dropout masks
        key += f" step={step}"
    return key


def gather_words(request: Any, key: str) -> list[int]:
    """This rank's fingerprint words of a ``gather_params`` call, in the order of ``GATHER_WHAT``:
    ranks at different steps (one skipped an update) would hand an inference engine different
    weights under one name, so the step is part of ``key``."""
    return [_word(stable_repr(request)), _word(key)]


def encode(words: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The words and their squares, as the float64 entries appended to the sync's stats."""
    w = torch.tensor(words, dtype=torch.float64, device=device)
    return torch.cat([w, w * w])


def check_agreement(
    summed: torch.Tensor, world_size: int, words: list[int], detail: list[str], *,
    what: tuple[str, ...] = WHAT, subject: str = "minibatch", call: str = "train_step",
) -> None:
    """Raise ``ValueError("ranks disagree on the <subject>: ...")`` if the summed words show that
    ranks disagree; ``detail[i]`` describes this rank's input for word i, ``what[i]`` the word."""
    if world_size > _MAX_WORLD:  # pragma: no cover - the sums would no longer be exact
        return
    n = len(words)
    vals = [round(float(v)) for v in summed.tolist()]
    differ = [i for i in range(n) if world_size * vals[n + i] != vals[i] * vals[i]]
    if differ:
        said = "; ".join(f"{what[i]} differ (this rank: {detail[i]})" for i in differ)
        inputs = "arguments" if subject != "minibatch" else "global batch and StepConfig"
        raise ValueError(
            f"ranks disagree on the {subject}: {said}. Every rank must pass the same {inputs} "
            f"to {call} (and build the same model)"
        )
