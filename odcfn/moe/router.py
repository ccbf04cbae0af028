"""Top-k routing, routing replay, and the per-microbatch router log (aux loss, loads, routing
record).

The auxiliary load-balancing loss is transformers' ``load_balancing_loss_func`` computed per
sequence: for sequence s with T_s tokens and L MoE layers (N_s = L * T_s rows),

    aux_s = E * sum_e (A_se / N_s) * (B_se / N_s)

where A_se counts the (token, slot) top-k choices of expert e over every layer and B_se sums the
router's softmax probability of e. The minibatch adds ``coef * mean_s aux_s`` to its loss: a
per-sequence term, so it does not depend on microbatches, ranks or the balancer. A is not
differentiable, so dL/dp[l, t, e] = coef / S * E / N_s^2 * A_se: layer l's backward needs the
counts of *every* layer of its sequences, which the log holds once the microbatch's forward is
over (``_AuxGrad`` adds it to the probabilities' gradient). Every token counts (prompt and masked
tokens too), as in transformers without an attention mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ROUTED_EXTRA", "RouterLog", "RouterSpec", "check_routing", "route", "update_bias"]

ROUTED_EXTRA = "routed_experts"  # Sample.extras key of routing replay: (T, MoE layers, top-k) ints


@dataclass(frozen=True)
class RouterSpec:
    """What a runtime needs to know of a model's routers: how many sparse layers and experts,
    and the aux loss's coefficient (0: none; transformers adds it when
    ``output_router_logits``)."""

    num_layers: int
    num_experts: int
    top_k: int
    aux_coef: float = 0.0

    def log(self, seqlens: Sequence[int], num_sequences: int, *, graph: bool = False,
            bias: torch.Tensor | None = None) -> RouterLog:
        """A microbatch's log; ``num_sequences``: the minibatch's (the aux loss's mean).
        ``graph``: ``aux_loss()`` is a differentiable tensor (one autograd graph over every
        layer: the single-process reference) instead of gradients added layer by layer.
        ``bias``: aux-loss-free balancing's per-expert bias, sparse layers x E (``update_bias``)."""
        return RouterLog(seqlens, self.num_layers, self.num_experts, self.aux_coef / max(1, num_sequences),
                         graph=graph, bias=bias)


def update_bias(bias_LxE: torch.Tensor, loads_LxE: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing's step: each sparse layer's bias moves by ``rate`` toward
    its under-loaded experts (``sign(mean load - load)``), centred so it stays zero-mean (a
    constant shift changes no top-k choice). ``loads``: the minibatch's tokens per expert, the
    same on every rank after the one sync, so every rank computes the same new bias."""
    loads = loads_LxE.to(bias_LxE.device, torch.float64)
    delta = torch.sign(loads.mean(-1, keepdim=True) - loads)
    delta = delta - delta.mean(-1, keepdim=True)
    return bias_LxE + (rate * delta).to(bias_LxE.dtype)


def check_routing(batch: Any, spec: RouterSpec | None) -> None:
    """Routing replay's ``extras["routed_experts"]``: every sample's must be an integer tensor of
    shape (T, MoE layers, top-k) with distinct experts in ``[0, E)`` per row (a ValueError or
    TypeError naming the sample, before any communication, on every rank alike)."""
    if not batch.samples or ROUTED_EXTRA not in batch.samples[0].extras:
        return
    if spec is None:
        raise ValueError(f"batch samples carry extras[{ROUTED_EXTRA!r}] but the model has no experts")
    want = (spec.num_layers, spec.top_k)
    for i, s in enumerate(batch.samples):
        r = s.extras[ROUTED_EXTRA]
        where = f"batch sample {i}: extras[{ROUTED_EXTRA!r}]"
        if r.dtype.is_floating_point or r.dtype == torch.bool:
            raise TypeError(f"{where} must be an integer tensor, got {r.dtype}")
        if tuple(r.shape) != (s.length, *want):
            raise ValueError(f"{where} has shape {tuple(r.shape)}, expected (tokens, MoE layers, top-k) = "
                             f"{(s.length, *want)}")
        bad = (r < 0) | (r >= spec.num_experts)
        if bool(bad.any()):
            t, layer, k = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{where}[{t}, {layer}, {k}] = {int(r[t, layer, k])} is outside the "
                             f"{spec.num_experts} experts [0, {spec.num_experts})")
        if spec.top_k > 1:
            srt = r.sort(dim=-1).values
            dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
            if bool(dup.any()):
                t, layer = (int(x) for x in dup.nonzero()[0])
                raise ValueError(f"{where}[{t}, {layer}] repeats an expert: {r[t, layer].tolist()} "
                                 "(a token's top-k experts are distinct)")


class RouterLog:
    """One microbatch's routing across its MoE layers (shared by the layers' expert sources).

    ``aux_scale``: ``router_aux_loss_coef / S`` with S the minibatch's sequence count (0: no
    aux loss). ``recorded``: layer -> the expert indices its forward chose, reused by a
    rematerialised forward so that it never re-routes differently.
    """

    def __init__(self, seqlens: Sequence[int], num_layers: int, num_experts: int, aux_scale: float = 0.0,
                 *, graph: bool = False, bias: torch.Tensor | None = None):
        self.graph, self.bias = graph, bias
        self.seqlens = tuple(int(s) for s in seqlens)
        self.num_layers, self.num_experts, self.aux_scale = num_layers, num_experts, float(aux_scale)
        self.counts: dict[int, torch.Tensor] = {}  # layer -> S x E top-k choices (aux)
        self.probs: dict[int, torch.Tensor] = {}  # layer -> S x E summed probabilities (aux)
        self.loads: dict[int, torch.Tensor] = {}  # layer -> E tokens routed (the indices used)
        self.recorded: dict[int, torch.Tensor] = {}

    def seq_of_token(self, device: torch.device) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(len(self.seqlens), device=device),
                                       torch.tensor(self.seqlens, device=device))

    def note(self, layer: int, probs_TxE: torch.Tensor, k: int, used_TxK: torch.Tensor) -> torch.Tensor:
        """Record layer ``layer``'s routing; returns the probabilities with the aux loss's
        gradient attached (when there is an aux loss)."""
        E = self.num_experts
        self.loads[layer] = torch.bincount(used_TxK.reshape(-1), minlength=E).double().cpu()
        if not self.aux_scale:
            return probs_TxE
        with torch.no_grad():
            seq_T = self.seq_of_token(probs_TxE.device)
            top_TxK = torch.topk(probs_TxE, k, dim=-1).indices
            onehot = torch.zeros_like(probs_TxE, dtype=torch.float64).scatter_add_(
                1, top_TxK, torch.ones_like(top_TxK, dtype=torch.float64))
            S = len(self.seqlens)
            self.counts[layer] = torch.zeros(S, E, dtype=torch.float64, device=probs_TxE.device).index_add_(
                0, seq_T, onehot)
        zeros = torch.zeros(S, E, dtype=torch.float64, device=probs_TxE.device)
        if self.graph:
            self.probs[layer] = zeros.index_add(0, seq_T, probs_TxE.double())
            return probs_TxE
        self.probs[layer] = zeros.index_add_(0, seq_T, probs_TxE.detach().double())
        return _AuxGrad.apply(probs_TxE, self)

    def _coef_S(self, device: torch.device) -> torch.Tensor:
        """Per sequence: ``aux_scale * E / N_s^2``."""
        n = torch.tensor(self.seqlens, dtype=torch.float64, device=device) * self.num_layers
        return self.aux_scale * self.num_experts / n.square()

    def aux_grad(self, device: torch.device) -> torch.Tensor:
        """dL/dp per token (T x E): ``coef_s * A_se`` of the token's sequence."""
        A = sum(self.counts.values())
        return (self._coef_S(device)[:, None] * A)[self.seq_of_token(device)]

    def aux_loss(self) -> torch.Tensor:
        """This microbatch's share of the minibatch loss, ``sum_s coef/S * aux_s`` (float64;
        differentiable when the log keeps a ``graph``)."""
        if not self.aux_scale or not self.counts:
            return torch.zeros((), dtype=torch.float64)
        A, B = sum(self.counts.values()), sum(self.probs.values())
        return (self._coef_S(A.device) * (A * B).sum(-1)).sum()

    def remember(self, layer: int, idx_TxK: torch.Tensor) -> torch.Tensor:
        """The indices of this layer's first forward (a rematerialised forward reuses them)."""
        return self.recorded.setdefault(layer, idx_TxK)


class _AuxGrad(torch.autograd.Function):
    """Identity on the probabilities; backward adds the aux loss's gradient (module doc)."""

    @staticmethod
    def forward(ctx: Any, probs_TxE: torch.Tensor, log: RouterLog) -> torch.Tensor:
        ctx.log = log
        return probs_TxE.view_as(probs_TxE)

    @staticmethod
    def backward(ctx: Any, g_TxE: torch.Tensor) -> tuple:
        return g_TxE + ctx.log.aux_grad(g_TxE.device).to(g_TxE.dtype), None


def route(
    logits_TxE: torch.Tensor, k: int, *, norm_topk_prob: bool, layer: int, log: RouterLog | None,
    replay_TxK: torch.Tensor | None = None, bias_E: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx_TxK, w_TxK)``: transformers' Qwen-MoE routing (softmax in fp32, top-k,
    optionally renormalised over the k, cast back to the logits' dtype).

    ``replay_TxK``: the experts a rollout engine chose (routing replay): used as they are, the
    weights being the router's probabilities at those indices, so the router still learns.
    ``bias_E``: aux-loss-free balancing's per-expert bias, added to the scores for the choice
    only (never to the weights). A rematerialised forward reuses the first forward's indices.
    """
    probs_TxE = torch.softmax(logits_TxE, dim=-1, dtype=torch.float32)
    if replay_TxK is not None:
        idx = replay_TxK.to(device=logits_TxE.device, dtype=torch.long)
    else:
        with torch.no_grad():
            scores = probs_TxE if bias_E is None else probs_TxE + bias_E.to(probs_TxE)
            idx = torch.topk(scores, k, dim=-1).indices
    if log is not None:
        idx = log.remember(layer, idx)
        probs_TxE = log.note(layer, probs_TxE, k, idx)
    w = probs_TxE.gather(1, idx)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return idx, w.to(logits_TxE.dtype)
