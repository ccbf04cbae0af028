"""Helpers for the RL tests: rollout-like batches and transformers' model as the logits
function of the independent reference (``odcfn.reference.reference_rl_loss``)."""

from __future__ import annotations

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


def rollout_batch(lengths, prompt_lens, vocab, *, seed=0, kl=True, spread=0.3):
    """Samples with a prompt (no loss) and a response, per-token advantages and old/ref
    log-probs near a plausible value (so ratios cross the clip range both ways)."""
    g = torch.Generator().manual_seed(seed)
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
        out.append(odcfn.Sample(tokens, loss_mask=mask, extras=extras))
    return odcfn.Batch(tuple(out))
