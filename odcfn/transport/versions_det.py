"""Deterministic accumulation under bounded staleness (``StepConfig(deterministic=True)`` with
τ >= 1), in-process and across processes (``VersionStore(ordered=True)``): each owner's gradient
of step ``k`` is summed in one fixed order, whatever the timing.

The order: rank ``r``'s own sum ``s_r`` = its pushes of step ``k`` added one by one, in the
order its plan pushes them, into a zeroed fp32 shard; then ``s_0 + s_1 + ... + s_{W-1}`` in rank
order (``rank_order_sum``), computed by whoever applies the step. Every ``s_r`` lives in its own
buffer at the owner (part ``r`` of the owner's accumulator slot), written by rank ``r`` alone, so no
push waits for another rank's turn.

Why not the synchronous mode's ordered turns (``odcfn.step.ordered_push``): there every rank is
in the same minibatch and a turn is never far; under staleness the rank whose turn comes next
may be τ minibatches behind, and waiting for it would put back the barrier staleness removes
(or, a rank that cannot finish its step's turns before its next step, stage whole unsharded
gradients across steps). Separate per-rank buffers need no waiting at all, so this mode adds no
wait to the stale protocol (no new deadlock), at a memory cost: an owner holds up to
``ring × W`` fp32 shards of its trained units (``ring = τ_max + 1``), i.e. ``τ_max + 1`` copies
of the trained parameters per rank instead of ``(τ_max + 1) / W`` in arrival order. Buffers
are made at a rank's first push of a step and dropped when the step is applied, so only
minibatches in flight hold them.

``accumulate`` and ``rank_order_sum`` are the whole arithmetic: ``odcfn.step.stale_replay``
calls the same two functions, which is what makes the exact replay bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping, Sequence

import torch

__all__ = ["accumulate", "rank_order_sum"]


def accumulate(part: MutableMapping[str, torch.Tensor], unit: str, piece: torch.Tensor) -> None:
    """Add ``piece`` to this rank's own fp32 sum of ``unit`` (made zero at its first push)."""
    buf = part.get(unit)
    if buf is None:
        buf = part[unit] = torch.zeros(piece.numel(), dtype=torch.float32, device=piece.device)
    buf.add_(piece)


def rank_order_sum(
    parts: Sequence[Mapping[str, torch.Tensor]], units: Iterable[str], size: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """``s_0 + s_1 + ...`` per unit in rank order (``parts[r]``: rank ``r``'s sums; a rank that
    pushed nothing into a unit is skipped), added in place into the first rank's buffer."""
    out: dict[str, torch.Tensor] = {}
    for u in units:
        total = None
        for part in parts:
            g = part.get(u)
            if g is not None:
                total = g if total is None else total.add_(g)
        out[u] = torch.zeros(size[u], dtype=torch.float32) if total is None else total
    return out
