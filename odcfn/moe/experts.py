"""Routed expert compute: tokens sorted by expert, one matmul chain per used expert, experts
taken from an *expert source* a group at a time.

A MoE layer's pure function never holds its experts itself: it receives ``p["experts"]``, an
``ExpertSource``, and calls ``source.apply(x_NxD, idx_NxK, w_NxK)``. Two sources:

- ``LocalExperts``: the experts' parameter trees in memory (the single-process reference,
  ``Model.apply``, and the collective path, which all-gathers every expert as FSDP does);
  plain autograd differentiates them.
- ``OnDemandExperts``: ODC. The executor hands it a ``Fetcher`` that gathers experts from their
  owners into buffers and pushes gradients into their owners' accumulators. Forward gathers
  only the experts at least one token routes to, ``group`` at a time, releasing each group after
  its tokens are done; backward walks the same groups again, recomputes each expert's
  activations from the saved input, and scatter-accumulates each expert's gradient as soon as
  it is complete. At most ``group`` experts' weights (and gradients) are resident at once, and
  an expert no token routes to is neither gathered nor pushed: its gradient is an exact zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

__all__ = ["ExpertSource", "Fetcher", "LocalExperts", "OnDemandExperts", "expert_ffn", "routed_ffn",
           "sort_by_expert"]


def expert_ffn(p: dict, x_NxD: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert (Hugging Face's ``gate_proj``/``up_proj``/``down_proj``)."""
    g = F.linear(x_NxD, p["gate_proj"]["weight"])
    u = F.linear(x_NxD, p["up_proj"]["weight"])
    return F.linear(F.silu(g) * u, p["down_proj"]["weight"])


def sort_by_expert(idx_NxK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """``(order, counts)``: the flat (token, slot) rows sorted by expert (stable, so each
    expert's rows keep token order) and each expert's row count. Row ``r`` is token ``r // K``."""
    flat = idx_NxK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def _segments(counts: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(expert, first row, row count)`` of every used expert, in expert order."""
    out, off = [], 0
    for e, c in enumerate(counts):
        if c:
            out.append((e, off, c))
        off += c
    return out


def _groups(segs: list[tuple[int, int, int]], group: int) -> list[list[tuple[int, int, int]]]:
    return [segs[i:i + group] for i in range(0, len(segs), group)]


def routed_ffn(
    x_NxD: torch.Tensor, idx_NxK: torch.Tensor, w_NxK: torch.Tensor,
    experts: Callable[[int], dict], num_experts: int,
) -> torch.Tensor:
    """``sum_k w[n, k] * expert_{idx[n, k]}(x[n])`` with plain autograd, experts by index."""
    K = idx_NxK.shape[1]
    order, counts = sort_by_expert(idx_NxK, num_experts)
    w_R = w_NxK.reshape(-1)
    y = torch.zeros_like(x_NxD)
    for e, off, c in _segments(counts):
        rows = order[off:off + c]
        tok = rows // K
        h = expert_ffn(experts(e), x_NxD[tok])
        y = y.index_add(0, tok, h * w_R[rows, None].to(h.dtype))
    return y


class ExpertSource(Protocol):
    """What a MoE layer's function receives as ``p["experts"]``."""

    num_experts: int
    log: Any  # the microbatch's ``RouterLog`` (routing record, aux loss, loads), or None

    def apply(self, x_NxD: torch.Tensor, idx_NxK: torch.Tensor, w_NxK: torch.Tensor) -> torch.Tensor: ...


class LocalExperts:
    """Experts held in memory: a list of per-expert parameter trees (differentiable)."""

    def __init__(self, trees: Sequence[dict], log: Any = None) -> None:
        self.trees = list(trees)
        self.num_experts = len(self.trees)
        self.log = log

    def apply(self, x_NxD: torch.Tensor, idx_NxK: torch.Tensor, w_NxK: torch.Tensor) -> torch.Tensor:
        return routed_ffn(x_NxD, idx_NxK, w_NxK, self.trees.__getitem__, self.num_experts)


class Fetcher(Protocol):
    """The executor's side of ``OnDemandExperts`` for one MoE unit."""

    num_experts: int
    group: int  # experts resident at once
    trained: bool  # False: frozen experts (LoRA base): no weight gradient, no push

    def fetch(self, experts: Sequence[int], grad: bool) -> list[tuple[torch.Tensor, dict]]:
        """Gather these experts; ``(flat buffer, tree of views)`` each, the flat a leaf that
        requires grad when ``grad``."""

    def release(self, experts: Sequence[int]) -> None: ...

    def push(self, expert: int, grad_flat: torch.Tensor) -> None:
        """Scatter-accumulate one expert's (padded flat) gradient into its owners."""


class OnDemandExperts:
    """ODC's source: experts gathered when the router has chosen them (see the module doc)."""

    def __init__(self, fetcher: Fetcher, log: Any = None) -> None:
        self.fetcher = fetcher
        self.num_experts = fetcher.num_experts
        self.log = log

    def apply(self, x_NxD: torch.Tensor, idx_NxK: torch.Tensor, w_NxK: torch.Tensor) -> torch.Tensor:
        return _OnDemand.apply(x_NxD, w_NxK, idx_NxK, self.fetcher)


class _OnDemand(torch.autograd.Function):
    """Forward and backward over expert groups; expert weights are never saved for backward
    (only the input, the weights and the indices), so each group is re-gathered there."""

    @staticmethod
    def forward(ctx: Any, x_NxD: torch.Tensor, w_NxK: torch.Tensor, idx_NxK: torch.Tensor,
                fetcher: Fetcher) -> torch.Tensor:
        K = idx_NxK.shape[1]
        order, counts = sort_by_expert(idx_NxK, fetcher.num_experts)
        w_R = w_NxK.reshape(-1)
        y = torch.zeros_like(x_NxD)
        with torch.no_grad():
            for grp in _groups(_segments(counts), fetcher.group):
                got = fetcher.fetch([e for e, _, _ in grp], grad=False)
                for (_, off, c), (_, tree) in zip(grp, got):
                    rows = order[off:off + c]
                    tok = rows // K
                    h = expert_ffn(tree, x_NxD[tok])
                    y.index_add_(0, tok, h * w_R[rows, None].to(h.dtype))
                fetcher.release([e for e, _, _ in grp])
        ctx.save_for_backward(x_NxD, w_NxK, order)
        ctx.counts, ctx.fetcher, ctx.K = counts, fetcher, K
        return y

    @staticmethod
    def backward(ctx: Any, gy_NxD: torch.Tensor) -> tuple:
        x_NxD, w_NxK, order = ctx.saved_tensors
        fetcher, K = ctx.fetcher, ctx.K
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gx = torch.zeros_like(x_NxD) if need_x else None
        gw_R = torch.zeros(w_NxK.numel(), dtype=w_NxK.dtype, device=w_NxK.device)
        w_R = w_NxK.reshape(-1)
        for grp in _groups(_segments(ctx.counts), fetcher.group):
            with torch.enable_grad():  # the tree's views must record their flat (backward runs no-grad)
                got = fetcher.fetch([e for e, _, _ in grp], grad=fetcher.trained)
            for (e, off, c), (flat, tree) in zip(grp, got):
                rows = order[off:off + c]
                tok = rows // K
                with torch.enable_grad():
                    xe = x_NxD[tok].detach().requires_grad_(need_x)
                    h = expert_ffn(tree, xe)
                gy = gy_NxD[tok]
                gw_R[rows] = (gy * h.detach()).sum(-1).to(gw_R.dtype)
                gh = gy * w_R[rows, None].to(gy.dtype)
                inputs = ([flat] if fetcher.trained else []) + ([xe] if need_x else [])
                if not inputs:
                    continue
                grads = torch.autograd.grad(h, inputs, gh)
                if fetcher.trained:
                    fetcher.push(e, grads[0])
                if need_x:
                    gx.index_add_(0, tok, grads[-1])
            fetcher.release([e for e, _, _ in grp])
        return gx, (gw_R.view_as(w_NxK) if need_w else None), None, None
