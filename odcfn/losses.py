"""Per-token losses for the head unit, and their aggregation weights over the whole minibatch.

A loss is a small object with

- ``per_token(logp_T, logits_TxV, extras) -> (loss_T, {metric: value_T})``: the loss of every
  target token (``logp_T``: the log-prob of each target, fp32; ``extras``: the microbatch's
  per-token extras, aligned with its labels),
- ``weights(batch) -> per-sample per-token weights`` from the WHOLE minibatch (the aggregation
  mode), computed before any communication: the minibatch loss is ``sum(weight * loss_T)`` over
  every token, so neither the loss nor its gradient depends on how samples are split into
  microbatches and ranks, and the runtime's one sync is all the communication it needs,
- ``validate(batch)``: the extras it needs, checked on every rank before any communication,
- ``metric_names`` (summed in the same sync; those in ``mean_metrics`` are means over the
  minibatch's loss tokens, the others are aggregated with the loss's weights) and ``temperature``.

``cross_entropy()`` is SFT's loss; ``policy_gradient(...)`` is PPO/GRPO/DAPO's clipped surrogate
with verl's parameter names and semantics. Write your own by subclassing ``TokenLoss``.
The head unit calls ``head_stats`` (fp32 whatever the compute dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from odcfn._check import check_number
from odcfn.batch import Batch, Microbatch

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "CrossEntropy",
    "LogProbs",
    "PolicyGradient",
    "TokenLoss",
    "aggregation_weights",
    "cross_entropy",
    "check_loss",
    "head_stats",
    "loss_metrics",
    "kl_penalty",
    "policy_gradient",
    "token_entropy",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# verl's names; k1/k2/k3 are aliases
KL_TYPES = {"kl": "kl", "k1": "kl", "abs": "abs", "mse": "mse", "k2": "mse",
            "low_var_kl": "low_var_kl", "k3": "low_var_kl"}


def aggregation_weights(
    batch: Batch, loss_agg_mode: str = "token-mean", loss_scale_factor: float | None = None
) -> tuple[torch.Tensor, ...]:
    """Per-token weights (aligned with each sample's tokens, 0 where not a loss token) such that
    ``sum(weight * loss)`` over the minibatch is the ``loss_agg_mode`` aggregate.

    Samples without loss tokens take no part in the ``seq-mean-*`` means.
    """
    _check_mode(loss_agg_mode, loss_scale_factor)
    masks = [
        torch.cat([torch.zeros(1), torch.ones(s.length - 1)]) if s.loss_mask is None
        else torch.cat([torch.zeros(1), s.loss_mask[1:].float()])
        for s in batch.samples
    ]
    counts = [float(m.sum()) for m in masks]
    seqs = sum(c > 0 for c in counts)
    out = []
    for m, n in zip(masks, counts):
        if loss_agg_mode == "token-mean":
            c = 1.0 / batch.num_loss_tokens
        elif loss_agg_mode == "seq-mean-token-mean":
            c = 1.0 / (n * seqs) if n else 0.0
        elif loss_agg_mode == "seq-mean-token-sum":
            c = 1.0 / seqs
        else:
            c = 1.0 / loss_scale_factor
        out.append(m * c)
    return tuple(out)


def _check_mode(mode: str, scale: float | None) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} does not exist; expected one of {list(AGG_MODES)}")
    if mode == "seq-mean-token-sum-norm":
        if scale is None or not (isinstance(scale, (int, float)) and scale > 0):
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor, a constant > 0 "
                f"(Dr. GRPO: e.g. the maximum response length), got {scale!r}"
            )


@dataclass(frozen=True)
class TokenLoss:
    """Base of the built-in losses: the aggregation mode and the shared plumbing."""

    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    temperature: float = 1.0

    metric_names = ()
    mean_metrics = frozenset()

    def __post_init__(self) -> None:
        _check_mode(self.loss_agg_mode, self.loss_scale_factor)
        check_number(self.temperature, "temperature", positive=True, want="> 0 (a finite number)")

    def required_extras(self) -> tuple[str, ...]:
        return ()

    def validate(self, batch: Batch) -> None:
        need = self.required_extras()
        for i, s in enumerate(batch.samples):
            missing = [k for k in need if k not in s.extras]
            if missing:
                raise ValueError(
                    f"{type(self).__name__} needs extras {list(need)}; batch.samples[{i}] lacks "
                    f"{missing} (it has {sorted(s.extras)})"
                )

    def weights(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        return aggregation_weights(batch, self.loss_agg_mode, self.loss_scale_factor)

    def per_token(
        self, logp_T: torch.Tensor, logits_TxV: torch.Tensor, extras: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


@dataclass(frozen=True)
class CrossEntropy(TokenLoss):
    def per_token(self, logp_T, logits_TxV, extras):
        return -logp_T, {}


def cross_entropy(loss_agg_mode: str = "token-mean", loss_scale_factor: float | None = None) -> CrossEntropy:
    """Token cross-entropy (SFT). ``token-mean`` is what ``StepConfig.loss=None`` computes."""
    return CrossEntropy(loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)


def token_entropy(logits_TxV: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's next-token distribution."""
    return torch.logsumexp(logits_TxV, -1) - (logits_TxV.softmax(-1) * logits_TxV).sum(-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy to the reference (verl's estimators and clamps)."""
    kind = KL_TYPES[kind]
    d = logp - ref_logp
    if kind == "kl":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "mse":
        return 0.5 * d.square()
    # k3 (Schulman): exp(-d) + d - 1 >= 0, unbiased with low variance; clamped for stability
    neg = (-d).clamp(-20.0, 20.0)
    return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)


@dataclass(frozen=True)
class PolicyGradient(TokenLoss):
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0

    metric_names = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy")
    mean_metrics = frozenset({"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "kl_loss_coef", "entropy_coeff"):
            # a NaN/inf coefficient would only surface as a NaN loss mid-step
            check_number(getattr(self, name), f"policy_gradient: {name}")
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(
                f"kl_loss_type={self.kl_loss_type!r} does not exist; expected one of {sorted(KL_TYPES)}"
            )
        for name in ("clip_ratio_low", "clip_ratio_high"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {self.clip_ratio_c!r}")

    def required_extras(self) -> tuple[str, ...]:
        return ("advantages", "old_logprobs") + (("ref_logprobs",) if self.kl_loss_coef else ())

    def per_token(self, logp_T, logits_TxV, extras):
        adv, old = extras["advantages"], extras["old_logprobs"]
        log_ratio = (logp_T - old).clamp(-20.0, 20.0)
        ratio = log_ratio.exp()
        surr1 = -adv * ratio
        surr2 = -adv * ratio.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        clipped = torch.maximum(surr1, surr2)
        # dual clip: a negative advantage's loss is bounded by clip_ratio_c * |A|
        bound = -adv * self.clip_ratio_c
        pg_T = torch.where(adv < 0, torch.minimum(bound, clipped), clipped)
        loss_T = pg_T
        with torch.set_grad_enabled(bool(self.entropy_coeff) and torch.is_grad_enabled()):
            entropy_T = token_entropy(logits_TxV)
        if self.entropy_coeff:
            loss_T = loss_T - self.entropy_coeff * entropy_T
        if self.kl_loss_coef:
            kl_T = kl_penalty(logp_T, extras["ref_logprobs"], self.kl_loss_type)
            loss_T = loss_T + self.kl_loss_coef * kl_T
        else:
            kl_T = torch.zeros_like(logp_T)
        metrics = {
            "pg_loss": pg_T,
            "pg_clipfrac": (surr2 > surr1).float(),
            "pg_clipfrac_lower": ((clipped > bound) & (adv < 0)).float(),
            "ppo_kl": -log_ratio,
            "kl_loss": kl_T,
            "entropy": entropy_T,
        }
        return loss_T, metrics


def policy_gradient(
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    entropy_coeff: float = 0.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    temperature: float = 1.0,
) -> PolicyGradient:
    """PPO/GRPO clipped surrogate on ``ratio = exp(logp - old_logprobs)``, dual-clipped for
    negative advantages, plus ``kl_loss_coef`` x KL to ``ref_logprobs`` and minus
    ``entropy_coeff`` x entropy; ``clip_ratio_high > clip_ratio_low`` is DAPO's clip-higher.
    Extras: ``advantages``, ``old_logprobs`` (and ``ref_logprobs`` when ``kl_loss_coef != 0``).
    ``temperature`` divides the logits, as it did when the rollouts were sampled."""
    return PolicyGradient(
        loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, temperature=temperature,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
        kl_loss_coef=kl_loss_coef, kl_loss_type=kl_loss_type, entropy_coeff=entropy_coeff,
    )


@dataclass(frozen=True)
class LogProbs:
    """Not a loss: in its microbatches the head returns per-token ``[logp_T (, entropy_T)]``
    (``odcfn.log_probs``' forward-only pass)."""

    temperature: float = 1.0
    entropy: bool = False

    def __post_init__(self) -> None:
        check_number(self.temperature, "temperature", positive=True, want="> 0 (a finite number)")

    def weights(self, batch: Batch) -> None:
        return None


def check_loss(loss: object) -> object:
    """``loss`` if it has what the runtime calls, else a TypeError naming what it lacks."""
    need = ("validate", "weights", "per_token", "metric_names", "temperature")
    missing = [a for a in need if not hasattr(loss, a)]
    if missing:
        raise TypeError(
            f"StepConfig.loss must be a loss object (odcfn.losses.cross_entropy(), "
            f"policy_gradient(...) or a TokenLoss subclass); {type(loss).__name__} lacks {missing}"
        )
    return loss


def head_stats(logits_TxV: torch.Tensor, mb: Microbatch) -> torch.Tensor:
    """What a head unit returns when its microbatch carries a loss: the fp32 vector
    ``[sum(weight * loss_T), *metric sums]`` (metrics detached; only entry 0 is differentiated),
    or, under ``LogProbs``, the ``[k, T]`` per-token log-probs (and entropies)."""
    loss = mb.loss
    logits = logits_TxV.float() / loss.temperature if loss.temperature != 1.0 else logits_TxV.float()
    logp_T = -F.cross_entropy(logits, mb.labels_T, reduction="none")
    if isinstance(loss, LogProbs):
        return torch.stack([logp_T, token_entropy(logits)] if loss.entropy else [logp_T])
    loss_T, metrics = loss.per_token(logp_T, logits, mb.extras)
    w, m = mb.weight_T, mb.loss_mask_T
    out = [(loss_T * w).sum()]
    for k in loss.metric_names:
        out.append((metrics[k].detach() * (m if k in loss.mean_metrics else w)).sum())
    return torch.stack(out)


def loss_metrics(loss: object, sums: tuple[float, ...], num_loss_tokens: int) -> dict[str, float]:
    """The synced metric sums as figures: ``mean_metrics`` over the loss tokens, the others as
    aggregated (by the loss's weights)."""
    if loss is None:
        return {}
    mean = getattr(loss, "mean_metrics", frozenset())
    return {k: v / num_loss_tokens if k in mean else v for k, v in zip(loss.metric_names, sums)}
