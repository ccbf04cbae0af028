"""The data and loss of ``odcfn bench``'s preference section (run by
``odcfn.bench.preference_section``): DPO updates on UltraFeedback-like pairs.

UltraFeedback-style preference data is long-tailed in the prompt and in both answers: most
prompts are short instructions, a few carry long documents; answers run from a line to pages,
and the chosen one tends to be a little longer (the judges' length bias). The shapes below are
our assumptions, chosen to give those features (token counts of a Llama-class tokenizer):

- prompt ~ LogNormal(mu=4.5, sigma=1.0) kept in [8, 2048]: median ~90, mean ~150 tokens;
- answers ~ LogNormal(mu=5.5, sigma=0.8) kept in [4, 2048]: median ~245, mean ~330; the chosen
  one's median 15% higher (mu + 0.14); the two drawn independently.

Every length is divided by ``length_scale`` for CPU runs. A pair is (prompt + chosen,
prompt + rejected), one prompt; reference log-probs sit near the random model's, so the loss is
DPO's usual first-steps regime (ratios near 1). The loss: ``dpo(beta=0.1)`` (sigmoid).
"""

from __future__ import annotations

import math
import random

import torch

from odcfn.batch import Sample

__all__ = ["PREFERENCE_POLICIES", "member_lengths", "preference_batch_of", "preference_lengths",
           "preference_loss", "preference_max_tokens", "ultrafeedback_like"]

# ODC with free per-rank counts against the FSDP baseline with equal counts (pairs per rank)
PREFERENCE_POLICIES = ("collective+lb-micro", "odc+lb-mini")
PROMPT_MAX = ANSWER_MAX = 2048


def _lognormal_in(rng: random.Random, mu: float, sigma: float, lo: float, hi: float) -> float:
    while True:  # rejection keeps the body's shape (no spike at the bounds)
        x = rng.lognormvariate(mu, sigma)
        if lo <= x <= hi:
            return x


def ultrafeedback_like(n: int, *, seed: int) -> tuple[tuple[int, int, int], ...]:
    """``n`` unscaled (prompt, chosen answer, rejected answer) lengths (module docstring)."""
    rng = random.Random(f"ultrafeedback/{seed}")
    out = []
    for _ in range(n):
        p = _lognormal_in(rng, 4.5, 1.0, 8, PROMPT_MAX)
        c = _lognormal_in(rng, 5.5 + math.log(1.15), 0.8, 4, ANSWER_MAX)
        r = _lognormal_in(rng, 5.5, 0.8, 4, ANSWER_MAX)
        out.append((round(p), round(c), round(r)))
    return tuple(out)


def preference_max_tokens(length_scale: int) -> int:
    """The token cap: the longest possible pair (a pair runs in one microbatch)."""
    return 2 * (PROMPT_MAX + ANSWER_MAX) // length_scale


def preference_lengths(n_pairs: int, length_scale: int, seed: int) -> tuple[tuple[int, int, int], ...]:
    """Scaled (prompt, chosen answer, rejected answer) lengths; an answer keeps >= 2 tokens so
    it has a loss token after the first answer token's position."""
    return tuple((max(1, p // length_scale), max(2, c // length_scale), max(2, r // length_scale))
                 for p, c, r in ultrafeedback_like(n_pairs, seed=seed))


def member_lengths(n_pairs: int, length_scale: int, seed: int) -> tuple[int, ...]:
    """The samples' lengths in batch order: chosen_0, rejected_0, chosen_1, ..."""
    return tuple(p + a for p, c, r in preference_lengths(n_pairs, length_scale, seed) for a in (c, r))


def preference_batch_of(n_pairs: int, length_scale: int, vocab: int, seed: int):
    """A pair batch (``odcfn.preference_batch``) with reference log-probs."""
    from odcfn.preference import preference_batch

    g = torch.Generator().manual_seed(seed)
    base = -math.log(vocab)
    pairs = []
    for p, c, r in preference_lengths(n_pairs, length_scale, seed):
        prompt = torch.randint(0, vocab, (p,), generator=g)
        members = []
        for a in (c, r):
            t = p + a
            tokens = torch.cat([prompt, torch.randint(0, vocab, (a,), generator=g)])
            extras = {"ref_logprobs": base + 0.05 * torch.randn(t, generator=g)}
            members.append(Sample(tokens, loss_mask=torch.arange(t) >= p, extras=extras))
        pairs.append(tuple(members))
    return preference_batch(pairs)


def preference_loss():
    from odcfn.losses import dpo

    return dpo(beta=0.1)
