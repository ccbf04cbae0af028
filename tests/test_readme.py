"""The README's code block and the first example of each topic page in docs/ run as written and
say what they claim: the train step makes one sync per minibatch; the RL loop's update is the one
an independent reference computes (the loss and each parameter's AdamW step, from transformers'
model in float64, with log-probs that odcfn did not compute); the long-context step's loss is
ln V; a checkpoint loads back bit for bit; a LoRA step moves the adapters only."""

import re
from pathlib import Path

import pytest
import torch

import odcfn
from odcfn.models import init_params
from odcfn.reference import reference_rl_loss
from tests.rl_ref import hf_logits_fn

ROOT = Path(__file__).parent.parent


def _blocks(path):
    return re.findall(r"```python\n(.*?)```", (ROOT / path).read_text(), re.S)


BLOCKS = _blocks("README.md")
RL, LONG, RECOVERY, LORA = (_blocks(f"docs/{page}.md")[0]
                            for page in ("rl", "long_context", "reliability", "lora"))


def _run(code, capsys, ns=None):
    exec(compile(code, "example", "exec"), {} if ns is None else ns)
    return eval(capsys.readouterr().out.strip())


def test_every_python_block_is_checked():
    assert len(BLOCKS) == 1, "a new README code block needs a test here"


def test_readme_train_step_example_runs(capsys):
    losses_syncs = _run(BLOCKS[0], capsys)
    assert len(losses_syncs) == 2
    assert losses_syncs[0] == losses_syncs[1] and losses_syncs[0][1] == 1


def _reference_update(ns):
    """The snippet's first update computed again without odcfn's model, log-probs or loss:
    transformers' Qwen2 in float64 gives the old/ref log-probs and the logits,
    ``reference_rl_loss`` the loss, autograd the gradient, ``torch.optim.AdamW`` the step."""
    cfg, loss = ns["cfg"], ns["loss"]
    p0 = odcfn.tree_map(lambda t: t.double().requires_grad_(), init_params(cfg))
    tokens, masks, rewards = zip(*ns["rollouts"]())
    adv = torch.tensor(rewards) - torch.tensor(rewards).mean()
    logits_fn = hf_logits_fn(cfg, p0, dtype=torch.float64)
    with torch.no_grad():  # [t]: the log-prob of token t given the tokens before it, [0] = 0
        old = [torch.cat([torch.zeros(1, dtype=torch.float64),
                          torch.log_softmax(logits_fn(t)[:-1], -1).gather(-1, t[1:, None])[:, 0]])
               for t in tokens]
    batch = odcfn.Batch(tuple(odcfn.Sample(t, loss_mask=m, extras={
        "advantages": torch.full((len(t),), float(a)), "old_logprobs": o, "ref_logprobs": o})
        for t, m, a, o in zip(tokens, masks, adv, old)))
    value, _ = reference_rl_loss(logits_fn, batch, clip_ratio_low=loss.clip_ratio_low,
                                 clip_ratio_high=loss.clip_ratio_high, kl_loss_coef=loss.kl_loss_coef,
                                 kl_loss_type=loss.kl_loss_type, loss_agg_mode=loss.loss_agg_mode)
    leaves = [t for _, t in sorted(odcfn.tree.tree_named_leaves(p0))]
    grads = torch.autograd.grad(value, leaves, allow_unused=True)
    new = {}
    for (name, t), g in zip(sorted(odcfn.tree.tree_named_leaves(p0)), grads):
        p = t.detach().clone().requires_grad_()
        p.grad = torch.zeros_like(p) if g is None else g
        torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01).step()  # odcfn.adamw(1e-3)'s defaults
        new[name] = (t.detach(), p.grad, p.detach())
    return float(value.detach()), new


def test_rl_example_is_the_reference_update(capsys, monkeypatch):
    seen = {"metrics": [], "full": []}
    train_step, gather_params = odcfn.train_step, odcfn.gather_params

    def record_step(state, batch):
        state, metrics = train_step(state, batch)
        seen["metrics"].append(metrics)
        return state, metrics

    def record_gather(state, *a, **kw):
        seen["full"].append(gather_params(state, *a, **kw))
        return seen["full"][-1]

    monkeypatch.setattr(odcfn, "train_step", record_step)
    monkeypatch.setattr(odcfn, "gather_params", record_gather)
    ns = {}
    per_rank = _run(RL, capsys, ns)
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    ppo_kl, clipfrac = per_rank[0]  # the README's comment: the first update's ratio is 1
    assert ppo_kl == pytest.approx(0.0, abs=1e-6) and clipfrac == 0.0

    want_loss, want = _reference_update(ns)
    assert len(seen["metrics"]) == 2 and len(seen["full"]) == 2
    for metrics, full in zip(seen["metrics"], seen["full"]):
        # the loss: advantages, masks and the token-mean over the whole minibatch, aligned
        assert metrics.loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7), (metrics.loss, want_loss)
        got = dict(odcfn.tree.tree_named_leaves(full))
        assert got.keys() == want.keys()
        moved = 0
        for name, (p0, g, p1) in want.items():
            # AdamW's first step moves each entry by lr·g/(|g| + eps) (+ decay): the sign of each
            # gradient entry. Entries whose gradient is within float32 noise of 0 may go either way.
            clear = g.abs() > 1e-4 * float(g.abs().max()) + 1e-12
            step_got, step_want = got[name].double() - p0, p1 - p0
            err = (step_got - step_want).abs()[clear]
            assert err.numel() == 0 or float(err.max()) < 1e-6, (name, float(err.max()))
            moved += int(clear.sum())
        assert moved > 1000, moved  # most of the model's entries were checked, not a few


def test_long_context_example_runs_the_tiled_head(capsys, monkeypatch):
    from odcfn.kernels import fused_head as fh

    def no_fallback(*a, **k):
        raise AssertionError("the example took the one-tile fallback, not the vocabulary tiles")

    monkeypatch.setattr(fh, "unfused_head", no_fallback)
    ns = {}
    assert _run(LONG, capsys, ns) == [0.0]
    cfg = ns["cfg"]
    assert fh.default_chunks(512, cfg.vocab_size)[1] < cfg.vocab_size  # several vocabulary tiles


def test_recovery_example_loads_back_what_it_saved(capsys):
    assert _run(RECOVERY, capsys) == [(1, True), (1, True)]


def test_lora_example_moves_the_adapters_only(capsys):
    assert _run(LORA, capsys) == ["lora.layers.0", "lora.layers.1"]


def test_moe_example_gathers_routed_experts(capsys):
    """docs/moe.md's example: one sync, routed expert-group gathers in the trace, loads reported."""
    (MOE,) = _blocks("docs/moe.md")[:1]
    out = _run(MOE, capsys)
    assert out == [(1, True, True), (1, True, True)]
