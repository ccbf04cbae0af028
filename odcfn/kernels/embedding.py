"""An embedding lookup whose weight gradient is added row by row into the unit's flat gradient.

``F.embedding``'s backward materialises a dense V×D gradient for a lookup that touched T rows;
in the step that gradient is then added into the unit's flat gradient (``grad_sink``), so the
embedding unit's backward held two V×D buffers besides its gathered weights (three with a tied
head's gradient waiting to be added). ``embedding`` adds the T token rows' gradient with one
``index_add_`` straight into the flat gradient when the weight is a ``flat_views`` view and
returns no gradient for it; elsewhere (a plain tensor, ``torch.func`` transforms) it returns the
same dense gradient ``F.embedding`` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from odcfn.kernels.grad_sink import destination

__all__ = ["embedding"]


class _Embedding(torch.autograd.Function):
    """Written with ``setup_context`` so that ``torch.func`` transforms (the reference's
    ``grad``) work."""

    @staticmethod
    def forward(ids: torch.Tensor, w_VxD: torch.Tensor, pad: int | None) -> torch.Tensor:
        return F.embedding(ids, w_VxD, padding_idx=pad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ids, w_VxD, pad = inputs
        # W itself (a view of the gathered buffer, alive anyway): backward finds its sink from it
        ctx.save_for_backward(ids, w_VxD)
        ctx.pad = pad

    @staticmethod
    def backward(ctx: Any, g_out: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        if not ctx.needs_input_grad[1]:
            return None, None, None
        ids, w = ctx.saved_tensors
        idx = ids.reshape(-1)
        rows = g_out.reshape(-1, w.shape[1])
        if ctx.pad is not None:  # the padding row gets no gradient, as in F.embedding
            keep = idx != ctx.pad % w.shape[0]
            idx, rows = idx[keep], rows[keep]
        dest = destination(w)
        out = dest if dest is not None else torch.zeros_like(w)
        if out.dtype.itemsize < 4 or out.is_cuda:
            # a repeated token's rows summed first, in fp32, into U×D (U the distinct tokens) by
            # F.embedding's own backward on that small problem, then added once per row: a bf16
            # gradient is rounded once per row, and on CUDA the sum is F.embedding's
            # deterministic one, not index_add_'s atomics in a run-dependent order
            idx, slot = idx.unique(return_inverse=True)
            rows = torch.ops.aten.embedding_dense_backward(rows.float(), slot, idx.numel(), -1, False)
        out.index_add_(0, idx, rows.to(out.dtype))  # on CUDA the indices are distinct by now
        # written into the sink: no gradient to return (the flat gradient already holds it)
        return None, (None if dest is not None else out), None


def embedding(ids: torch.Tensor, w_VxD: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(ids, w_VxD, padding_idx=padding_idx)``, differentiable in ``w_VxD`` without
    a dense V×D gradient when ``w_VxD`` is a ``grad_sink.flat_views`` view."""
    if not (torch.is_grad_enabled() and w_VxD.requires_grad):
        return F.embedding(ids, w_VxD, padding_idx=padding_idx)
    return _Embedding.apply(ids, w_VxD, padding_idx)
