"""The data and loss of ``odcfn bench``'s RL section (run by ``odcfn.bench.rl_section``): GRPO
policy updates on AIME-RL-like rollouts.

The paper's RL headline (GRPO with verl, AIME, +11% samples/s) is capped by verl's rule that
every device processes the same number of samples. Three contenders run side by side on the same
minibatches: ``collective+lb-micro`` (the FSDP baseline under that rule), ``odc+lb-micro`` (ODC
under the same rule) and ``odc+lb-mini`` (ODC with free per-rank counts).

Data: groups of ``group_size`` responses per prompt; each group shares its prompt (no loss on
it); response lengths follow ``odcfn.schedule.lengths.aime_rl`` (correct answers short, wrong
ones ~3x longer, a spike at the generation cap), divided by ``length_scale``. The reward is 1 for
the shorter half of each group (the paper: wrong answers run longer), advantages are
group-normalised, old/ref log-probs sit near the random model's (ratios near 1). The loss is
``policy_gradient(kl_loss_coef=0.001)`` (token-mean, low-var KL: verl's GRPO recipe).
"""

from __future__ import annotations

import random

import torch

from odcfn.batch import Batch, Sample
from odcfn.schedule.lengths import AIME_RESPONSE_CAP, aime_rl

__all__ = ["RL_POLICIES", "rl_batch", "rl_lengths", "rl_loss", "rl_max_tokens"]

RL_POLICIES = ("collective+lb-micro", "odc+lb-micro", "odc+lb-mini")
PROMPT_RANGE = (100, 400)  # aime_rl's prompt lengths (tokens)


def rl_max_tokens(length_scale: int) -> int:
    return (AIME_RESPONSE_CAP + PROMPT_RANGE[1]) // length_scale


def rl_lengths(n: int, group_size: int, length_scale: int, seed: int) -> tuple[tuple[int, int], ...]:
    """``n`` (prompt, total) lengths; consecutive groups of ``group_size`` share a prompt."""
    rng = random.Random(f"bench-rl/{seed}")
    totals = aime_rl(n, seed=seed, scale=1.0)
    out = []
    for i, t in enumerate(totals):
        if i % group_size == 0:
            prompt = rng.randint(*PROMPT_RANGE)
        response = max(1, t - rng.randint(*PROMPT_RANGE))  # aime_rl's own prompt draw, removed
        out.append((max(1, prompt // length_scale), max(2, (prompt + response) // length_scale)))
    cap = rl_max_tokens(length_scale)
    return tuple((min(p, cap - 1), min(t, cap)) for p, t in out)


def rl_batch(n: int, group_size: int, length_scale: int, vocab: int, seed: int) -> Batch:
    lengths = rl_lengths(n, group_size, length_scale, seed)
    g = torch.Generator().manual_seed(seed)
    base = -torch.log(torch.tensor(float(vocab)))
    samples = []
    for start in range(0, n, group_size):
        group = lengths[start:start + group_size]
        p = group[0][0]
        prompt = torch.randint(0, vocab, (p,), generator=g)
        totals = torch.tensor([float(t) for _, t in group])
        reward = (totals <= totals.median()).float()
        adv = (reward - reward.mean()) / (reward.std() + 1e-6) if len(group) > 1 else reward * 0
        for (_, t), a in zip(group, adv):
            tokens = torch.cat([prompt, torch.randint(0, vocab, (max(0, t - p),), generator=g)])[:t]
            mask = torch.arange(t) >= p
            extras = {
                "advantages": torch.full((t,), float(a)),
                "old_logprobs": base + 0.05 * torch.randn(t, generator=g),
                "ref_logprobs": base + 0.05 * torch.randn(t, generator=g),
            }
            samples.append(Sample(tokens, loss_mask=mask, extras=extras))
    return Batch(tuple(samples))


def rl_loss():
    from odcfn.losses import policy_gradient

    return policy_gradient(kl_loss_coef=0.001, kl_loss_type="low_var_kl", loss_agg_mode="token-mean")
