"""Do all ranks run the same minibatch? A fingerprint that rides the one sync.

Every rank must pass the same global batch and config to ``train_step``; a rank that does not
would train on silently (each reporting its own loss). So each rank hashes what it was given
into a few small words — the sample lengths and loss-token count, the token ids and loss masks,
the step config, the layout and model, the per-token extras' names and each extra's values (one
word per extra, in name order, so the error names the extra that differs) — and appends each
word ``f`` and its square ``f²`` to the stats of the sync it already makes (no extra round
trip). After the sum over W ranks, ``W·Σf² == (Σf)²`` holds exactly when every rank had the
same ``f`` (Cauchy-Schwarz), so every rank sees the same verdict and raises the same error
before the optimizer step. Words have 20 bits so that the sums stay exact integers in float64
for up to 8192 ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

from odcfn.batch import Batch

__all__ = ["BITS", "EXTRA_SLOTS", "GATHER_WHAT", "WHAT", "check_agreement", "encode", "extra_slots",
           "gather_words", "layout_key", "minibatch_words", "stable_repr"]

BITS = 20
# extras with a word of their own, in name order (a batch with more shares the last one): the
# word count must not depend on the batch, since the words of all ranks are summed position by
# position
EXTRA_SLOTS = 6
WHAT = ("the sample lengths / loss-token count", "the token ids / loss masks", "the step config",
        "the parameter layout / model config", "the per-token extras' names / dtypes / shapes",
        *("the values of a per-token extra",) * EXTRA_SLOTS)
GATHER_WHAT = ("the request (dst / units)", "the parameter layout / model config / step")
_MAX_WORLD = 1 << 13  # W * (2^20)^2 <= 2^53: exact in float64


def stable_repr(x: Any) -> str:
    """A description of ``x`` that is the same in every process (no ids or addresses)."""
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype)):
        return repr(x)
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__}({', '.join(stable_repr(v) for v in x)})"
    if isinstance(x, (set, frozenset)):  # by contents: ScheduleOptions.remat / frozen / passthrough
        return f"{type(x).__name__}({', '.join(sorted(stable_repr(v) for v in x))})"
    if isinstance(x, torch.Tensor):  # by values: a digest of dtype, shape and bytes
        return f"tensor({x.dtype}, {tuple(x.shape)}, {_tensor_digest(x)})"
    if isinstance(x, dict):
        items = sorted(x.items(), key=str)
        return "{" + ", ".join(f"{stable_repr(k)}: {stable_repr(v)}" for k, v in items) + "}"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        inner = ", ".join(f"{f.name}={stable_repr(getattr(x, f.name))}" for f in dataclasses.fields(x))
        return f"{type(x).__qualname__}({inner})"
    if hasattr(x, "func") and hasattr(x, "args"):  # functools.partial
        return f"partial({stable_repr(x.func)}, {stable_repr(x.args)}, {stable_repr(x.keywords)})"
    return f"{getattr(type(x), '__module__', '')}.{getattr(x, '__qualname__', type(x).__qualname__)}"


def _tensor_digest(v: torch.Tensor) -> str:
    raw = v.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # any dtype, as bytes
    return hashlib.blake2b(raw.numpy().tobytes(), digest_size=8).hexdigest()


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


def extra_slots(batch: Batch) -> list[list[str]]:
    """The extras' names word by word: ``EXTRA_SLOTS`` lists in name order (every sample of a
    batch carries the same extras), empty when the batch has fewer, the rest in the last."""
    names = sorted(batch.samples[0].extras) if batch.samples else []
    slots: list[list[str]] = [[n] for n in names[: EXTRA_SLOTS - 1]]
    slots.append(names[EXTRA_SLOTS - 1 :])
    return slots + [[] for _ in range(EXTRA_SLOTS - len(slots))]


def minibatch_words(batch: Batch, config: Any, layout_key: str) -> list[int]:
    """This rank's fingerprint words, in the order of ``WHAT``."""
    tokens = hashlib.blake2b(digest_size=16)
    for s in batch.samples:
        tokens.update(s.tokens.to("cpu", torch.int64).contiguous().numpy().tobytes())
        mask = s.loss_mask
        tokens.update(b"-" if mask is None else mask.to("cpu", torch.uint8).contiguous().numpy().tobytes())
    # RL rollout data (advantages, routed experts) must agree too: the names, dtypes and shapes
    # in one word, each extra's values in its own, so that a difference is named
    shapes = [f"{k}|{v.dtype}|{tuple(v.shape)}" for s in batch.samples for k, v in sorted(s.extras.items())]
    values = []
    for names in extra_slots(batch):
        h = hashlib.blake2b(digest_size=16)
        for s in batch.samples:
            for k in names:
                h.update(_extra_bytes(k, s.extras[k]))
        values.append(_word(h.digest()))
    return [
        _word(repr(tuple(batch.lengths)), str(batch.num_loss_tokens)),
        _word(tokens.digest()),
        _word(stable_repr(config)),
        _word(layout_key),
        _word(repr(shapes)),
        *values,
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
