"""Samples, minibatches and packed microbatches.

A minibatch is a tuple of variable-length samples. Every rank sees every sample's length (the
balancer needs them) and the token ids. A microbatch packs several samples end to end; the model
keeps attention and positions inside each sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Batch", "Microbatch", "Sample", "check_token_range", "pack", "random_batch"]


@dataclass(frozen=True)
class Sample:
    """One sequence. ``loss_mask[t]`` says whether token ``t`` is a prediction target
    (predicted from position ``t - 1``); token 0 is never a target."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor | None = None

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
    """A global minibatch: the unit of one ``train_step`` and of the one sync."""

    samples: tuple[Sample, ...]
    lengths: tuple[int, ...] = field(init=False)
    num_loss_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        samples = tuple(self.samples)
        if not samples:
            raise ValueError("Batch is empty: a minibatch needs at least one sample")
        for i, s in enumerate(samples):
            if not isinstance(s, Sample):
                raise TypeError(f"Batch.samples[{i}] is {type(s).__name__}, expected odcfn.Sample")
        object.__setattr__(self, "samples", samples)
        object.__setattr__(self, "lengths", tuple(s.length for s in samples))
        object.__setattr__(self, "num_loss_tokens", sum(s.num_loss_tokens for s in samples))
        if self.num_loss_tokens == 0:
            raise ValueError("Batch has no loss tokens (every loss_mask is empty)")

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
        )


def pack(batch: Batch, sample_ids: Sequence[int]) -> Microbatch:
    """Concatenate the given samples; labels are next tokens inside each sample."""
    ids, labels, mask, pos = [], [], [], []
    for i in sample_ids:
        s = batch.samples[i]
        t = s.tokens.long()
        m = torch.ones_like(t, dtype=torch.bool) if s.loss_mask is None else s.loss_mask.bool()
        ids.append(t)
        labels.append(torch.cat([t[1:], t.new_zeros(1)]))
        mask.append(torch.cat([m[1:], m.new_zeros(1)]))
        pos.append(torch.arange(t.numel()))
    if not ids:
        z = torch.zeros(0, dtype=torch.long)
        return Microbatch(z, z, torch.zeros(0), z, (), ())
    return Microbatch(
        input_ids_T=torch.cat(ids),
        labels_T=torch.cat(labels),
        loss_mask_T=torch.cat(mask).float(),
        positions_T=torch.cat(pos),
        seqlens=tuple(int(x.numel()) for x in ids),
        sample_ids=tuple(int(i) for i in sample_ids),
    )


def random_batch(lengths: Sequence[int], vocab_size: int, *, seed: int = 0) -> Batch:
    """Random token ids with the given lengths (a full loss mask)."""
    g = torch.Generator().manual_seed(seed)
    return Batch(
        tuple(Sample(torch.randint(0, vocab_size, (int(n),), generator=g)) for n in lengths)
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
