"""``odcfn.rl.step``: one RL iteration equals the same pieces composed by hand (the engine's
completions, the rewards, verl's advantages, ``odcfn.log_probs`` and ``train_step``), ranks that
disagree fail alike before anyone trains, a failing reward is an error on every rank, and a tiny
model learns a task it starts at chance on (1/16: say token 5 first), synchronously and in
one-step asynchronous mode."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn import rl
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.rollout import LocalEngine, SamplingParams

CFG = QwenConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64)


def copy_reward(prompt, completion) -> float:
    """1 when the first new token repeats the prompt's last token (chance: 1 / 16)."""
    return float(int(completion.tokens[0]) == prompt.tokens[-1])


def target_reward(prompt, completion) -> float:
    """1 when the first new token is 5 (chance: 1 / 16)."""
    return float(int(completion.tokens[0]) == 5)


def prompts_at(it: int, k: int = 8) -> list[rl.Prompt]:
    g = torch.Generator().manual_seed(1000 + it)
    out = []
    for _ in range(k):
        n = int(torch.randint(2, 6, (), generator=g))
        out.append(rl.Prompt(torch.randint(1, CFG.vocab_size, (n,), generator=g).tolist()))
    return out


def _state(tr, lr=1e-3, loss=None, cap=None):
    model = qwen_model(CFG)
    return odcfn.TrainState.create(
        params=init_params(CFG, seed=3), model=model, optimizer=odcfn.adamw(lr, weight_decay=0.0),
        transport=tr, config=odcfn.StepConfig(balance="lb_mini", loss=loss or odcfn.losses.policy_gradient(),
                                              max_tokens_per_microbatch=cap))


def _engine(state):
    engine = LocalEngine(state.model, CFG)
    engine.update_weights(state)
    return engine


def test_the_loop_equals_its_pieces_composed_by_hand():
    sampling = SamplingParams(max_tokens=3, temperature=1.0, seed=11)
    config = rl.RLConfig(reward=copy_reward, group_size=4, sampling=sampling, ppo_mini_batches=2)
    prompts = prompts_at(0, k=6)

    def worker(rank, tr):
        state = _state(tr)
        with _engine(state) as engine:
            new, m = rl.step(state, engine, prompts, config)
            # by hand, from the same weights: one generate over every prompt (the loop shares the
            # prompts among ranks, seeds following each prompt's global position)
            with _engine(state) as e2:
                comps = e2.generate([list(p.tokens) for p in prompts], sampling.__class__(
                    **{**sampling.__dict__, "n": 4}))
            rewards = torch.tensor([copy_reward(prompts[i // 4], c) for i, c in enumerate(comps)])
            adv = rl.advantages(rewards, 4, "grpo")
            samples = []
            for i, c in enumerate(comps):
                p = torch.tensor(prompts[i // 4].tokens)
                toks = torch.cat([p, c.tokens])
                mask = torch.arange(len(toks)) >= len(p)
                samples.append((toks, mask, float(adv[i])))
            batch = odcfn.Batch(tuple(odcfn.Sample(t, loss_mask=mk) for t, mk, _ in samples))
            old = odcfn.log_probs(state, batch)
            hand = state
            for half in (samples[:12], old[:12]), (samples[12:], old[12:]):
                b = odcfn.Batch(tuple(odcfn.Sample(t, loss_mask=mk, extras={
                    "advantages": torch.where(mk, a, 0.0), "old_logprobs": o})
                    for (t, mk, a), o in zip(*half)))
                hand, _ = odcfn.train_step(hand, b)
            clone = lambda p: {k: v.clone() for k, v in p.items()}
            return m, clone(new.params), clone(hand.params)

    for m, got, want in odcfn.run_local(worker, world_size=2):
        assert m.extra["actor/num_updates"] == 2
        odcfn.tree_assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # fp32 sums in another order


def test_ranks_with_different_prompts_fail_alike_before_training():
    config = rl.RLConfig(reward=copy_reward, group_size=2, sampling=SamplingParams(max_tokens=2, seed=0))

    def worker(rank, tr):
        state = _state(tr)
        with _engine(state) as engine:
            with pytest.raises(ValueError, match="ranks disagree on the RL iteration") as e:
                rl.step(state, engine, prompts_at(rank), config)
            return str(e.value).split("(this rank")[0]

    a, b = odcfn.run_local(worker, world_size=2)
    assert a == b


def test_a_failing_reward_is_an_error_on_every_rank_naming_prompt_and_completion():
    def bad(prompt, completion):
        return float("nan") if prompt.tokens == prompts_at(0)[5].tokens else 0.0

    config = rl.RLConfig(reward=bad, group_size=2, sampling=SamplingParams(max_tokens=2, seed=0))

    def worker(rank, tr):
        state = _state(tr)
        with _engine(state) as engine:
            with pytest.raises(ValueError, match=r"returned nan for completion 1[01] \(of prompt 5\)") as e:
                rl.step(state, engine, prompts_at(0), config)
            return str(e.value)

    on_3, on_other = odcfn.run_local(worker, world_size=2)  # prompts 4-7 (and 5) are rank 1's
    assert on_3.split(" (raised on")[0] == on_other.split(" (raised on")[0]
    assert "raised on rank 1" in on_3 and "raised on this rank" in on_other


def _learn(config, iters, world_size=2):
    def worker(rank, tr):
        # a rank's 32 samples (at most 7 tokens) in one microbatch: one sample per microbatch spends
        # most of the CPU on per-microbatch overhead
        state = _state(tr, lr=1e-2, loss=config.loss, cap=256)
        scores = []
        with _engine(state) as engine:
            for it in range(iters):
                nxt = prompts_at(it + 1) if config.async_rollouts and it + 1 < iters else None
                state, m = rl.step(state, engine, prompts_at(it), config, next_prompts=nxt)
                scores.append(m.extra["critic/score/mean"])
        return scores

    return odcfn.run_local(worker, world_size=world_size, timeout=300)[0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_tiny_model_learns_a_task_it_starts_at_chance_on(mode):
    asynchronous = mode == "async"
    loss = odcfn.losses.policy_gradient(decoupled=asynchronous, clip_ratio_high=0.28)
    config = rl.RLConfig(reward=target_reward, group_size=8, loss=loss, async_rollouts=asynchronous,
                         sampling=SamplingParams(max_tokens=2, temperature=1.0))
    scores = _learn(config, iters=15)
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert first < 0.25, scores  # at chance (1/16) before training
    assert last > first + 0.3, scores


def test_moe_rollouts_replay_their_routing_and_lora_takes_its_base_as_reference():
    """A mixture of experts: the trainer's old log-probs (routing replayed from the engine's
    record) equal the engine's; LoRA with a KL term and no ref_state: its reference is the base,
    so the first update's KL is 0 (the adapters start at B = 0)."""
    from odcfn.models import QwenMoeConfig

    moe = QwenMoeConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=48,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    sampling = SamplingParams(max_tokens=3, seed=5)

    def worker(rank, tr):
        model = qwen_model(moe)
        state = odcfn.TrainState.create(params=init_params(moe, seed=1), model=model,
                                        optimizer=odcfn.adamw(1e-3), transport=tr,
                                        config=odcfn.StepConfig(loss=odcfn.losses.policy_gradient()))
        out = []
        with LocalEngine(model, moe) as engine:
            engine.update_weights(state)
            for it in range(2):
                state, m = rl.step(state, engine, prompts_at(it, k=4),
                                   rl.RLConfig(reward=target_reward, group_size=2, sampling=sampling))
                out.append(m.extra["rollout/logprob_diff/max"])
        lora_model, lora_params = odcfn.lora.apply(qwen_model(CFG), init_params(CFG, seed=3), rank=2, alpha=4)
        kl_loss = odcfn.losses.policy_gradient(kl_loss_coef=0.1)
        lstate = odcfn.TrainState.create(params=lora_params, model=lora_model, optimizer=odcfn.adamw(1e-2),
                                         transport=tr, config=odcfn.StepConfig(loss=kl_loss))
        kls = []
        with LocalEngine(lora_model, CFG) as engine:
            engine.update_weights(lstate)
            for it in range(2):
                lstate, m = rl.step(lstate, engine, prompts_at(it, k=4), rl.RLConfig(
                    reward=target_reward, group_size=2, sampling=sampling, loss=kl_loss))
                kls.append(m.extra["actor/kl_loss"])
        return out, kls

    for diffs, kls in odcfn.run_local(worker, world_size=2):
        assert max(diffs) < 1e-4, diffs
        assert abs(kls[0]) < 1e-9 and kls[1] > 0, kls  # the base is the reference; one step moves off it
