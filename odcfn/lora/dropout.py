"""LoRA dropout without a (tokens x d_in) mask.

PEFT's LoRA dropout zeroes elements of the A path's input. Drawing that mask whole costs a
fp32 (tokens x d_in) tensor per projection per forward (512 MiB at 32K x 4096), kept alive for
backward as a bool mask plus a dropped copy of the input. Here the mask of one sample is cut
into tiles of ``TILE`` tokens, each drawn from its own generator seeded by a hash of (LoRA seed,
optimizer step, sample index in the minibatch, unit, projection, tile index): a tile is a pure
function of those, so the forward draws one tile at a time, backward draws the same tiles again,
and nothing but the input itself (which the A path's gradient needs anyway) is kept. The key
holds no rank or microbatch, so every split of the minibatch trains the same function.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["TILE", "DropoutPlan", "dropout_mask", "dropout_plan"]

TILE = 256  # tokens per mask tile: a tile's fp32 draw is TILE x d_in x 4 bytes (4 MiB at 4096)


def _tile_seed(seed: int, step: int, sample: int, unit: str, path: str, tile: int) -> int:
    h = hashlib.blake2b(f"{seed}/{step}/{sample}/{unit}/{path}/{tile}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 1  # manual_seed takes a non-negative int64


def _draw(p: float, tile_seed: int, rows: int, d_in: int, device: torch.device | str) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(tile_seed)
    return torch.rand(rows, d_in, generator=g, device=device) < p


def _tiles(seed: int, step: int, sample: int, unit: str, path: str, length: int) -> list[tuple[int, int]]:
    """``(tile seed, rows)`` of one sample's tiles, in token order."""
    return [(_tile_seed(seed, step, sample, unit, path, k), min(TILE, length - lo))
            for k, lo in enumerate(range(0, length, TILE))]


def dropout_mask(
    p: float, *, seed: int, step: int, sample: int, unit: str, path: str, length: int, d_in: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The bool ``(length, d_in)`` mask of the inputs LoRA dropout zeroes for one sample at one
    projection (True: dropped, each with probability ``p``). It depends only on the LoRA seed,
    the optimizer step, the sample's index in the minibatch, the unit and the projection path,
    so ranks, balancers, microbatch packing and rematerialisation all see the same mask.
    Training never builds it whole (``DropoutPlan`` draws it tile by tile); it is the reference
    that tests hand to PEFT."""
    tiles = _tiles(seed, step, sample, unit, path, length)
    if not tiles:
        return torch.zeros(0, d_in, dtype=torch.bool, device=device)
    return torch.cat([_draw(p, s, rows, d_in, device) for s, rows in tiles])


@dataclass(frozen=True)
class DropoutPlan:
    """The dropout of one projection over one microbatch: ``plan(x, A)`` is
    ``F.linear(dropout(x), A)`` with the masks of ``dropout_mask`` for the microbatch's samples
    end to end, drawn tile by tile in forward and again in backward."""

    p: float
    tiles: tuple[tuple[int, int], ...]  # (tile seed, rows) in token order over the microbatch

    @property
    def keep_scale(self) -> float:
        return 1.0 / (1.0 - self.p)

    def masks(self, d_in: int, device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(lo, hi, mask)``: the bool mask of tokens ``lo:hi``, one tile at a time."""
        lo = 0
        for s, rows in self.tiles:
            yield lo, lo + rows, _draw(self.p, s, rows, d_in, device)
            lo += rows

    def __call__(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        rows = sum(r for _, r in self.tiles)
        if x.dim() != 2 or x.shape[0] != rows:
            raise ValueError(f"LoRA dropout: input of shape {tuple(x.shape)}, the plan covers {rows} tokens")
        return _DroppedA.apply(x, a, self)


def dropout_plan(
    p: float, *, seed: int, step: int, unit: str, path: str, samples: Sequence[int], lengths: Sequence[int]
) -> DropoutPlan:
    """The plan of a microbatch holding samples ``samples`` (indices in the minibatch) of
    ``lengths`` tokens, packed in that order."""
    tiles = [t for i, n in zip(samples, lengths) for t in _tiles(seed, step, i, unit, path, n)]
    return DropoutPlan(float(p), tuple(tiles))


class _DroppedA(torch.autograd.Function):
    """``F.linear(x * keep / (1 - p), A)`` whose backward redraws the masks instead of saving them
    (or the dropped copy of ``x``): it saves ``x`` and ``A`` only."""

    @staticmethod
    def forward(x: torch.Tensor, a: torch.Tensor, plan: DropoutPlan) -> torch.Tensor:
        out = x.new_empty(x.shape[0], a.shape[0])
        for lo, hi, m in plan.masks(x.shape[1], x.device):
            out[lo:hi] = F.linear(x[lo:hi].masked_fill(m, 0).mul_(plan.keep_scale), a)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # the form torch.func transforms accept
        x, a, plan = inputs
        ctx.save_for_backward(x, a)
        ctx.plan = plan

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, a = ctx.saved_tensors
        plan: DropoutPlan = ctx.plan
        want_x, want_a = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if want_x else None
        # tiles' shares summed in at least fp32: one matmul over all tokens accumulates so too
        acc = torch.promote_types(a.dtype, torch.float32)
        ga = torch.zeros(a.shape, dtype=acc, device=a.device) if want_a else None
        for lo, hi, m in plan.masks(x.shape[1], x.device):
            if gx is not None:
                gx[lo:hi] = (g[lo:hi] @ a).masked_fill_(m, 0).mul_(plan.keep_scale)
            if ga is not None:
                xa = x[lo:hi].masked_fill(m, 0).mul_(plan.keep_scale)
                ga += (g[lo:hi].T @ xa).to(acc)
        return gx, None if ga is None else ga.to(a.dtype), None
