"""Routed expert compute: tokens sorted by expert, experts taken from an *expert source* a
group at a time, each group's experts computed over their sorted rows at once: two
``torch._grouped_mm`` calls (gate/up, then down) where that kernel serves (CPU, fp32/bf16, rows
of 16-byte multiples), else one matmul chain per expert over its slice of the rows. Either way
the rows are gathered once and the weighted outputs added into the tokens once per group.

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

__all__ = [
    "ExpertSource",
    "Fetcher",
    "LocalExperts",
    "OnDemandExperts",
    "expert_ffn",
    "ffn_rows",
    "routed_ffn",
    "sort_by_expert",
]


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
    return [segs[i : i + group] for i in range(0, len(segs), group)]


def _grouped_ok(x_RxD: torch.Tensor, inner: int) -> bool:
    """Whether ``torch._grouped_mm`` serves these rows: its CPU kernel (the CUDA one is not tried on
    hardware yet), fp32 or bf16, and every row of x, the activations and the weights a multiple of
    16 bytes (the kernel refuses other strides)."""
    if not hasattr(torch, "_grouped_mm") or x_RxD.device.type != "cpu":
        return False
    if x_RxD.dtype not in (torch.float32, torch.bfloat16):
        return False
    n = 16 // x_RxD.element_size()
    return x_RxD.shape[1] % n == 0 and inner % n == 0


def ffn_rows(
    xs_RxD: torch.Tensor, trees: Sequence[dict], counts: Sequence[int], scale_R: torch.Tensor | None = None
) -> torch.Tensor:
    """SwiGLU of consecutive row blocks: rows ``[sum(counts[:i]), sum(counts[:i+1]))`` through
    expert ``trees[i]`` (every count > 0), each row's output times ``scale_R[r]`` (its routing
    weight). The scale multiplies the activations before the down projection: the same product,
    on I values per row instead of D. Differentiable in the rows, the trees and the scale."""
    inner = trees[0]["gate_proj"]["weight"].shape[0]
    if not _grouped_ok(xs_RxD, inner):
        outs, off = [], 0
        for tree, c in zip(trees, counts):
            x = xs_RxD[off : off + c]
            a = F.silu(F.linear(x, tree["gate_proj"]["weight"])) * F.linear(x, tree["up_proj"]["weight"])
            if scale_R is not None:
                a = a * scale_R[off : off + c, None]
            outs.append(F.linear(a, tree["down_proj"]["weight"]))
            off += c
        return outs[0] if len(outs) == 1 else torch.cat(outs)
    # G x D x 2I and G x I x D as transposed views of stacked (out, in) weights: what the kernel
    # takes without another copy (measured on CPU: no slower than contiguous)
    gate_up = torch.stack([torch.cat([t["gate_proj"]["weight"], t["up_proj"]["weight"]]) for t in trees])
    down = torch.stack([t["down_proj"]["weight"] for t in trees])
    offs = torch.tensor(counts, device=xs_RxD.device).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(xs_RxD, gate_up.transpose(1, 2), offs=offs)
    a = F.silu(h[:, :inner]) * h[:, inner:]
    if scale_R is not None:
        a = a * scale_R[:, None]
    return torch._grouped_mm(a, down.transpose(1, 2), offs=offs)


def routed_ffn(
    x_NxD: torch.Tensor,
    idx_NxK: torch.Tensor,
    w_NxK: torch.Tensor,
    experts: Callable[[int], dict],
    num_experts: int,
) -> torch.Tensor:
    """``sum_k w[n, k] * expert_{idx[n, k]}(x[n])`` with plain autograd, experts by index."""
    K = idx_NxK.shape[1]
    order, counts = sort_by_expert(idx_NxK, num_experts)
    segs = _segments(counts)  # every row belongs to one used expert: the segments tile ``order``
    if not segs:  # no tokens
        return torch.zeros_like(x_NxD)
    tok = order // K
    h = ffn_rows(
        x_NxD[tok],
        [experts(e) for e, _, _ in segs],
        [c for _, _, c in segs],
        w_NxK.reshape(-1)[order].to(x_NxD.dtype),
    )
    return torch.zeros_like(x_NxD).index_add_(0, tok, h)  # a fresh tensor: in place is safe


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
    def forward(
        ctx: Any, x_NxD: torch.Tensor, w_NxK: torch.Tensor, idx_NxK: torch.Tensor, fetcher: Fetcher
    ) -> torch.Tensor:
        K = idx_NxK.shape[1]
        order, counts = sort_by_expert(idx_NxK, fetcher.num_experts)
        w_R = w_NxK.reshape(-1)
        y = torch.zeros_like(x_NxD)
        with torch.no_grad():
            for grp in _groups(_segments(counts), fetcher.group):
                got = fetcher.fetch([e for e, _, _ in grp], grad=False)
                rows = order[grp[0][1] : grp[-1][1] + grp[-1][2]]  # the group's rows: consecutive
                tok = rows // K
                trees = [tree for _, tree in got]
                counts_g = [c for _, _, c in grp]
                y.index_add_(0, tok, ffn_rows(x_NxD[tok], trees, counts_g, w_R[rows].to(y.dtype)))
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
                rows = order[grp[0][1] : grp[-1][1] + grp[-1][2]]
                tok = rows // K
                xe = x_NxD[tok].detach().requires_grad_(need_x)
                se = w_R[rows].detach().to(x_NxD.dtype).requires_grad_(need_w)
                h = ffn_rows(xe, [tree for _, tree in got], [c for _, _, c in grp], se)
            flats = [flat for flat, _ in got] if fetcher.trained else []
            inputs = flats + ([xe] if need_x else []) + ([se] if need_w else [])
            if inputs:
                grads = list(torch.autograd.grad(h, inputs, gy_NxD[tok]))
                if need_w:
                    gw_R[rows] = grads.pop().to(gw_R.dtype)
                if need_x:
                    gx.index_add_(0, tok, grads.pop())
                for (e, _, _), g in zip(grp, grads):  # pushed as the group completes
                    fetcher.push(e, g)
            fetcher.release([e for e, _, _ in grp])
        return gx, (gw_R.view_as(w_NxK) if need_w else None), None, None
