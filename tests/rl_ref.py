"""Helpers for the RL tests: rollout-like batches and transformers' model as the logits
function of the independent reference (``odcfn.reference.reference_rl_loss``)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

import odcfn
from odcfn.models.hf import config_to_hf, hf_name
from odcfn.tree import tree_named_leaves


@lru_cache(maxsize=16)
def _hf_model(cfg, dtype=torch.float32):
    import transformers

    d = config_to_hf(cfg)
    cls = transformers.Qwen2ForCausalLM if d["model_type"] == "qwen2" else transformers.LlamaForCausalLM
    conf = (transformers.Qwen2Config if d["model_type"] == "qwen2" else transformers.LlamaConfig)(**d)
    conf._attn_implementation = "eager"
    return cls(conf).eval().to(dtype)


def hf_logits_fn(cfg, params, dtype=torch.float32):
    """``tokens_L -> logits_LxV`` of transformers' model on odcfn's ``params`` (grads flow to
    ``params``' leaves; ``dtype`` float64 for a reference without float32's own error)."""
    model = _hf_model(cfg, dtype)
    sd = {hf_name(u, p): t for u, sub in params.items() for p, t in tree_named_leaves(sub)}
    return lambda tokens: torch.func.functional_call(model, sd, (tokens[None],)).logits[0]


def hf_hidden_fn(cfg, params, dtype=torch.float32):
    """``tokens_L -> h_LxD``: transformers' final hidden states (after its last norm), the input
    of the LM head, on odcfn's ``params``."""
    model = _hf_model(cfg, dtype)
    sd = {hf_name(u, p): t for u, sub in params.items() for p, t in tree_named_leaves(sub)}
    kw = {"output_hidden_states": True}
    return lambda tokens: torch.func.functional_call(model, sd, (tokens[None],), kw).hidden_states[-1][0]


def rollout_batch(lengths, prompt_lens, vocab, *, seed=0, kl=True, spread=0.3, prox=False):
    """Samples with a prompt (no loss) and a response, per-token advantages and old/ref
    log-probs near a plausible value (so ratios cross the clip range both ways); ``prox``: also
    proximal log-probs near the old ones (the decoupled objective; its own generator, so the
    other extras do not change)."""
    g = torch.Generator().manual_seed(seed)
    g_prox = torch.Generator().manual_seed(seed + 7919)
    out = []
    for n, p in zip(lengths, prompt_lens):
        p = min(p, n - 1)
        tokens = torch.randint(0, vocab, (n,), generator=g)
        mask = torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(n - p, dtype=torch.bool)])
        adv = torch.randn(n, generator=g)
        base = -torch.rand(n, generator=g) * 4 - 2.0  # ~ log(1/vocab)
        extras = {"advantages": adv, "old_logprobs": base + spread * torch.randn(n, generator=g)}
        if kl:
            extras["ref_logprobs"] = base + spread * torch.randn(n, generator=g)
        if prox:  # exp(prox - old) spans ~0.3-3: some tokens above a cap of 1.5, most below 5
            extras["prox_logprobs"] = extras["old_logprobs"] + 0.6 * torch.randn(n, generator=g_prox)
        out.append(odcfn.Sample(tokens, loss_mask=mask, extras=extras))
    return odcfn.Batch(tuple(out))


def _k3_clamp_root() -> float:
    """x > 0 with exp(x) - x - 1 = 10: where the k3 ("low_var_kl") estimate hits its clamp."""
    lo, hi = 0.0, 5.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.exp(mid) - mid - 1 < 10 else (lo, mid)
    return lo


def away_from_kinks(batch, cfg, params, loss_cfg, *, margin=1e-3):
    """``batch`` with old/ref log-probs moved so that no token's log-ratio sits within ``margin``
    of a point where the loss changes branch (the clip range's ends, the dual clip, ``abs``
    KL's zero, k3's clamp). float32 and a float64 reference agree to ~1e-6 in a log-prob; a
    token nearer a branch point than that may take the other branch in one of them, and the
    gradients then differ by a whole term, not by rounding. Log-probs from float64 logits."""
    t = loss_cfg.get("temperature", 1.0)
    ratio_kinks = [math.log(1 + loss_cfg["clip_ratio_high"]), math.log(loss_cfg["clip_ratio_c"])]
    if loss_cfg["clip_ratio_low"] < 1:
        ratio_kinks.append(math.log(1 - loss_cfg["clip_ratio_low"]))
    ref_kinks = [0.0, -_k3_clamp_root()]  # d = logp - ref: |d| at 0, k3 clamps at -d = root
    fn = hf_logits_fn(cfg, odcfn.tree_map(lambda x: x.detach().double(), params), torch.float64)
    out = []
    with torch.no_grad():
        for s in batch.samples:
            tokens = s.tokens.long()
            logp = torch.zeros(s.length, dtype=torch.float64)  # token t predicted from t - 1
            logp[1:] = torch.log_softmax(fn(tokens)[:-1] / t, -1).gather(1, tokens[1:, None])[:, 0]
            extras = dict(s.extras)
            # the clipped ratio is against the proximal policy under the decoupled objective
            anchor = "prox_logprobs" if loss_cfg.get("decoupled") else "old_logprobs"
            for key, kinks in ((anchor, ratio_kinks), ("ref_logprobs", ref_kinks)):
                if key not in extras:
                    continue
                v = extras[key].double().clone()
                for _ in range(len(kinks) + 1):  # kinks lie far more than 3 margins apart
                    near = torch.zeros_like(v, dtype=torch.bool)
                    for k in kinks:
                        near |= ((logp - v) - k).abs() < margin
                    v[near] -= 3 * margin
                extras[key] = v.float()
            cap = loss_cfg.get("behav_imp_weight_cap")
            if loss_cfg.get("decoupled") and cap is not None:  # the weight exp(prox - old) meets its cap
                old, prox = extras["old_logprobs"].double(), extras["prox_logprobs"].double()
                near = ((prox - old) - math.log(cap)).abs() < margin
                extras["old_logprobs"] = torch.where(near, old + 3 * margin, old).float()
            out.append(odcfn.Sample(s.tokens, loss_mask=s.loss_mask, extras=extras))
    return odcfn.Batch(tuple(out))
