"""``[eval] every = N``: the held-out loss of ``data.eval_path`` after every N-th update, on every
rank, through the forward-only machinery (``odcfn.log_probs``: balanced like training, one sync
per pass of ``data.batch_size`` samples, or pairs). The values are the same on every rank (each
pass's sync sums the log-probs); rank 0 writes them into that step's metrics line.

- SFT: ``eval/loss`` = the sum of the held-out token losses / the number of held-out loss tokens
  (the training loss's definition over the whole held-out set, not a mean of per-pass means).
- DPO: from every member's sequence log-prob sum (and the reference's, cached beside the training
  set's, ``reference_logprobs_eval.safetensors``), the loss's own per-pair terms
  (``odcfn.losses.DPO.pair_losses``): ``eval/loss`` = the mean pair loss (+ ``sft_weight`` x
  the chosen answers' token-mean NLL) and TRL's figures as ``eval/rewards/chosen``,
  ``eval/rewards/rejected``, ``eval/rewards/accuracies``, ``eval/rewards/margins``,
  ``eval/logps/chosen``, ``eval/logps/rejected``, ``eval/nll_loss``.

Every name carries ``eval/`` in every backend; ``eval/seconds`` is the evaluation's wall time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from odcfn.batch import Batch, Sample

__all__ = ["Evaluator", "dpo_eval", "sft_eval"]



def _targets(s: Sample) -> torch.Tensor:
    """The sample's target mask in float64 (token 0 is never a target)."""
    m = torch.ones(s.length, dtype=torch.float64) if s.loss_mask is None else s.loss_mask.double()
    m[0] = 0.0
    return m


def sft_eval(state: Any, samples: Sequence[Sample], per_pass: int) -> dict[str, float]:
    """The cross-entropy of ``samples`` under ``state``'s params: sum of token losses / loss tokens,
    ``per_pass`` samples per forward-only pass (a pass without loss tokens is left out: it adds
    nothing, and a ``Batch`` refuses it)."""
    import odcfn

    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for at in range(0, len(samples), per_pass):
        chunk = tuple(samples[at:at + per_pass])
        if not any(s.num_loss_tokens for s in chunk):
            continue
        for s, lp in zip(chunk, odcfn.log_probs(state, Batch(chunk))):
            total -= (lp.double() * _targets(s)).sum()
            count += s.num_loss_tokens
    return {"eval/loss": float(total / count)}


def dpo_eval(
    state: Any, pairs: Sequence[tuple[Sample, Sample]], ref: Sequence[torch.Tensor] | None, loss: Any,
    per_pass: int,
) -> dict[str, float]:
    """The preference loss and TRL's figures over ``pairs`` (``ref``: the reference's per-token
    log-probs of ``chosen_0, rejected_0, ...``; None for a reference-free loss), ``per_pass``
    pairs per forward-only pass."""
    import odcfn

    sums, counts, refs = [], [], []
    for at in range(0, len(pairs), per_pass):
        members = tuple(s for p in pairs[at:at + per_pass] for s in p)
        for i, (s, lp) in enumerate(zip(members, odcfn.log_probs(state, Batch(members)))):
            m = _targets(s)
            sums.append((lp.double() * m).sum())
            counts.append(m.sum())
            r = ref[2 * at + i].double() if ref is not None else torch.zeros_like(m)
            refs.append((r * m).sum())
    s, n, r = torch.stack(sums), torch.stack(counts), torch.stack(refs)
    losses, rc, rr, lc, lr = loss.pair_losses(s[0::2], s[1::2], r[0::2], r[1::2], n[0::2], n[1::2])
    nll = -s[0::2].sum() / n[0::2].sum()
    total = losses.mean() + (loss.sft_weight * nll if loss.sft_weight else 0.0)
    figures = {"loss": total, "rewards/chosen": rc.mean(), "rewards/rejected": rr.mean(),
               "rewards/accuracies": (rc > rr).double().mean(), "rewards/margins": (rc - rr).mean(),
               "logps/chosen": lc.mean(), "logps/rejected": lr.mean(), "nll_loss": nll}
    return {f"eval/{k}": float(v) for k, v in figures.items()}


class Evaluator:
    """The run's evaluation: ``at(state, step)`` is ``{}`` unless ``step`` (1-based: the updates
    done) is a multiple of ``eval.every``; then the figures above. Every rank calls it alike."""

    def __init__(self, cfg: Any, data: Any) -> None:
        self.every, self.per_pass, self.data = cfg.eval.every, cfg.data.batch_size, data

    def at(self, state: Any, step: int) -> dict[str, float]:
        if not self.every or step % self.every or self.data.eval is None:
            return {}
        t0 = time.perf_counter()
        if state.config.loss is not None and getattr(state.config.loss, "pair_losses", None) is not None:
            out = dpo_eval(state, self.data.eval, self.data.eval_ref, state.config.loss, self.per_pass)
        else:
            out = sft_eval(state, self.data.eval.samples, self.per_pass)
        return {**out, "eval/seconds": time.perf_counter() - t0}
