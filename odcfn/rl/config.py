"""``RLConfig``: what one RL iteration does, every field checked when the config is built.

Names follow verl where verl has one (``ppo_epochs``, ``norm_adv_by_std_in_grpo``,
``rollout_is_threshold``, DAPO's ``overlong_buffer_len`` / ``overlong_penalty_factor``), so a
verl user can read a config without a glossary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from odcfn._check import check_int, check_number
from odcfn.losses import PolicyGradient, policy_gradient
from odcfn.rl.advantages import ESTIMATORS, GROUP_ESTIMATORS
from odcfn.rollout.base import SamplingParams

__all__ = ["RLConfig"]



@dataclass(frozen=True)
class RLConfig:
    """One RL iteration: ``group_size`` completions per prompt sampled with ``sampling``, scored
    by ``reward``, turned into advantages by ``estimator``, trained with ``loss`` for
    ``ppo_epochs`` x ``ppo_mini_batches`` ``train_step`` calls, then synced to the engine.

    - ``reward``: ``fn(prompt, completion) -> float`` (``odcfn.rewards``), or its name as
      ``"module:function"``.
    - ``sampling``: its ``n`` is replaced by ``group_size``; a ``seed`` of None derives one per
      iteration from ``seed`` and the trainer step, so a resumed run draws what it would have.
    - ``use_rollout_logprobs``: take ``old_logprobs`` from the engine instead of recomputing
      them with ``odcfn.log_probs`` (saves a forward pass; engine and trainer numerics differ on
      GPUs). ``rollout_is_threshold``: truncated importance sampling, each token's surrogate
      weighted by ``min(exp(old_logprobs - engine logprobs), threshold)``.
    - ``dynamic_sampling``: DAPO's filter, groups whose rewards are all equal are dropped (they
      carry no GRPO signal); ``metrics.extra["rollout/dropped_groups"]`` counts them.
    - ``overlong_buffer_len`` > 0: DAPO's soft overlong penalty, a response longer than
      ``max_tokens - overlong_buffer_len`` loses up to ``overlong_penalty_factor`` linearly.
      ``mask_truncated``: responses cut by ``max_tokens`` train no token (overlong filtering).
    - ``async_rollouts``: one-step asynchronous mode. Generation of the next prompts (passed as
      ``odcfn.rl.step(..., next_prompts=...)``) overlaps this update; such rollouts are one
      version behind, so the loss must be ``policy_gradient(decoupled=True)`` and
      ``max_version_lag`` bounds how many trainer versions behind a rollout may be.
    """

    reward: Callable[..., Any] | str
    group_size: int = 4
    estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=64))
    loss: PolicyGradient = field(default_factory=policy_gradient)
    ppo_epochs: int = 1
    ppo_mini_batches: int = 1
    use_rollout_logprobs: bool = False
    rollout_is_threshold: float | None = None
    dynamic_sampling: bool = False
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = False
    async_rollouts: bool = False
    max_version_lag: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if not (callable(self.reward) or isinstance(self.reward, str)):
            raise TypeError(
                f"RLConfig.reward must be a callable or a 'module:function' string, got {self.reward!r}"
            )
        check_int(self.group_size, "RLConfig.group_size", at_least=1)
        if self.estimator not in ESTIMATORS:
            raise ValueError(
                f"RLConfig.estimator={self.estimator!r} is unknown; expected one of {list(ESTIMATORS)}"
            )
        if self.estimator in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(
                f"RLConfig.group_size={self.group_size}: the {self.estimator!r} estimator needs a group "
                "of at least 2 completions per prompt (n >= 2) for its baseline"
            )
        for name in ("norm_adv_by_std_in_grpo", "use_rollout_logprobs", "dynamic_sampling", "mask_truncated",
                     "async_rollouts"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RLConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(
                f"RLConfig.sampling must be an odcfn.rollout.SamplingParams, got {self.sampling!r}"
            )
        if not isinstance(self.loss, PolicyGradient):
            raise TypeError(
                f"RLConfig.loss must be an odcfn.losses.policy_gradient(...), got {type(self.loss).__name__}"
            )
        want_t = self.sampling.temperature or 1.0  # greedy rollouts: log-probs at temperature 1
        if self.loss.temperature != want_t:
            raise ValueError(
                f"RLConfig.loss.temperature={self.loss.temperature} differs from the sampling temperature "
                f"{want_t}: the ratio must compare log-probs of the distribution the tokens were drawn from"
            )
        check_int(self.ppo_epochs, "RLConfig.ppo_epochs", at_least=1)
        check_int(self.ppo_mini_batches, "RLConfig.ppo_mini_batches", at_least=1)
        check_number(self.rollout_is_threshold, "RLConfig.rollout_is_threshold", positive=True, none_ok=True)
        check_int(self.overlong_buffer_len, "RLConfig.overlong_buffer_len", at_least=0)
        if self.overlong_buffer_len >= self.sampling.max_tokens:
            raise ValueError(
                f"RLConfig.overlong_buffer_len={self.overlong_buffer_len} must be below sampling.max_tokens="
                f"{self.sampling.max_tokens}"
            )
        check_number(self.overlong_penalty_factor, "RLConfig.overlong_penalty_factor", at_least=0.0)
        check_int(self.max_version_lag, "RLConfig.max_version_lag", at_least=1)
        check_int(self.seed, "RLConfig.seed")
        if self.async_rollouts and not self.loss.decoupled:
            raise ValueError(
                "RLConfig.async_rollouts: rollouts one version behind need the decoupled objective, "
                "loss=odcfn.losses.policy_gradient(decoupled=True, ...)"
            )
        if self.loss.decoupled and not self.async_rollouts:
            raise ValueError(
                "RLConfig.loss is decoupled (prox_logprobs) but async_rollouts is off: synchronous "
                "rollouts are on-policy, use policy_gradient(decoupled=False)"
            )

    @property
    def needs_ref(self) -> bool:
        return bool(self.loss.kl_loss_coef)
