"""Helpers for the DPO tests: random preference batches and an independent single-process
reference (transformers' Qwen2 logits, plain log_softmax, the pair formulas written out here
from the papers / TRL's documentation, autograd on the unsharded params)."""

from __future__ import annotations

import math

import torch

import odcfn
from tests.rl_ref import hf_logits_fn


def pair_batch(shapes, vocab: int, *, seed: int = 0, ref: bool = True, same_prompt=True):
    """``shapes``: (prompt, chosen answer, rejected answer) lengths per pair; random tokens and,
    with ``ref``, random per-token reference log-probs. ``same_prompt``: a bool, or one per pair
    (False: the rejected member gets its own random prompt, an invalid pair)."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    same = [same_prompt] * len(shapes) if isinstance(same_prompt, bool) else list(same_prompt)
    for (p, a, b), same_prompt in zip(shapes, same):
        prompt = torch.randint(0, vocab, (p,), generator=g)
        members = []
        for n in (a, b):
            if not same_prompt:
                prompt = torch.randint(0, vocab, (p,), generator=g)
            tokens = torch.cat([prompt, torch.randint(0, vocab, (n,), generator=g)])
            mask = torch.arange(p + n) >= p
            extras = {"ref_logprobs": -3 * torch.rand(p + n, generator=g)} if ref else None
            members.append(odcfn.Sample(tokens, loss_mask=mask, extras=extras))
        pairs.append(tuple(members))
    return odcfn.preference_batch(pairs)


def pair_loss(kind: str, beta: float, ls: float, gamma: float, c, r, rc, rr, nc, nr):
    """One pair's loss from its sequence sums (c, r), the reference's (rc, rr) and the answer
    lengths, written from the formulas (DPO, cDPO, robust DPO, hinge/SLiC, IPO, SimPO)."""
    sig = torch.sigmoid
    if kind == "simpo":
        z = beta * (c / nc - r / nr) - gamma
        return -(1 - ls) * torch.log(sig(z)) - ls * torch.log(sig(-z))
    d = (c - rc) - (r - rr)
    if kind == "sigmoid":
        return -(1 - ls) * torch.log(sig(beta * d)) - ls * torch.log(sig(-beta * d))
    if kind == "robust":
        return ((1 - ls) * -torch.log(sig(beta * d)) - ls * -torch.log(sig(-beta * d))) / (1 - 2 * ls)
    if kind == "hinge":
        return torch.clamp(1 - beta * d, min=0)
    assert kind == "ipo"
    return ((c - rc) / nc - (r - rr) / nr - 1 / (2 * beta)) ** 2


def reference(cfg, full, batch, loss, dtype=torch.float64):
    """``(loss, metrics, grads)`` of ``loss`` (an ``odcfn.losses.DPO``) on ``batch``."""
    params = odcfn.tree_map(lambda t: t.to(dtype).requires_grad_(), full)
    logits = hf_logits_fn(cfg, params, dtype)
    sums, counts, refs, nll_terms = [], [], [], []
    for i, s in enumerate(batch.samples):
        lp = torch.log_softmax(logits(s.tokens)[:-1] / loss.temperature, -1)
        lp = lp.gather(-1, s.tokens[1:, None].long())[:, 0]
        m = s.loss_mask[1:].to(dtype)
        sums.append((lp * m).sum())
        counts.append(m.sum())
        ref = s.extras["ref_logprobs"][1:].to(dtype) if loss.uses_reference else torch.zeros_like(m)
        refs.append((ref * m).sum())
        if i % 2 == 0:
            nll_terms.append(-(lp * m))
    pairs = len(batch) // 2
    per_pair, figures = [], {k: 0.0 for k in loss.metric_names}
    b = loss.beta
    for k in range(pairs):
        c, r, rc, rr = sums[2 * k], sums[2 * k + 1], refs[2 * k], refs[2 * k + 1]
        nc, nr = counts[2 * k], counts[2 * k + 1]
        per_pair.append(pair_loss(loss.loss_type, b, loss.label_smoothing, loss.simpo_gamma,
                                  c, r, rc, rr, nc, nr))
        if loss.loss_type == "simpo":
            lc, lr = float(c / nc), float(r / nr)
            wc, wr = b * lc, b * lr
        else:
            lc, lr = float(c), float(r)
            wc, wr = b * float(c - rc), b * float(r - rr)
        for name, v in (("rewards/chosen", wc), ("rewards/rejected", wr),
                        ("rewards/accuracies", float(wc > wr)), ("rewards/margins", wc - wr),
                        ("logps/chosen", lc), ("logps/rejected", lr)):
            figures[name] += v / pairs
    nll = torch.cat(nll_terms).sum() / sum(counts[0::2])
    total = torch.stack(per_pair).mean() + loss.sft_weight * nll
    figures["nll_loss"] = float(nll)
    leaves, treedef = odcfn.tree.tree_flatten(params)
    grads = [g.float() for g in torch.autograd.grad(total, leaves)]
    return float(total), figures, odcfn.tree.tree_unflatten(treedef, grads)


LN2 = math.log(2)
