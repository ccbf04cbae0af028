"""Cost models: how long a sample (or a packed microbatch) takes, from its length alone.

A cost model is a frozen, callable dataclass ``cost(length) -> float``; the cost of a packed
microbatch is the sum over its samples (attention never crosses samples, so the quadratic term is
``sum(s_i^2)``, not ``(sum s_i)^2``). Units are whatever the model was built in: tokens, FLOPs, or
seconds after ``odcfn.schedule.measure.calibrate``/``scaled``. Balancers only compare costs, the simulator
reads them as seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "DEFAULT_COST",
    "QWEN25_7B",
    "CostModel",
    "ModelShape",
    "QuadraticCost",
    "TokenCost",
    "fit_quadratic",
    "flops_cost",
    "microbatch_cost",
]


class CostModel(Protocol):
    def __call__(self, length: int) -> float: ...


@dataclass(frozen=True)
class TokenCost:
    """Cost = token count (what verl-style balancers equalise)."""

    def __call__(self, length: int) -> float:
        return float(length)


@dataclass(frozen=True)
class QuadraticCost:
    """Cost = ``a * s^2 + b * s``: attention is quadratic in the sample length, the rest linear."""

    a: float
    b: float

    def __post_init__(self) -> None:
        for name in ("a", "b"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"QuadraticCost.{name} must be a finite float >= 0, got {v!r}")
        if self.a == 0 and self.b == 0:
            raise ValueError("QuadraticCost needs a > 0 or b > 0 (every sample would cost 0)")

    def __call__(self, length: int) -> float:
        s = float(length)
        return self.a * s * s + self.b * s

    def scaled(self, factor: float) -> QuadraticCost:
        """The same shape in other units, e.g. FLOPs -> seconds with ``1 / (peak * MFU)``."""
        if not factor > 0:
            raise ValueError(f"scale factor must be > 0, got {factor!r}")
        return QuadraticCost(self.a * factor, self.b * factor)


def microbatch_cost(cost: CostModel, lengths: Sequence[int]) -> float:
    """Cost of samples packed into one microbatch: the sum of their costs."""
    return sum(cost(n) for n in lengths)


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a decoder that decide its FLOPs (any Qwen/Llama-style config)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    # a mixture of experts: the MLP weights one token multiplies through, summed over the layers
    # (top-k experts, shared expert and router of each sparse layer): its *active* parameters,
    # not its total. None: every layer's dense SwiGLU of ``d_ff``
    active_mlp_params: int | None = None

    @classmethod
    def of(cls, cfg: Any) -> ModelShape:
        """From any config with these attribute names (e.g. ``odcfn.models.QwenConfig``; a
        ``QwenMoeConfig`` also gives ``active_mlp_params``)."""
        try:
            return cls(cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size,
                       getattr(cfg, "active_mlp_params", None))
        except AttributeError as e:
            raise TypeError(f"ModelShape.of: config {type(cfg).__name__} lacks {e.name!r}") from None

    @property
    def matmul_params(self) -> int:
        """Weights every token multiplies through: q/k/v/o, the MLP (a mixture's active
        experts) and the LM head."""
        d, hd = self.d_model, self.d_model // self.n_heads
        attn = d * d + 2 * d * self.n_kv_heads * hd + d * d
        mlp = self.n_layers * 3 * d * self.d_ff if self.active_mlp_params is None else self.active_mlp_params
        return self.n_layers * attn + mlp + d * self.vocab_size


# Qwen2.5-7B (its Hugging Face config.json): the model class of the paper's SFT experiments.
QWEN25_7B = ModelShape(d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, d_ff=18944, vocab_size=152064)


def flops_cost(cfg: Any) -> QuadraticCost:
    """Training FLOPs (forward + backward = 3x forward) of one sample of length ``s``.

    Linear part: ``2 * matmul_params`` FLOPs per token forward. Attention: ``QK^T`` and ``AV``
    cost ``2 * s^2 * d`` each forward per layer, halved by the causal mask.
    """
    m = cfg if isinstance(cfg, ModelShape) else ModelShape.of(cfg)
    return QuadraticCost(a=3.0 * 2.0 * m.d_model * m.n_layers, b=3.0 * 2.0 * m.matmul_params)


# The balancers' default: FLOPs of a 7B-class model, in units of one linear token, so that the
# quadratic term is worth as much as the linear one at s = b / a (~65K tokens).
DEFAULT_COST = QuadraticCost(a=1.0 / (flops_cost(QWEN25_7B).b / flops_cost(QWEN25_7B).a), b=1.0)


def fit_quadratic(lengths: Sequence[int], seconds: Sequence[float]) -> QuadraticCost:
    """Least-squares ``a, b >= 0`` for ``seconds ~ a * s^2 + b * s`` (through the origin)."""
    if len(lengths) != len(seconds):
        raise ValueError(f"fit_quadratic: {len(lengths)} lengths but {len(seconds)} times")
    if len(set(lengths)) < 2:
        raise ValueError("fit_quadratic needs measurements at >= 2 distinct lengths")
    s2 = [float(s) ** 2 for s in lengths]
    s1 = [float(s) for s in lengths]
    # normal equations of the 2-parameter model without intercept
    s4 = sum(x * x for x in s2)
    s3 = sum(x * y for x, y in zip(s2, s1))
    ss = sum(y * y for y in s1)
    ty2 = sum(x * t for x, t in zip(s2, seconds))
    ty1 = sum(y * t for y, t in zip(s1, seconds))
    det = s4 * ss - s3 * s3
    a = (ty2 * ss - ty1 * s3) / det
    b = (s4 * ty1 - s3 * ty2) / det
    if a < 0:  # constrained: the best purely linear fit
        a, b = 0.0, ty1 / ss
    elif b < 0:  # constrained: the best purely quadratic fit
        a, b = ty2 / s4, 0.0
    return QuadraticCost(a, b)
