"""Per-token losses for the head unit, and their aggregation weights over the whole minibatch.

A loss is a small object with

- ``per_token(logp_T, entropy_T, extras) -> (loss_T, {metric: value_T})``: the loss of every
  target token (``logp_T``: the log-prob of each target, fp32; ``entropy_T``: the entropy of each
  position's next-token distribution when ``needs_entropy``, else None; ``extras``: the
  microbatch's per-token extras, aligned with its labels),
- ``weights(batch) -> per-sample per-token weights`` from the WHOLE minibatch (the aggregation
  mode), computed before any communication: the minibatch loss is ``sum(weight * loss_T)`` over
  every token, so neither the loss nor its gradient depends on how samples are split into
  microbatches and ranks, and the runtime's one sync is all the communication it needs,
- ``validate(batch)``: the extras it needs, checked on every rank before any communication,
- ``metric_names`` (summed in the same sync; those in ``mean_metrics`` are means over the
  minibatch's loss tokens, the others are aggregated with the loss's weights) and ``temperature``.

The head computes ``logp_T`` and ``entropy_T`` with the fused head (``odcfn.kernels.fused_head``:
never a T×V tensor; temperature applied inside), so losses never see logits. A loss that truly
needs them sets ``needs_logits = True`` and receives ``per_token(..., logits_TxV=...)``: the full
fp32 logits of the microbatch, O(T×V) memory (``head="unfused"`` computes every loss that way,
the reference the fused head is measured against).

``cross_entropy()`` is SFT's loss; ``policy_gradient(...)`` is PPO/GRPO/DAPO's clipped surrogate
with verl's parameter names and semantics. Write your own by subclassing ``TokenLoss``.
The head unit calls ``head_stats`` (fp32 whatever the compute dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from odcfn._check import check_number
from odcfn.batch import Batch, Microbatch
from odcfn.kernels.fused_head import IGNORE, fused_head, unfused_head
from odcfn.losses.head import check_head as _check_head

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
    """Base of the built-in losses: the aggregation mode, the head settings and the plumbing.

    ``head``: "fused" (never a T×V tensor) or "unfused" (full fp32 logits, the reference);
    ``token_chunk``/``vocab_chunk``: the fused head's tile (None: chosen from the shapes).
    ``needs_entropy``: whether ``per_token`` receives entropies (SFT's loss does not pay for
    them); ``needs_logits``: whether it receives the full logits (O(T×V) memory)."""

    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    temperature: float = 1.0
    head: str = "fused"
    token_chunk: int | None = None
    vocab_chunk: int | None = None

    metric_names = ()
    mean_metrics = frozenset()
    needs_entropy = False
    needs_logits = False

    def __post_init__(self) -> None:
        _check_mode(self.loss_agg_mode, self.loss_scale_factor)
        _check_head(self)

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
            for k in need:  # per target token: only 1-D float extras are aligned with labels_T
                v = s.extras[k]
                if v.dim() != 1 or not v.is_floating_point():
                    raise TypeError(
                        f"{type(self).__name__} reads extras[{k!r}] per target token: it must be a "
                        f"1-D float tensor, batch.samples[{i}] has shape {tuple(v.shape)} and "
                        f"dtype {v.dtype}"
                    )

    def weights(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        return aggregation_weights(batch, self.loss_agg_mode, self.loss_scale_factor)

    def per_token(
        self, logp_T: torch.Tensor, entropy_T: torch.Tensor | None, extras: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


@dataclass(frozen=True)
class CrossEntropy(TokenLoss):
    def per_token(self, logp_T, entropy_T, extras):
        return -logp_T, {}


def cross_entropy(
    loss_agg_mode: str = "token-mean", loss_scale_factor: float | None = None, **head: object
) -> CrossEntropy:
    """Token cross-entropy (SFT), the default ``StepConfig.loss``. ``head``: the head settings
    of ``TokenLoss`` (``temperature``, ``head``, ``token_chunk``, ``vocab_chunk``)."""
    return CrossEntropy(loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, **head)


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
    # the decoupled objective for off-policy rollouts (asynchronous RL; docs/rl.md): the clipped
    # ratio is taken against ``prox_logprobs`` (the proximal policy), and each token's loss is
    # weighted by the constant behaviour importance weight exp(prox - old_logprobs), set to 0
    # where it exceeds ``behav_imp_weight_cap``
    decoupled: bool = False
    behav_imp_weight_cap: float | None = None

    metric_names = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy")
    mean_metrics = frozenset({"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"})
    needs_entropy = True  # the entropy bonus, and the "entropy" figure even without one

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
        if not isinstance(self.decoupled, bool):
            raise TypeError(f"policy_gradient: decoupled must be a bool, got {self.decoupled!r}")
        cap = self.behav_imp_weight_cap
        if cap is not None:
            check_number(cap, "policy_gradient: behav_imp_weight_cap")
            if not self.decoupled or not cap > 0:
                raise ValueError(
                    f"policy_gradient: behav_imp_weight_cap={cap!r} needs decoupled=True and a value > 0 "
                    "(it caps the weight exp(prox_logprobs - old_logprobs))"
                )

    def required_extras(self) -> tuple[str, ...]:
        return (("advantages", "old_logprobs") + (("prox_logprobs",) if self.decoupled else ())
                + (("ref_logprobs",) if self.kl_loss_coef else ()))

    def per_token(self, logp_T, entropy_T, extras):
        adv, old = extras["advantages"], extras["old_logprobs"]
        anchor = extras["prox_logprobs"] if self.decoupled else old
        log_ratio = (logp_T - anchor).clamp(-20.0, 20.0)
        ratio = log_ratio.exp()
        surr1 = -adv * ratio
        surr2 = -adv * ratio.clamp(1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        clipped = torch.maximum(surr1, surr2)
        # dual clip: a negative advantage's loss is bounded by clip_ratio_c * |A|
        bound = -adv * self.clip_ratio_c
        pg_T = torch.where(adv < 0, torch.minimum(bound, clipped), clipped)
        if self.decoupled:  # a constant per token: no gradient flows through the weight
            w_T = (anchor - old).clamp(-20.0, 20.0).exp()
            if self.behav_imp_weight_cap is not None:
                w_T = torch.where(w_T <= self.behav_imp_weight_cap, w_T, torch.zeros_like(w_T))
            pg_T = pg_T * w_T
        if "rollout_is_weights" in extras:  # truncated importance sampling against the engine's
            pg_T = pg_T * extras["rollout_is_weights"]  # numerics (odcfn.rl: rollout_is_threshold)
        loss_T = pg_T
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
            "entropy": entropy_T.detach(),  # a figure: only the bonus above is differentiated
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
    decoupled: bool = False,
    behav_imp_weight_cap: float | None = None,
    **head: object,
) -> PolicyGradient:
    """PPO/GRPO clipped surrogate on ``ratio = exp(logp - old_logprobs)``, dual-clipped for
    negative advantages, plus ``kl_loss_coef`` x KL to ``ref_logprobs`` and minus
    ``entropy_coeff`` x entropy; ``clip_ratio_high > clip_ratio_low`` is DAPO's clip-higher.
    Extras: ``advantages``, ``old_logprobs`` (and ``ref_logprobs`` when ``kl_loss_coef != 0``).
    ``temperature`` divides the logits, as it did when the rollouts were sampled; ``head``:
    ``head``/``token_chunk``/``vocab_chunk`` as in ``TokenLoss``. ``decoupled``: the decoupled
    objective for stale rollouts: the ratio against the ``prox_logprobs`` extra, each token's
    surrogate weighted by ``exp(prox_logprobs - old_logprobs)`` (0 above ``behav_imp_weight_cap``)."""
    return PolicyGradient(
        decoupled=decoupled, behav_imp_weight_cap=behav_imp_weight_cap,
        loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor, temperature=temperature,
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
        kl_loss_coef=kl_loss_coef, kl_loss_type=kl_loss_type, entropy_coeff=entropy_coeff, **head,
    )


@dataclass(frozen=True)
class LogProbs:
    """Not a loss: in its microbatches the head returns per-token ``[logp_T (, entropy_T)]``
    (``odcfn.log_probs``' forward-only pass; position ``t`` holds the log-prob of label ``t``,
    the sample's token ``t + 1``, and 0 after each sample's last token)."""

    temperature: float = 1.0
    entropy: bool = False
    head: str = "fused"
    token_chunk: int | None = None
    vocab_chunk: int | None = None

    def __post_init__(self) -> None:
        _check_head(self)

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


def _head(loss: object, h_TxD: torch.Tensor, w_VxD: torch.Tensor, labels_T: torch.Tensor,
          entropy: bool, logits: bool = False):
    """``(logp_T, entropy_T or None, logits_TxV or None)`` by the loss's head settings."""
    t = getattr(loss, "temperature", 1.0)
    if logits or getattr(loss, "head", "fused") == "unfused":
        return unfused_head(h_TxD, w_VxD, labels_T, temperature=t, entropy=entropy, logits=logits)
    tc, vc = getattr(loss, "token_chunk", None), getattr(loss, "vocab_chunk", None)
    out = fused_head(h_TxD, w_VxD, labels_T, temperature=t, entropy=entropy, token_chunk=tc, vocab_chunk=vc)
    return (*out, None) if entropy else (out, None, None)


def head_stats(h_TxD: torch.Tensor, w_VxD: torch.Tensor, mb: Microbatch) -> torch.Tensor:
    """What a head unit returns, from its final hidden states ``h_TxD`` and head weight ``w_VxD``
    (logits ``h Wᵀ / temperature``, never materialised unless the loss asks for them):

    - under a loss object, the fp32 vector ``[sum(weight * loss_T), *metric sums]`` (metrics
      detached; only entry 0 is differentiated); only loss tokens are targets,
    - under ``LogProbs``, the ``[k, T]`` per-token log-probs (and entropies) of every label
      inside a sample (0 after each sample's last token),
    - without a loss (``mb.loss`` None: a bare ``pack``, the model's own contract), the summed
      cross-entropy of the loss tokens."""
    loss = mb.loss
    if isinstance(loss, LogProbs):
        labels_T = mb.labels_T.clone()
        labels_T[torch.tensor(mb.seqlens, device=labels_T.device).cumsum(0) - 1] = IGNORE
        logp_T, ent_T, _ = _head(loss, h_TxD, w_VxD, labels_T, loss.entropy)
        return torch.stack([logp_T, ent_T] if loss.entropy else [logp_T])
    labels_T = mb.labels_T.masked_fill(mb.loss_mask_T == 0, IGNORE)
    if loss is None:
        return -_head(None, h_TxD, w_VxD, labels_T, False)[0].sum()
    want_logits = bool(getattr(loss, "needs_logits", False))
    logp_T, ent_T, logits = _head(loss, h_TxD, w_VxD, labels_T, bool(getattr(loss, "needs_entropy", False)),
                                  want_logits)
    if hasattr(loss, "microbatch_stats"):  # a sequence-level loss (DPO): sums per sample first
        return loss.microbatch_stats(logp_T, mb)
    kw = {"logits_TxV": logits} if want_logits else {}
    loss_T, metrics = loss.per_token(logp_T, ent_T, mb.extras, **kw)
    w, m = mb.weight_T, mb.loss_mask_T
    out = [(loss_T * w).sum()]
    for k in loss.metric_names:
        out.append((metrics[k].detach() * (m if k in loss.mean_metrics else w)).sum())
    return torch.stack(out)


def loss_metrics(loss: object, sums: tuple[float, ...], num_loss_tokens: int) -> dict[str, float]:
    """The synced metric sums as figures: ``mean_metrics`` over the loss tokens, the others as
    aggregated (by the loss's weights)."""
    mean = getattr(loss, "mean_metrics", frozenset())
    return {k: v / num_loss_tokens if k in mean else v for k, v in zip(loss.metric_names, sums)}
