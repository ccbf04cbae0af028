"""One RL iteration in research code: ``state, metrics = odcfn.rl.step(state, engine, prompts, config)``.

1. generate: each rank samples ``group_size`` completions for its share of the prompts and
   scores them, then every rank receives every completion (``odcfn.rl.exchange``);
2. rewards (with DAPO's overlong penalty), dynamic sampling, advantages (``odcfn.rl.advantages``);
3. ``old_logprobs`` with ``odcfn.log_probs`` (or the engine's), ``ref_logprobs`` when the loss
   has a KL term (a LoRA policy's reference is its base: ``odcfn.lora_reference``), and
   ``prox_logprobs`` in asynchronous mode;
4. ``ppo_epochs`` x ``ppo_mini_batches`` calls of ``odcfn.train_step``;
5. the weights go to the engine (``engine.update_weights``).

Asynchronous mode (``RLConfig.async_rollouts``): the caller passes the next iteration's prompts
as ``next_prompts``; their generation starts, with the weights the engine has, before this
iteration's update and runs beside it, and the next call collects it. Those rollouts are one
update behind the state that trains on them: the decoupled objective takes the ratio against
``prox_logprobs`` (the state's own) and weights each token by ``exp(prox - behaviour)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from odcfn.batch import Batch, Sample
from odcfn.data.prompt import Prompt
from odcfn.rewards import resolve as resolve_reward
from odcfn.rewards import score
from odcfn.rl import metrics as rl_metrics
from odcfn.rl.advantages import advantages as compute_advantages
from odcfn.rl.config import RLConfig
from odcfn.rl.exchange import Local, Shared, share, share_range
from odcfn.rollout.base import Completion, Engine, SamplingParams
from odcfn.step import fingerprint
from odcfn.step.logprobs import log_probs
from odcfn.step.state import StepMetrics, TrainState
from odcfn.step.train import train_step

__all__ = ["RLMetrics", "step"]

RLMetrics = rl_metrics.RLMetrics
_WHAT = ("the prompts / RL config", "the trainer step")


def step(
    state: TrainState, engine: Engine, prompts: Sequence[Prompt], config: RLConfig,
    ref_state: TrainState | None = None, *, next_prompts: Sequence[Prompt] | None = None,
) -> tuple[TrainState, RLMetrics]:
    """One RL iteration (module docstring). Every rank calls it with the same ``prompts`` and
    ``config`` (checked: ranks that disagree all raise the same error before anyone trains) and
    its own engine. Returns the new state and the iteration's metrics (verl's names in
    ``metrics.extra``)."""
    t_step = time.perf_counter()
    _check(state, engine, prompts, config, ref_state, next_prompts)
    reward_fn = resolve_reward(config.reward)
    mesh = state.mesh
    W, rank, n = mesh.world_size, mesh.rank, config.group_size
    timing: dict[str, float] = {}

    # 1. generate my share (or collect what the last iteration started), score it, share it
    t = time.perf_counter()
    mine_range = share_range(len(prompts), W, rank)
    key = _key(prompts)
    error, local = None, []
    try:
        if config.async_rollouts and engine.in_flight is not None:
            completions = engine.collect(key)
        else:
            completions = engine.generate([list(prompts[i].tokens) for i in mine_range],
                                          _sampling(config, state.step), first_index=mine_range.start)
        if config.async_rollouts and next_prompts is not None:
            nxt = share_range(len(next_prompts), W, rank)
            engine.submit([list(next_prompts[i].tokens) for i in nxt], _sampling(config, state.step + 1),
                          key=_key(next_prompts), first_index=nxt.start)
        timing["gen_local"] = time.perf_counter() - t
        local = _score(reward_fn, prompts, mine_range, completions, n)
    except Exception as e:  # joins the exchange anyway: every rank raises it, none waits
        error = f"{type(e).__name__}: {e}"
    total = len(prompts) * n
    # every rank must run the same iteration: the prompts, the config and the step ride the
    # exchange's first sum (the train_step fingerprint would catch it only after generation)
    request = (_prompt_words(prompts), fingerprint.stable_repr(config))
    words = fingerprint.gather_words(request, f"step={state.step}")
    detail = [f"{len(prompts)} prompts, {fingerprint.stable_repr(config)[:200]}", f"step={state.step}"]

    def agree(summed: torch.Tensor) -> None:
        fingerprint.check_agreement(summed, W, words, detail, what=_WHAT, subject="RL iteration",
                                    call="odcfn.rl.step")

    shared = share(state.transport.sync, W, rank, total, local, error, fingerprint.encode(words),
                   [len(prompts[i // n]) for i in range(total)], agree)
    timing["gen"] = time.perf_counter() - t

    # 2. rewards -> advantages, over the groups that carry a signal
    rewards = torch.tensor([s.reward for s in shared], dtype=torch.float64)
    penalties = _overlong(shared, config)
    rewards = rewards + penalties
    keep = _keep_groups(rewards, n, config.dynamic_sampling)
    rows = [g * n + j for g in keep for j in range(n)]
    extra = rl_metrics.rollout_metrics(prompts, shared, rewards, penalties, config, state.step, W)
    extra["rollout/dropped_groups"] = float(len(prompts) - len(keep))
    updates: list[StepMetrics] = []
    if rows:
        t = time.perf_counter()
        lengths = [shared[i].tokens.numel() for i in rows]
        adv = compute_advantages(rewards[rows].float(), n, config.estimator,
                                 norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo,
                                 response_lengths=torch.tensor(lengths))
        timing["adv"] = time.perf_counter() - t
        extra.update(rl_metrics.summary("critic/advantages", adv))
        samples = _samples(prompts, shared, rows, adv, config, state)
        if not samples:
            rows = []
    if rows:
        # 3. log-probs: old (behaviour), ref (KL), prox (decoupled)
        full = Batch(tuple(Sample(s.tokens, extras=_routing(s)) for s in samples))
        T = config.sampling.temperature or 1.0
        per_sample: dict[str, list[torch.Tensor]] = {"advantages": [s.extras["advantages"] for s in samples]}
        engine_lp = [s.extras["rollout_logprobs"] for s in samples]
        if config.use_rollout_logprobs or config.async_rollouts:
            per_sample["old_logprobs"] = engine_lp
        if not config.use_rollout_logprobs or config.async_rollouts:
            t = time.perf_counter()
            mine = list(log_probs(state, full, temperature=T))
            timing["old_log_prob"] = time.perf_counter() - t
            per_sample["prox_logprobs" if config.async_rollouts else "old_logprobs"] = mine
            extra.update(rl_metrics.logprob_diff(mine, engine_lp, samples))
        if config.rollout_is_threshold is not None:
            per_sample["rollout_is_weights"] = [
                (o - e).clamp(-20, 20).exp().clamp(max=config.rollout_is_threshold) * (s.loss_mask.float())
                for o, e, s in zip(per_sample["old_logprobs"], engine_lp, samples)]
        if config.needs_ref:
            t = time.perf_counter()
            ref = ref_state if ref_state is not None else _lora_reference(state)
            per_sample["ref_logprobs"] = list(log_probs(ref, full, temperature=T))
            timing["ref"] = time.perf_counter() - t
        train = [Sample(s.tokens, loss_mask=s.loss_mask,
                        extras={**{k: v[i] for k, v in per_sample.items()}, **_routing(s)})
                 for i, s in enumerate(samples)]
        # 4. the updates
        t = time.perf_counter()
        state, updates = _update(state, train, n, config)
        timing["update_actor"] = time.perf_counter() - t
    # 5. weights to the engine (after the generation running beside the update has finished)
    t = time.perf_counter()
    engine.wait()
    if updates:
        engine.update_weights(state)
    timing["weight_sync"] = time.perf_counter() - t
    timing["step"] = time.perf_counter() - t_step
    extra.update(rl_metrics.update_metrics(updates))
    extra.update({f"timing_s/{k}": v for k, v in timing.items()})
    extra["perf/throughput"] = extra["perf/total_num_tokens"] / timing["step"] / W
    return state, RLMetrics(extra=extra, updates=tuple(updates), rewards=rewards.float())


def _check(state: Any, engine: Any, prompts: Any, config: Any, ref_state: Any, next_prompts: Any) -> None:
    if not isinstance(state, TrainState):
        raise TypeError(f"odcfn.rl.step: state must be an odcfn.TrainState, got {type(state).__name__}")
    if not isinstance(engine, Engine):
        raise TypeError(f"odcfn.rl.step: engine must be an odcfn.rollout engine, got {type(engine).__name__}")
    if not isinstance(config, RLConfig):
        raise TypeError(f"odcfn.rl.step: config must be an odcfn.rl.RLConfig, got {type(config).__name__}")
    for name, ps in (("prompts", prompts), ("next_prompts", next_prompts)):
        if ps is None and name == "next_prompts":
            continue
        if isinstance(ps, (str, bytes)) or not isinstance(ps, Sequence) or not ps:
            raise ValueError(f"odcfn.rl.step: {name} must be a non-empty list of odcfn.rl.Prompt")
        for i, p in enumerate(ps):
            if not isinstance(p, Prompt):
                raise TypeError(f"odcfn.rl.step: {name}[{i}] is {type(p).__name__}, expected odcfn.rl.Prompt")
            if len(p) >= engine.max_model_len:
                raise ValueError(f"odcfn.rl.step: {name}[{i}] has {len(p)} tokens; the engine's maximum "
                                 f"length is {engine.max_model_len} (prompt + at least one new token)")
            if max(p.tokens) >= state.model.vocab_size:
                raise ValueError(f"odcfn.rl.step: {name}[{i}] holds token id {max(p.tokens)}, outside the "
                                 f"model's vocabulary [0, {state.model.vocab_size})")
    if next_prompts is not None and not config.async_rollouts:
        raise ValueError(
            "odcfn.rl.step: next_prompts is for asynchronous mode (RLConfig.async_rollouts=True)"
        )
    if config.needs_ref and ref_state is None and not _is_lora(state):
        raise ValueError("odcfn.rl.step: the loss has a KL term (kl_loss_coef > 0) but no ref_state was "
                         "given "
                         "(a LoRA policy's reference is its base; others pass the reference's TrainState)")


def _is_lora(state: TrainState) -> bool:
    from odcfn.lora import adapter_units  # the LoRA wing sits beside the loop, not below the step

    return bool(adapter_units(state.model))


def _lora_reference(state: TrainState) -> TrainState:
    from odcfn.preference.lora import lora_reference

    return lora_reference(state)


def _sampling(config: RLConfig, step: int) -> SamplingParams:
    """The iteration's sampling: ``n`` = group size; the seed a function of (seed, step) when the
    config gives none, so a resumed run draws what the uninterrupted one would have (each
    share passes its first prompt's position, so draws do not depend on the number of ranks)."""
    s = config.sampling
    seed = s.seed if s.seed is not None else (config.seed * 1_000_003 + step * 7_919) % (1 << 31)
    return replace(s, n=config.group_size, seed=seed)


def _key(prompts: Sequence[Prompt]) -> str:
    """What a background generation is for: the prompts' token ids."""
    return fingerprint.stable_repr(_prompt_words(prompts))


def _prompt_words(prompts: Sequence[Prompt]) -> tuple:
    return tuple(p.tokens for p in prompts)


def _score(reward_fn: Any, prompts: Sequence[Prompt], mine: range, completions: list[Completion],
           n: int) -> list[Local]:
    want = len(mine) * n
    if len(completions) != want:
        raise RuntimeError(
            f"the engine returned {len(completions)} completions for {len(mine)} prompts x n={n}"
        )
    rewards = score(reward_fn, prompts, completions, first_completion=mine.start * n,
                    prompt_indices=[mine.start + c.prompt_index for c in completions])
    return [Local(index=mine.start * n + k, tokens=c.tokens, logprobs=c.logprobs,
                  stopped=c.finish_reason == "stop", reward=float(r), version=c.version,
                  routed=None if c.routed_experts is None else c.routed_experts)
            for k, (c, r) in enumerate(zip(completions, rewards))]


def _overlong(shared: list[Shared], config: RLConfig) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_tokens - buffer``, then linear to
    ``-overlong_penalty_factor`` at ``max_tokens``."""
    out = torch.zeros(len(shared), dtype=torch.float64)
    buf = config.overlong_buffer_len
    if buf:
        expected = config.sampling.max_tokens - buf
        for i, s in enumerate(shared):
            over = s.tokens.numel() - expected
            out[i] = min(-over / buf * config.overlong_penalty_factor, 0.0)
    return out


def _keep_groups(rewards: torch.Tensor, n: int, dynamic: bool) -> list[int]:
    groups = rewards.view(-1, n)
    if not dynamic:
        return list(range(groups.shape[0]))
    # DAPO: a group whose rewards are all equal has zero advantage everywhere: no signal
    return [g for g in range(groups.shape[0]) if bool((groups[g] != groups[g][0]).any())]


def _samples(prompts: Sequence[Prompt], shared: list[Shared], rows: list[int], adv: torch.Tensor,
             config: RLConfig, state: TrainState) -> list[Sample]:
    """Prompt + response as one sample: the loss on the response tokens, the advantage broadcast
    over them, the engine's log-probs aligned like every per-token extra (``[t]`` for token t)."""
    n, out = config.group_size, []
    for a, i in zip(adv.tolist(), rows):
        s, p = shared[i], prompts[i // n].tokens
        P, R = len(p), s.tokens.numel()
        tokens = torch.cat([torch.tensor(p, dtype=torch.long), s.tokens])
        mask = torch.zeros(P + R, dtype=torch.bool)
        if not (config.mask_truncated and not s.stopped):
            mask[P:] = True
        if not bool(mask.any()):
            continue
        adv_T = torch.zeros(P + R)
        adv_T[P:] = a
        lp_T = torch.zeros(P + R)
        lp_T[P:] = s.logprobs
        extras = {"advantages": adv_T, "rollout_logprobs": lp_T}
        if s.routed is not None and state.model.router is not None:
            spec = state.model.router
            extras["routed_experts"] = s.routed.view(P + R, spec.num_layers, spec.top_k)
        out.append(Sample(tokens, loss_mask=mask, extras=extras))
    return out


def _routing(s: Sample) -> dict[str, torch.Tensor]:
    r = s.extras.get("routed_experts")
    return {} if r is None else {"routed_experts": r}


def _update(state: TrainState, samples: list[Sample], n: int, config: RLConfig) -> tuple[TrainState, list]:
    """``ppo_epochs`` passes over the rollouts, each split into ``ppo_mini_batches`` minibatches
    of whole groups (fewer when there are fewer groups), in rollout order."""
    k = min(config.ppo_mini_batches, len(samples))
    bounds = [round(i * len(samples) / k) for i in range(k + 1)]
    updates = []
    for _ in range(config.ppo_epochs):
        for lo, hi in zip(bounds, bounds[1:]):
            chunk = samples[lo:hi]
            if not any(bool(s.loss_mask[1:].any()) for s in chunk):
                continue
            state, m = train_step(state, Batch(tuple(chunk)))
            updates.append(m)
    return state, updates
