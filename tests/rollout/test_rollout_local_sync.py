"""``LocalEngine`` against the trainer on 2 ranks: its log-probs are ``odcfn.log_probs``'s (dense
and MoE, several temperatures), a MoE completion's routing replays to the same log-probs, and
after each ``train_step`` + ``update_weights`` the engine scores fixed sequences as the trainer
does (full fine-tuning, LoRA, MoE with aux-loss-free balancing's bias)."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.rollout import LocalEngine, SamplingParams
from tests.rollout.rollout_util import CONFIGS, DENSE, MOE, QWEN3, prompts, qwen_model, sharp_params

ATOL = 1e-5


def _state(model, params, transport, **config):
    return odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(3e-2),
                                   transport=transport, config=odcfn.StepConfig(**config))


def _batch(ps, outs, routed=False) -> odcfn.Batch:
    samples = []
    for c in outs:
        toks = torch.tensor(ps[c.prompt_index] + c.tokens.tolist())
        extras = {"routed_experts": c.routed_experts} if routed else None
        samples.append(odcfn.Sample(toks, extras=extras))
    return odcfn.Batch(tuple(samples))


def _diff(ps, outs, lps) -> float:
    """max |engine - trainer| over every completion token."""
    return max(float((c.logprobs - lp[len(ps[c.prompt_index]):]).abs().max()) for c, lp in zip(outs, lps))


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_engine_logprobs_equal_log_probs_and_routing_replays(name):
    cfg = CONFIGS[name]
    model, params = qwen_model(cfg), sharp_params(cfg, 10)
    ps = prompts(cfg.vocab_size, [5, 2, 8], seed=10)

    def worker(rank, transport):
        state = _state(model, params, transport)
        eng = LocalEngine(model, cfg)
        eng.update_weights(state)
        out = {}
        for T in (1.0, 0.6, 0.0):  # greedy reports log-probs at temperature 1
            sp = SamplingParams(max_tokens=10, temperature=T, n=2, seed=7)  # one batch on every rank
            outs = eng.generate(ps, sp)
            got = [_diff(ps, outs, odcfn.log_probs(state, _batch(ps, outs), temperature=T or 1.0))]
            if cfg is MOE:  # routing replay: the engine's experts give the trainer the same values
                replay = _batch(ps, outs, routed=True)
                got.append(_diff(ps, outs, odcfn.log_probs(state, replay, temperature=T or 1.0)))
            out[T] = got
        return out

    for per_rank in odcfn.run_local(worker, world_size=2):
        for T, diffs in per_rank.items():
            assert max(diffs) <= ATOL, (T, diffs)


@pytest.mark.parametrize("kind", ["full", "lora", "moe"])
def test_weights_follow_the_trainer_step_by_step(kind):
    cfg = MOE if kind == "moe" else DENSE
    model, params = qwen_model(cfg), sharp_params(cfg, 11)
    config = {"max_tokens_per_microbatch": 32}
    if kind == "lora":
        targets = ("q_proj", "v_proj", "up_proj")
        model, params = odcfn.lora.apply(model, params, rank=2, alpha=4, targets=targets)
    if kind == "moe":
        config["expert_bias_rate"] = 0.05  # the bias moves every step and shifts the routing
    fixed = prompts(cfg.vocab_size, [9, 4, 13, 6], seed=11)
    train = [odcfn.random_batch([7, 12, 5, 9, 10], cfg.vocab_size, seed=20 + i) for i in range(3)]

    def worker(rank, transport):
        state = _state(model, params, transport, **config)
        eng = LocalEngine(model, cfg, max_batch_tokens=20)  # no weights until the first sync
        eng.update_weights(state)
        assert eng.version == 0
        diffs, moved = [], []
        before = eng.score(fixed)
        for b in train:
            state, _ = odcfn.train_step(state, b)
            eng.update_weights(state)
            assert eng.version == state.step
            got = eng.score(fixed, temperature=0.9)
            want = odcfn.log_probs(state, odcfn.Batch(tuple(odcfn.Sample(torch.tensor(s)) for s in fixed)),
                                   temperature=0.9)
            diffs.append(max(float((g - w).abs().max()) for g, w in zip(got, want)))
            # and its samples' own log-probs
            outs = eng.generate(fixed[:2], SamplingParams(max_tokens=6, n=2, seed=3))
            assert all(c.version == state.step for c in outs)
            diffs.append(_diff(fixed, outs, odcfn.log_probs(state, _batch(fixed, outs))))
        after = eng.score(fixed)
        moved.append(max(float((a - b).abs().max()) for a, b in zip(after, before)))
        bias = None if state.router_bias is None else float(state.router_bias.abs().max())
        return diffs, moved, bias

    for diffs, moved, bias in odcfn.run_local(worker, world_size=2, timeout=120):
        assert max(diffs) <= ATOL, diffs
        assert moved[0] > 1e-2  # the weights did change: the check is not vacuous
        assert (bias is not None and bias > 0) == (kind == "moe")


def test_update_weights_refuses_another_models_state():
    def worker(rank, transport):
        state = _state(qwen_model(QWEN3), sharp_params(QWEN3), transport)
        eng = LocalEngine(qwen_model(DENSE), DENSE)
        with pytest.raises(ValueError, match="not the engine's"):
            eng.update_weights(state)
        return eng.version

    assert odcfn.run_local(worker, world_size=2) == [0, 0]
