"""DPO-family preference losses (``odcfn.losses.dpo``), with TRL's names and semantics.

A pair's loss depends on the sequence log-prob sums of both members, so it is not a per-token
loss: the head unit sums the fused head's per-token log-probs per sample inside the microbatch
(``microbatch_stats``; never a T×V tensor) and turns each pair's sums into its loss. A pair batch
(``odcfn.preference_batch``) is balanced one unit per pair, so both members are always in the
microbatch. Aggregation stays split-invariant through the weights computed from the WHOLE
minibatch (``weights``): every rejected member's tokens carry ``1 / num_pairs`` (read once per
pair) and every chosen answer token ``1 / num_chosen_answer_tokens`` (the optional NLL term's
token mean). So the minibatch loss is ``mean over pairs + sft_weight * chosen NLL`` whatever the
microbatch cap, world size or balancer, and the metrics ride the one sync as sums.

With ``d = (logp_c - ref_c) - (logp_r - ref_r)`` (sums over answer tokens; ``ref = 0`` when
reference-free), ``ls = label_smoothing``, ``σ`` the logistic function:

- ``sigmoid``: ``-(1 - ls) log σ(β d) - ls log σ(-β d)`` (DPO; cDPO when ``ls > 0``),
- ``robust``: ``(-(1 - ls) log σ(β d) + ls log σ(-β d)) / (1 - 2 ls)``,
- ``hinge``: ``relu(1 - β d)``,
- ``ipo``: ``(d' - 1 / (2 β))²`` with ``d'`` from length-averaged log-ratios (TRL's IPO),
- ``simpo``: ``-(1 - ls) log σ(β d'' - γ) - ls log σ(-(β d'' - γ))`` with ``d''`` the
  difference of length-averaged policy log-probs and ``γ = simpo_gamma`` (reference-free; TRL's
  CPO trainer with ``loss_type="simpo"``).

Metrics as TRL reports them (means over the minibatch's pairs): ``rewards/chosen`` =
``β (logp_c - ref_c)`` (SimPO: ``β`` x the length-averaged logp), ``rewards/rejected``,
``rewards/accuracies`` (chosen reward > rejected), ``rewards/margins``, ``logps/chosen``,
``logps/rejected`` (SimPO: length-averaged), and ``nll_loss`` (the chosen answers' token-mean NLL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from odcfn._check import check_number
from odcfn.batch import Batch, Microbatch
from odcfn.losses.head import check_head
from odcfn.preference.pairs import check_pairs, describe

__all__ = ["DPO", "DPO_LOSS_TYPES", "dpo"]

DPO_LOSS_TYPES = ("sigmoid", "robust", "hinge", "ipo", "simpo")
_LENGTH_NORMALISED = ("ipo", "simpo")


@dataclass(frozen=True)
class DPO:
    """A preference loss over a pair batch (see the module docstring and ``dpo``)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0
    temperature: float = 1.0
    head: str = "fused"
    token_chunk: int | None = None
    vocab_chunk: int | None = None

    metric_names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                    "logps/chosen", "logps/rejected", "nll_loss")
    mean_metrics = frozenset()  # every figure is pre-weighted by 1 / num_pairs in the head
    needs_entropy = False
    needs_logits = False

    def __post_init__(self) -> None:
        check_head(self)
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(
                f"dpo: loss_type={self.loss_type!r} does not exist; expected one of {list(DPO_LOSS_TYPES)}"
            )
        check_number(self.beta, "dpo: beta", positive=True)
        for name in ("label_smoothing", "simpo_gamma", "sft_weight"):
            check_number(getattr(self, name), f"dpo: {name}")
        hi = 0.5 if self.loss_type == "robust" else 1.0  # robust divides by 1 - 2 ls
        if not 0 <= self.label_smoothing < hi:
            raise ValueError(
                f"dpo: label_smoothing must be in [0, {hi}) for {self.loss_type!r}, "
                f"got {self.label_smoothing!r}"
            )
        if self.sft_weight < 0:
            raise ValueError(f"dpo: sft_weight must be >= 0, got {self.sft_weight!r}")
        if not isinstance(self.reference_free, bool):
            raise TypeError(f"dpo: reference_free must be a bool, got {type(self.reference_free).__name__}")

    @property
    def uses_reference(self) -> bool:
        return not (self.reference_free or self.loss_type == "simpo")

    def required_extras(self) -> tuple[str, ...]:
        return ("ref_logprobs",) if self.uses_reference else ()

    def validate(self, batch: Batch) -> None:
        """Pairs, answers and reference log-probs, on every rank before any communication."""
        if not batch.pairs:
            raise ValueError(
                "dpo needs a pair batch: build it with odcfn.preference_batch([(chosen, rejected), ...]) "
                "(samples 2k, 2k + 1 are pair k)"
            )
        check_pairs(batch)
        if self.uses_reference:
            for i, s in enumerate(batch.samples):
                if "ref_logprobs" not in s.extras:
                    raise ValueError(
                        f"dpo(loss_type={self.loss_type!r}) needs reference log-probs: {describe(batch, i)} "
                        "lacks extras['ref_logprobs'] (preference_batch(..., ref_logprobs=odcfn.log_probs("
                        "ref_state, batch)), or reference_free=True)"
                    )

    def weights(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """Per-token weights from the whole minibatch (see the module docstring): rejected
        members carry ``1 / num_pairs`` on every token, chosen answer tokens
        ``1 / num_chosen_answer_tokens``."""
        pairs = len(batch) // 2
        chosen_tokens = sum(s.num_loss_tokens for s in batch.samples[0::2])
        out = []
        for i, s in enumerate(batch.samples):
            if i % 2:
                out.append(torch.full((s.length,), 1.0 / pairs))
            else:
                m = torch.ones(s.length) if s.loss_mask is None else s.loss_mask.float()
                out.append(torch.cat([torch.zeros(1), m[1:]]) / chosen_tokens)
        return tuple(out)

    def per_token(self, logp_T, entropy_T, extras):
        raise TypeError("dpo is a sequence-level loss: the head calls microbatch_stats, not per_token")

    def microbatch_stats(self, logp_T: torch.Tensor, mb: Microbatch) -> torch.Tensor:
        """``[weighted loss, *metric sums]`` of the microbatch's pairs, from the fused head's
        per-token log-probs ``logp_T`` (0 where not a loss token)."""
        ids = mb.sample_ids
        # the balancers place pairs as units (odcfn.preference.expand_program): a split pair
        # here is a bug upstream, never a user error
        if len(ids) % 2 or any(c % 2 or r != c + 1 for c, r in zip(ids[0::2], ids[1::2])):
            raise RuntimeError(f"dpo: microbatch samples {ids} are not whole (chosen, rejected) pairs")
        dev = logp_T.device
        n = len(mb.seqlens)
        seqlens = torch.tensor(mb.seqlens, device=dev)
        seg = torch.repeat_interleave(torch.arange(n, device=dev), seqlens)
        m = mb.loss_mask_T
        lp = logp_T * m
        sums = torch.zeros(n, device=dev, dtype=lp.dtype).index_add(0, seg, lp)
        counts = torch.zeros(n, device=dev, dtype=lp.dtype).index_add(0, seg, m.to(lp.dtype))
        if self.uses_reference:
            ref = torch.zeros(n, device=dev, dtype=lp.dtype).index_add(0, seg, mb.extras["ref_logprobs"] * m)
        else:
            ref = torch.zeros_like(sums)
        starts = torch.cumsum(seqlens, 0) - seqlens
        pair_w = mb.weight_T[starts[1::2]]  # 1 / num_pairs, on every rejected token
        losses, rc, rr, lc, lr = self.pair_losses(sums[0::2], sums[1::2], ref[0::2], ref[1::2],
                                                  counts[0::2], counts[1::2])
        chosen_T = (seg % 2 == 0).to(lp.dtype)  # pairs are adjacent from local sample 0
        nll = -(lp * mb.weight_T * chosen_T).sum()
        loss = (losses * pair_w).sum() + (self.sft_weight * nll if self.sft_weight else 0.0)
        figures = [rc, rr, (rc > rr).to(lp.dtype), rc - rr, lc, lr]
        metrics = [(f.detach() * pair_w).sum() for f in figures] + [nll.detach()]
        return torch.stack([loss, *metrics])

    def pair_losses(
        self, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor, n_chosen: torch.Tensor, n_rejected: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """Per pair: ``(loss, chosen reward, rejected reward, chosen logps, rejected logps)``
        (rewards and logps as TRL reports them, detached) from the sequence log-prob sums,
        the reference's sums and the answer lengths."""
        b, ls = self.beta, self.label_smoothing
        if self.loss_type == "simpo":
            ac, ar = chosen / n_chosen, rejected / n_rejected
            z = b * (ac - ar) - self.simpo_gamma  # TRL: beta * (logits - gamma / beta)
            loss = -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)
            return loss, (b * ac).detach(), (b * ar).detach(), ac.detach(), ar.detach()
        cr, rr = chosen - ref_chosen, rejected - ref_rejected
        d = cr - rr
        if self.loss_type == "sigmoid":
            loss = -(1 - ls) * F.logsigmoid(b * d) - ls * F.logsigmoid(-b * d)
        elif self.loss_type == "robust":
            loss = (-(1 - ls) * F.logsigmoid(b * d) + ls * F.logsigmoid(-b * d)) / (1 - 2 * ls)
        elif self.loss_type == "hinge":
            loss = torch.relu(1 - b * d)
        else:  # ipo: on length-averaged log-ratios, so beta does not scale with answer length
            loss = (cr / n_chosen - rr / n_rejected - 1 / (2 * b)) ** 2
        return loss, (b * cr).detach(), (b * rr).detach(), chosen.detach(), rejected.detach()


def dpo(
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    *,
    simpo_gamma: float = 0.5,
    sft_weight: float = 0.0,
    temperature: float = 1.0,
    **head: object,
) -> DPO:
    """A DPO-family loss for ``StepConfig(loss=...)`` over ``odcfn.preference_batch`` batches.

    ``loss_type``: one of ``DPO_LOSS_TYPES`` (formulas in ``odcfn.losses.preference``). ``beta`` > 0;
    ``label_smoothing``: cDPO's for ``sigmoid``/``simpo``, the flip probability in [0, 0.5)
    for ``robust``. ``reference_free``: the reference log-probs are taken as 0 (``simpo`` never
    uses them). ``sft_weight``: adds that times the token-mean NLL of the minibatch's chosen
    answers (TRL's ``loss_type=[..., "sft"]`` with ``loss_weights=[1, sft_weight]``; formerly
    ``rpo_alpha``). ``temperature`` divides the logits; ``head``: ``head``/``token_chunk``/
    ``vocab_chunk`` as in ``odcfn.losses.TokenLoss``. Reference-based losses need every sample's
    ``extras["ref_logprobs"]`` (``preference_batch(..., ref_logprobs=odcfn.log_probs(ref, batch))``).
    """
    return DPO(beta=beta, loss_type=loss_type, label_smoothing=label_smoothing, reference_free=reference_free,
               simpo_gamma=simpo_gamma, sft_weight=sft_weight, temperature=temperature, **head)
