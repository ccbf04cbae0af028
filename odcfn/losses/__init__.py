"""The losses: per-token losses (cross-entropy, policy gradient) and their aggregation
(``tokens.py``), the DPO-family preference losses (``preference.py``), and the head settings every
loss carries (``head.py``). Re-exports only: ``odcfn.losses.cross_entropy``, ``.dpo``, ...."""

from odcfn.losses.preference import DPO, DPO_LOSS_TYPES, dpo
from odcfn.losses.tokens import (
    AGG_MODES,
    KL_TYPES,
    CrossEntropy,
    LogProbs,
    PolicyGradient,
    TokenLoss,
    aggregation_weights,
    check_loss,
    cross_entropy,
    head_stats,
    kl_penalty,
    loss_metrics,
    policy_gradient,
)

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "DPO",
    "DPO_LOSS_TYPES",
    "CrossEntropy",
    "LogProbs",
    "PolicyGradient",
    "TokenLoss",
    "aggregation_weights",
    "cross_entropy",
    "dpo",
    "check_loss",
    "head_stats",
    "loss_metrics",
    "kl_penalty",
    "policy_gradient",
]
