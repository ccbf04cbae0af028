"""Functional optimizers over flat parameter shards (init/update, like optax).

Each rank updates only the shards it owns. The update matches ``torch.optim.AdamW``/``SGD``
term for term, so torch FSDP2 with those optimizers is a valid reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Optimizer", "adamw", "clip_scale", "sgd"]

Shards = Mapping[str, torch.Tensor]
LR = float | Callable[[int], float]


@dataclass(frozen=True)
class Optimizer:
    init: Callable[[Shards], dict[str, Any]]
    update: Callable[..., tuple[dict[str, torch.Tensor], dict[str, Any]]]
    name: str = ""


def _lr(lr: LR, step: int) -> float:
    return float(lr(step)) if callable(lr) else float(lr)


def clip_scale(grad_norm: float, max_norm: float | None) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6))."""
    if max_norm is None:
        return 1.0
    if not math.isfinite(grad_norm):
        raise FloatingPointError(f"gradient norm is {grad_norm}; refusing to step")
    return min(1.0, max_norm / (grad_norm + 1e-6))


def sgd(lr: LR, *, momentum: float = 0.0, weight_decay: float = 0.0) -> Optimizer:
    def init(params: Shards) -> dict[str, Any]:
        state: dict[str, Any] = {"count": 0}
        if momentum:
            state["mu"] = {k: torch.zeros_like(v) for k, v in params.items()}
        return state

    def update(grads: Shards, state: dict, params: Shards, *, grad_scale: float = 1.0):
        step = state["count"] + 1
        rate = _lr(lr, step)
        new_p, new_mu = {}, {}
        for k, p in params.items():
            g = grads[k].to(p.dtype) * grad_scale
            if weight_decay:
                g = g + weight_decay * p
            if momentum:
                mu = g if step == 1 else momentum * state["mu"][k] + g
                new_mu[k], g = mu, mu
            new_p[k] = p - rate * g
        new_state: dict[str, Any] = {"count": step}
        if momentum:
            new_state["mu"] = new_mu
        return new_p, new_state

    return Optimizer(init, update, "sgd")


def adamw(
    lr: LR, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.01
) -> Optimizer:
    def init(params: Shards) -> dict[str, Any]:
        return {
            "count": 0,
            "mu": {k: torch.zeros_like(v) for k, v in params.items()},
            "nu": {k: torch.zeros_like(v) for k, v in params.items()},
        }

    def update(grads: Shards, state: dict, params: Shards, *, grad_scale: float = 1.0):
        step = state["count"] + 1
        rate = _lr(lr, step)
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        new_p, mu, nu = {}, {}, {}
        for k, p in params.items():
            g = grads[k].to(p.dtype) * grad_scale
            mu[k] = torch.lerp(state["mu"][k], g, 1 - b1)
            nu[k] = state["nu"][k] * b2 + (1 - b2) * g * g
            denom = (nu[k].sqrt() / math.sqrt(bc2)).add_(eps)
            new_p[k] = p * (1 - rate * weight_decay) - (rate / bc1) * mu[k] / denom
        return new_p, {"count": step, "mu": mu, "nu": nu}

    return Optimizer(init, update, "adamw")
