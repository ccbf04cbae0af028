"""Functional optimizers over flat parameter shards (init/update, like optax).

Each rank updates only the shards it owns. The update matches ``torch.optim.AdamW``/``SGD``
term for term, so torch FSDP2 with those optimizers is a valid reference.

Weight decay can skip leaves (``weight_decay_mask``): a predicate on leaf names
(``"layers.0.self_attn.q_proj.bias"``; True = decayed) or a named default from ``DECAY_MASKS``.
The optimizer sees only flat shards, so a masked one is bound to the flat layout
(``optimizer.for_layout(layout)``, which ``train_step`` does): the mask becomes ranges of this
rank's shard, and the update leaves those ranges undecayed.

Updates are pure (new tensors out, the inputs untouched; ``inplace=True``, which a donated
state asks for, writes into the inputs instead) and walk each shard in spans of
``SPAN`` elements, writing into the preallocated outputs: the temporaries of the update's
expression are O(span), not O(shard). A vocabulary-sized shard (151,936 x 4,096 at fp32 is
2.3 GiB) would otherwise hold several shard-sized temporaries at once. Every op is elementwise,
so the result is bit-identical to the whole-shard expression.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from odcfn.sharding.layout import Layout

__all__ = ["DECAY_MASKS", "SPAN", "Optimizer", "adamw", "clip_scale", "decay_ranges", "sgd"]

Shards = Mapping[str, torch.Tensor]
LR = float | Callable[[int], float]
DecayMask = Callable[[str], bool] | str | None
SPAN = 1 << 20  # elements per span of the update: 4 MiB of fp32 per temporary

# Hugging Face Trainer's rule: no decay on biases and on norm weights (LayerNorm/RMSNorm, q/k norms)
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def _no_norms_biases(name: str) -> bool:
    return _NO_DECAY.search(name.lower()) is None


def _no_norms_biases_embeddings(name: str) -> bool:
    return _no_norms_biases(name) and "embed_tokens" not in name


DECAY_MASKS: dict[str, Callable[[str], bool]] = {
    "all": lambda name: True,
    "no_norms_biases": _no_norms_biases,
    "no_norms_biases_embeddings": _no_norms_biases_embeddings,
}


@dataclass(frozen=True)
class Optimizer:
    init: Callable[[Shards], dict[str, Any]]
    update: Callable[..., tuple[dict[str, torch.Tensor], dict[str, Any]]]
    name: str = ""
    bind: Callable[[Layout], Optimizer] | None = None  # set when the update needs the layout
    inplace: bool = False  # update(..., inplace=True) writes into its inputs (a donated state)

    def for_layout(self, layout: Layout) -> Optimizer:
        """This optimizer for shards of ``layout`` (itself unless it has a decay mask)."""
        return self if self.bind is None else self.bind(layout)


def _mask_fn(mask: DecayMask) -> Callable[[str], bool] | None:
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask not in DECAY_MASKS:
            raise ValueError(f"weight_decay_mask={mask!r} is not a named mask; known: {sorted(DECAY_MASKS)}")
        return DECAY_MASKS[mask]
    if not callable(mask):
        raise TypeError(
            f"weight_decay_mask must be a predicate on leaf names or a name in {sorted(DECAY_MASKS)}, "
            f"got {type(mask).__name__}"
        )
    return mask


def decay_ranges(layout: Layout, decayed: Callable[[str], bool]) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per unit, the ``[a, b)`` ranges of THIS rank's shard holding leaves that are NOT decayed.

    A leaf ``unit.path`` spans ``[off, off + numel)`` of the unit's flat padded vector; the rank's
    shard is ``shard_range(shard_index)`` of it, so the ranges are the overlaps, shifted to the
    shard's own coordinates. Padding belongs to no leaf: it is zero and stays zero either way.
    """
    out = {}
    for u in layout.units:
        lo, hi = u.shard_range(layout.mesh.shard_index)
        keep, off = [], 0
        for path, n in zip(u.paths, u.numels):
            name = f"{u.name}.{path}"
            flag = decayed(name)
            if not isinstance(flag, bool):
                raise TypeError(f"weight_decay_mask({name!r}) returned {flag!r}, expected a bool")
            a, b = max(lo, off), min(hi, off + n)
            if not flag and a < b:
                if keep and keep[-1][1] == a - lo:  # adjacent undecayed leaves: one range
                    keep[-1] = (keep[-1][0], b - lo)
                else:
                    keep.append((a - lo, b - lo))
            off += n
        out[u.name] = tuple(keep)
    return out


def _spans(n: int) -> list[tuple[int, int]]:
    return [(a, min(a + SPAN, n)) for a in range(0, n, SPAN)] or [(0, 0)]


def _out(like: torch.Tensor, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Where an update writes and its flat view: ``like`` itself when updating in place (a
    donated state) and it is contiguous, else a new tensor shaped like it."""
    if inplace and like.is_contiguous():
        return like, like.view(-1)
    t = torch.empty_like(like, memory_format=torch.contiguous_format)
    return t, t.view(-1)


def _within(keep: tuple[tuple[int, int], ...], lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    """The ``keep`` ranges that overlap ``[lo, hi)``, in that span's own coordinates."""
    return tuple((max(a, lo) - lo, min(b, hi) - lo) for a, b in keep if max(a, lo) < min(b, hi))


def _decayed(p: torch.Tensor, factor: float, keep: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``p * factor`` except on the ``keep`` ranges, which stay ``p`` (bit for bit)."""
    q = p * factor
    for a, b in keep:
        q[a:b] = p[a:b]
    return q


def _masked(make: Callable[..., Optimizer], mask: DecayMask, weight_decay: float) -> Optimizer:
    """``make(keep=None)`` when nothing is masked, else an optimizer that must be bound first."""
    fn = _mask_fn(mask)
    if fn is None or not weight_decay:
        return make(keep=None)

    def bind(layout: Layout) -> Optimizer:
        return replace(make(keep=decay_ranges(layout, fn)), bind=bind)

    def unbound(*args, **kwargs):
        raise ValueError(
            "this optimizer has a weight_decay_mask, which needs the flat layout: use "
            "optimizer.for_layout(make_layout(model, mesh)) (train_step does this for you)"
        )

    return replace(make(keep=None), update=unbound, bind=bind)


def _lr(lr: LR, step: int) -> float:
    return float(lr(step)) if callable(lr) else float(lr)


def clip_scale(grad_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"gradient norm is {grad_norm}; refusing to step")
    return min(1.0, max_norm / (grad_norm + 1e-6))


def sgd(
    lr: LR, *, momentum: float = 0.0, weight_decay: float = 0.0, weight_decay_mask: DecayMask = None
) -> Optimizer:
    """SGD as ``torch.optim.SGD`` (decay added to the gradient, then momentum)."""

    def make(keep):
        def init(params: Shards) -> dict[str, Any]:
            state: dict[str, Any] = {"count": 0}
            if momentum:
                state["mu"] = {k: torch.zeros_like(v) for k, v in params.items()}
            return state

        def update(grads: Shards, state: dict, params: Shards, *, grad_scale: float = 1.0,
                   inplace: bool = False):
            step = state["count"] + 1
            rate = _lr(lr, step)
            new_p, new_mu = {}, {}
            for k, p_all in params.items():
                new_p[k], p_out = _out(p_all, inplace)
                if momentum:
                    new_mu[k], mu_out = _out(state["mu"][k], inplace)
                p_in, g_in = p_all.reshape(-1), grads[k].reshape(-1)
                for lo, hi in _spans(p_in.numel()):
                    p = p_in[lo:hi]
                    g = g_in[lo:hi].to(p.dtype) * grad_scale
                    if weight_decay:
                        wd_p = weight_decay * p
                        for a, b in _within((keep or {}).get(k, ()), lo, hi):
                            wd_p[a:b] = 0
                        g = g + wd_p
                    if momentum:
                        mu = g if step == 1 else momentum * state["mu"][k].reshape(-1)[lo:hi] + g
                        mu_out[lo:hi], g = mu, mu
                    p_out[lo:hi] = p - rate * g
            new_state: dict[str, Any] = {"count": step}
            if momentum:
                new_state["mu"] = new_mu
            return new_p, new_state

        return Optimizer(init, update, "sgd", inplace=True)

    return _masked(make, weight_decay_mask, weight_decay)


def adamw(
    lr: LR,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    weight_decay_mask: DecayMask = None,
) -> Optimizer:
    """AdamW as ``torch.optim.AdamW``; ``weight_decay_mask`` as a per-leaf ``weight_decay=0`` group."""

    def make(keep):
        def init(params: Shards) -> dict[str, Any]:
            return {
                "count": 0,
                "mu": {k: torch.zeros_like(v) for k, v in params.items()},
                "nu": {k: torch.zeros_like(v) for k, v in params.items()},
            }

        def update(grads: Shards, state: dict, params: Shards, *, grad_scale: float = 1.0,
                   inplace: bool = False):
            step = state["count"] + 1
            rate = _lr(lr, step)
            bc1, bc2 = 1 - b1**step, 1 - b2**step
            new_p, mu, nu = {}, {}, {}
            for k, p_all in params.items():
                (new_p[k], p_out), (mu[k], mu_out), (nu[k], nu_out) = (
                    _out(t, inplace) for t in (p_all, state["mu"][k], state["nu"][k]))
                p_in, g_in = p_all.reshape(-1), grads[k].reshape(-1)
                mu_in, nu_in = state["mu"][k].reshape(-1), state["nu"][k].reshape(-1)
                for lo, hi in _spans(p_in.numel()):
                    p = p_in[lo:hi]
                    g = g_in[lo:hi].to(p.dtype) * grad_scale
                    m = torch.lerp(mu_in[lo:hi], g, 1 - b1, out=mu_out[lo:hi])
                    v = torch.add(nu_in[lo:hi] * b2, (1 - b2) * g * g, out=nu_out[lo:hi])
                    denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
                    keep_k = _within((keep or {}).get(k, ()), lo, hi)
                    decayed = _decayed(p, 1 - rate * weight_decay, keep_k)
                    torch.sub(decayed, (rate / bc1) * m / denom, out=p_out[lo:hi])
            return new_p, {"count": step, "mu": mu, "nu": nu}

        return Optimizer(init, update, "adamw", inplace=True)

    return _masked(make, weight_decay_mask, weight_decay)
