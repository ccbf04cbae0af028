"""Samples, minibatches and packed microbatches.

A minibatch is a tuple of variable-length samples. Every rank sees every sample's length (the
balancer needs them) and the token ids. A microbatch packs several samples end to end; the model
keeps attention and positions inside each sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Batch", "Microbatch", "Sample", "check_token_range", "pack", "random_batch"]


@dataclass(frozen=True)
class Sample:
    """One sequence. ``loss_mask[t]`` says whether token ``t`` is a prediction target
    (predicted from position ``t - 1``); token 0 is never a target.

    ``extras`` maps names to per-token tensors whose first dimension is the tokens' length
    ``T``; any trailing shape. Their dtype says which token row ``t`` belongs to:

    - floating (RL rollout data: ``advantages``, ``old_logprobs``, ``ref_logprobs``): row ``t``
      belongs to token ``t`` as a prediction target, like ``loss_mask[t]``; stored as float32,
      and ``pack`` aligns them with ``labels_T``;
    - integer or bool (e.g. ``routed_experts`` of shape (T, MoE layers, top-k)): row ``t``
      belongs to input position ``t``; kept in their dtype, and ``pack`` aligns them with
      ``input_ids_T`` (plain concatenation).

    Every sample of a ``Batch`` carries the same keys, each with one dtype and trailing shape.
    """

    tokens: torch.Tensor
    loss_mask: torch.Tensor | None = None
    extras: Mapping[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 1:
            raise TypeError(f"Sample.tokens must be a 1-D integer tensor, got {_desc(self.tokens)}")
        if self.tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"Sample.tokens must be int64 or int32, got {self.tokens.dtype}")
        if self.tokens.numel() == 0:
            raise ValueError("Sample.tokens is empty; a sample needs at least one token")
        if self.loss_mask is not None:
            if not isinstance(self.loss_mask, torch.Tensor) or self.loss_mask.shape != self.tokens.shape:
                raise ValueError(
                    f"Sample.loss_mask must have the tokens' shape {tuple(self.tokens.shape)}, "
                    f"got {_desc(self.loss_mask)}"
                )
            m = self.loss_mask
            # pack reads the mask as bool but num_loss_tokens sums it: any other value would
            # silently change the loss's normaliser
            if m.dtype != torch.bool and not bool(((m == 0) | (m == 1)).all()):
                bad = int(((m != 0) & (m != 1)).nonzero()[0, 0])
                raise ValueError(
                    f"Sample.loss_mask must hold only 0/1 (or bool) values, got {m[bad].item()!r} "
                    f"at token {bad}"
                )
        object.__setattr__(self, "extras", _check_extras(self.extras, self.tokens.numel()))

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_loss_tokens(self) -> int:
        if self.loss_mask is None:
            return self.length - 1
        return int(self.loss_mask[1:].sum().item())


@dataclass(frozen=True)
class Batch:
    """A global minibatch: the unit of one ``train_step`` and of the one sync.

    ``step``: the optimizer step the minibatch trains in, which ``train_step`` / ``grad_step``
    set from ``TrainState.step``; training-time randomness (LoRA dropout) is keyed on it and on
    each sample's index in the minibatch, never on ranks or microbatches. None (log-probs, a
    reference forward): no dropout.

    ``pairs``: samples ``2k`` and ``2k + 1`` are pair ``k`` (chosen, rejected; build it with
    ``odcfn.preference_batch``): the balancers place each pair as one unit, so both members meet
    in one microbatch of one rank (a DPO loss needs both sequence sums at once).
    """

    samples: tuple[Sample, ...]
    lengths: tuple[int, ...] = field(init=False)
    num_loss_tokens: int = field(init=False)
    step: int | None = None
    pairs: bool = False

    def __post_init__(self) -> None:
        samples = tuple(self.samples)
        if not samples:
            raise ValueError("Batch is empty: a minibatch needs at least one sample")
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"Batch.samples[{i}] is {type(s).__name__}, expected odcfn.Sample")
        _check_batch_extras(samples)
        object.__setattr__(self, "samples", samples)
        object.__setattr__(self, "lengths", tuple(s.length for s in samples))
        object.__setattr__(self, "num_loss_tokens", sum(s.num_loss_tokens for s in samples))
        if self.num_loss_tokens == 0:
            raise ValueError("Batch has no loss tokens (every loss_mask is empty)")
        if self.step is not None and (isinstance(self.step, bool) or not isinstance(self.step, int)):
            raise TypeError(f"Batch.step must be an int or None, got {self.step!r}")
        if not isinstance(self.pairs, bool):
            raise TypeError(f"Batch.pairs must be a bool, got {type(self.pairs).__name__}")
        if self.pairs and len(samples) % 2:
            raise ValueError(
                f"Batch(pairs=True) has {len(samples)} samples: pair {len(samples) // 2} lacks its "
                "rejected member (samples 2k, 2k + 1 are pair k)"
            )

    def __len__(self) -> int:
        return len(self.samples)


@dataclass(frozen=True)
class Microbatch:
    """Samples packed into one row of ``T`` tokens (``T`` may be 0: an empty microbatch)."""

    input_ids_T: torch.Tensor
    labels_T: torch.Tensor
    loss_mask_T: torch.Tensor  # float, 1.0 where labels_T is a target
    positions_T: torch.Tensor
    seqlens: tuple[int, ...]
    sample_ids: tuple[int, ...]
    # first dim T: float extras per target token, aligned with labels_T (0 after each sample's
    # last token); integer / bool extras per input position, aligned with input_ids_T
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # the loss seam (``odcfn.losses``): the loss the head unit computes and its per-token weights
    # from the whole minibatch; None: the head returns the summed cross-entropy (the default)
    loss: Any = None
    weight_T: torch.Tensor | None = None
    step: int | None = None  # the minibatch's ``Batch.step`` (None: no training-time randomness)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.numel())

    @property
    def empty(self) -> bool:
        return not self.seqlens

    def to(self, device: torch.device | str) -> Microbatch:
        """The same microbatch with its tensors on ``device`` (lengths stay on the host)."""
        move = lambda t: t.to(device, non_blocking=True)
        return Microbatch(
            move(self.input_ids_T), move(self.labels_T), move(self.loss_mask_T),
            move(self.positions_T), self.seqlens, self.sample_ids,
            {k: move(v) for k, v in self.extras.items()}, self.loss,
            None if self.weight_T is None else move(self.weight_T), self.step,
        )


def _shift(x: torch.Tensor) -> torch.Tensor:
    """Per-token values of a sample -> per-position values aligned with its labels (dim 0)."""
    return torch.cat([x[1:], x.new_zeros((1, *x.shape[1:]))])


def _pack_extra(v: torch.Tensor) -> torch.Tensor:
    """A sample's extra as its rows of the microbatch (see ``Sample``): float extras belong to
    targets, so they move to the position that predicts them; others stay at their input."""
    return _shift(v) if v.is_floating_point() else v


def pack(
    batch: Batch,
    sample_ids: Sequence[int],
    *,
    loss: Any = None,
    weights: Sequence[torch.Tensor] | None = None,
) -> Microbatch:
    """Concatenate the given samples; labels are next tokens inside each sample.

    ``weights`` (one per-token tensor per sample of the batch, aligned like extras, e.g. from
    ``loss.weights(batch)``) and ``loss`` ride along for the head unit.
    """
    ids, labels, mask, pos, w = [], [], [], [], []
    extras: dict[str, list[torch.Tensor]] = {k: [] for k in batch.samples[0].extras}
    for i in sample_ids:
        s = batch.samples[i]
        t = s.tokens.long()
        m = torch.ones_like(t, dtype=torch.bool) if s.loss_mask is None else s.loss_mask.bool()
        ids.append(t)
        labels.append(_shift(t))
        mask.append(_shift(m))
        pos.append(torch.arange(t.numel()))
        for k, v in s.extras.items():
            extras[k].append(_pack_extra(v))
        if weights is not None:
            w.append(_shift(weights[i].float()))
    if not ids:
        z = torch.zeros(0, dtype=torch.long)
        zf = torch.zeros(0)
        # empty extras keep their key's dtype and trailing shape, as a non-empty pack would
        first = batch.samples[0].extras
        ex = {k: v.new_zeros((0, *v.shape[1:])) for k, v in first.items()}
        return Microbatch(z, z, zf, z, (), (), ex, loss,
                          None if weights is None else zf, batch.step)
    return Microbatch(
        input_ids_T=torch.cat(ids),
        labels_T=torch.cat(labels),
        loss_mask_T=torch.cat(mask).float(),
        positions_T=torch.cat(pos),
        seqlens=tuple(int(x.numel()) for x in ids),
        sample_ids=tuple(int(i) for i in sample_ids),
        extras={k: torch.cat(v) for k, v in extras.items()},
        loss=loss,
        weight_T=torch.cat(w) if weights is not None else None,
        step=batch.step,
    )


def random_batch(lengths: Sequence[int], vocab_size: int, *, seed: int = 0) -> Batch:
    """Random token ids with the given lengths (a full loss mask)."""
    g = torch.Generator().manual_seed(seed)
    return Batch(
        tuple(Sample(torch.randint(0, vocab_size, (int(n),), generator=g)) for n in lengths)
    )


def _check_extras(extras: Any, n: int) -> Mapping[str, torch.Tensor]:
    if extras is None:
        return {}
    if not isinstance(extras, Mapping):
        raise TypeError(f"Sample.extras must be a dict of per-token tensors, got {type(extras).__name__}")
    out = {}
    for k, v in extras.items():
        if not isinstance(k, str):
            raise TypeError(f"Sample.extras keys must be str, got {k!r}")
        if not isinstance(v, torch.Tensor) or v.dim() < 1 or v.shape[0] != n:
            raise ValueError(
                f"Sample.extras[{k!r}] must be a tensor whose first dimension is the tokens' "
                f"length {n}, got {_desc(v)}"
            )
        if v.is_complex():  # neither a per-target value nor an index: nothing reads it
            raise TypeError(f"Sample.extras[{k!r}] must be a float, integer or bool tensor, got {v.dtype}")
        if not v.is_floating_point():
            out[k] = v.detach()  # indices (routed experts): exact, in their own dtype
            continue
        v = v.detach().to(torch.float32)
        if not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).nonzero()[0, 0])
            value = float(v[~torch.isfinite(v)][0])
            raise ValueError(f"Sample.extras[{k!r}] is not finite at token {bad} ({value})")
        out[k] = v
    return out


def _check_batch_extras(samples: tuple[Sample, ...]) -> None:
    """Same keys, dtypes and trailing shapes in every sample: ``pack`` concatenates each key's
    rows, so a mismatch would fail (or silently promote) on some ranks' microbatches only."""
    first = samples[0].extras
    for i, s in enumerate(samples):
        if set(s.extras) != set(first):
            raise ValueError(
                f"Batch.samples[{i}] has extras {sorted(s.extras)}, samples[0] has {sorted(first)}: "
                "every sample of a minibatch carries the same extras"
            )
        for k, v in s.extras.items():
            if v.dtype != first[k].dtype:
                raise TypeError(
                    f"Batch.samples[{i}].extras[{k!r}] has dtype {v.dtype}, samples[0]'s has "
                    f"{first[k].dtype}: each extra has one dtype across the minibatch"
                )
            if v.shape[1:] != first[k].shape[1:]:
                raise ValueError(
                    f"Batch.samples[{i}].extras[{k!r}] has per-token shape {tuple(v.shape[1:])}, "
                    f"samples[0]'s has {tuple(first[k].shape[1:])}: each extra has one shape per "
                    "token across the minibatch"
                )


def _desc(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__


def check_token_range(batch: Batch, vocab_size: int | None) -> None:
    """``ValueError`` naming the first sample with a token id outside ``[0, vocab_size)``."""
    if vocab_size is None:
        return
    for i, s in enumerate(batch.samples):
        lo, hi = int(s.tokens.min()), int(s.tokens.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            pos = int((s.tokens == bad).nonzero()[0, 0])
            raise ValueError(
                f"batch sample {i}: token id {bad} at position {pos} is outside the model's "
                f"vocabulary [0, {vocab_size})"
            )
