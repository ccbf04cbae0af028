"""Preference pairs as data: ``preference_batch`` and how a pair moves through a step as one unit.

A DPO-family loss needs the sequence log-prob sums of BOTH members of a pair at once (its
gradient is a per-pair scalar times ∇logp_chosen − ∇logp_rejected). Two designs keep ODC's one
sync per minibatch: a forward-only pass computing every sum first (+25-33% compute), or placing
both members in one microbatch. We take the second: the balancers see one unit per pair (its
length the members' sum), and the program's microbatches of units are expanded back into sample
ids (chosen, then rejected) before the runtime packs them. So every balancer and work stealing
serve pairs unchanged, and a pair can never be split across microbatches or ranks.

The balancers' cost model prices a pair by its total length, a small overestimate of the
attention term (two sequences cost less than one of their summed length); the token cap, which
bounds memory, is exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence

import torch

from odcfn.batch import Batch, Sample
from odcfn.schedule.program import Piece

__all__ = ["check_pairs", "expand_program", "identical_pairs", "preference_batch", "schedule_lengths",
           "with_ref_logprobs"]

MEMBERS = ("chosen", "rejected")


def preference_batch(
    pairs: Sequence[tuple[Sample, Sample]],
    *,
    ref_logprobs: Sequence[torch.Tensor] | None = None,
    step: int | None = None,
) -> Batch:
    """A minibatch of preference pairs: samples ``chosen_0, rejected_0, chosen_1, ...``.

    Each member is an ``odcfn.Sample`` whose ``loss_mask`` is 1 on its answer (prompt tokens 0).
    Both members share one prompt (the tokens before the first answer token) or it is an error
    naming the pair. ``ref_logprobs``: the reference's
    per-token log-probs of every sample in that order (what ``odcfn.log_probs`` of the reference
    returns on this batch), stored as the samples' ``extras["ref_logprobs"]``; or give them as
    extras yourself, or use a reference-free loss."""
    if isinstance(pairs, (Sample, Batch)) or not isinstance(pairs, Sequence):
        raise TypeError(
            "preference_batch takes a sequence of (chosen, rejected) Sample pairs, "
            f"got {type(pairs).__name__}"
        )
    if not pairs:
        raise ValueError("preference_batch: no pairs (a minibatch needs at least one)")
    samples: list[Sample] = []
    for k, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            got = f"{len(pair)} items" if isinstance(pair, (tuple, list)) else type(pair).__name__
            raise ValueError(f"preference pair {k} must be (chosen, rejected), got {got}")
        for member, s in zip(MEMBERS, pair):
            if not isinstance(s, Sample):
                got = type(s).__name__
                raise TypeError(f"preference pair {k} {member}: expected odcfn.Sample, got {got}")
        samples.extend(pair)
    batch = Batch(tuple(samples), step=step, pairs=True)
    check_pairs(batch)
    same = identical_pairs(batch)
    if same:  # named, not refused: the loss of such a pair is a constant (ln 2 for sigmoid)
        warnings.warn(f"preference pair {same[0]}{f' (and {len(same) - 1} more)' if len(same) > 1 else ''}: "
                      "chosen and rejected are identical, so the pair adds a constant to the loss and "
                      "nothing to the gradient", UserWarning, stacklevel=2)
    return batch if ref_logprobs is None else with_ref_logprobs(batch, ref_logprobs)


def with_ref_logprobs(batch: Batch, ref_logprobs: Sequence[torch.Tensor]) -> Batch:
    """``batch`` with every sample's ``extras["ref_logprobs"]`` set from ``ref_logprobs`` (one
    per-token tensor per sample, in batch order: ``odcfn.log_probs(ref_state, batch)``)."""
    if isinstance(ref_logprobs, torch.Tensor) or len(ref_logprobs) != len(batch):
        got = "a tensor" if isinstance(ref_logprobs, torch.Tensor) else f"{len(ref_logprobs)} entries"
        raise ValueError(
            f"ref_logprobs must hold one per-token tensor per sample ({len(batch)} for "
            f"{len(batch) // 2} pairs), got {got}"
        )
    out = []
    for i, (s, ref) in enumerate(zip(batch.samples, ref_logprobs)):
        if not isinstance(ref, torch.Tensor) or ref.shape != s.tokens.shape:
            got = tuple(ref.shape) if isinstance(ref, torch.Tensor) else type(ref).__name__
            raise ValueError(
                f"{describe(batch, i)}: ref_logprobs has shape {got}, the sample has {s.length} tokens"
            )
        out.append(Sample(s.tokens, s.loss_mask, {**s.extras, "ref_logprobs": ref}))
    return Batch(tuple(out), step=batch.step, pairs=batch.pairs)


def describe(batch: Batch, i: int) -> str:
    """How errors name sample ``i``: by pair and member in a pair batch."""
    if batch.pairs:
        return f"preference pair {i // 2} {MEMBERS[i % 2]} (batch sample {i})"
    return f"batch sample {i}"


def prompt_of(s: Sample) -> torch.Tensor:
    """A member's prompt: its tokens before the first answer (``loss_mask`` 1) token."""
    if s.loss_mask is None:
        return s.tokens[:0]
    answer = torch.nonzero(s.loss_mask.bool())
    return s.tokens[: int(answer[0, 0]) if len(answer) else s.length]


def check_pairs(batch: Batch) -> None:
    """A ``ValueError`` naming the first pair with a member with no answer (loss) tokens (its
    sequence log-prob would be an empty sum and its length-normalised one undefined) or whose
    members differ in prompt (a preference compares two answers to ONE prompt: different
    prompts usually mean the pairs were zipped out of order). Purely local, so every rank
    raises it before any communication."""
    for k in range(len(batch) // 2):
        for i in (2 * k, 2 * k + 1):
            if batch.samples[i].num_loss_tokens == 0:
                raise ValueError(f"{describe(batch, i)} has no loss tokens: its loss_mask marks no answer")
        # as lists: the members' token dtypes may differ (int32 from a tokenizer, int64 by hand)
        pc, pr = (prompt_of(batch.samples[i]).tolist() for i in (2 * k, 2 * k + 1))
        if pc != pr:
            diff = next((t for t, (a, b) in enumerate(zip(pc, pr)) if a != b), None)
            where = (f"first differing token at position {diff}" if diff is not None
                     else f"{len(pc)} vs {len(pr)} prompt tokens")
            raise ValueError(
                f"preference pair {k} (batch samples {2 * k}, {2 * k + 1}): chosen and rejected differ "
                f"in prompt (the tokens before the first loss_mask=1 token; {where}): both members "
                "must answer the same prompt"
            )


def identical_pairs(batch: Batch) -> list[int]:
    """The pairs whose members hold the same tokens and loss mask."""
    out = []
    for k in range(len(batch) // 2):
        c, r = batch.samples[2 * k], batch.samples[2 * k + 1]
        if c.length == r.length and c.tokens.tolist() == r.tokens.tolist() and (
                c.loss_mask is None) == (r.loss_mask is None) and (
                c.loss_mask is None or c.loss_mask.bool().tolist() == r.loss_mask.bool().tolist()):
            out.append(k)
    return out


def schedule_lengths(batch: Batch, cap: int | None) -> tuple[tuple[int, ...], int]:
    """The lengths the balancer sees (one per pair in a pair batch) and the token cap (None:
    the longest unit); a ValueError naming a pair longer than the cap, before any
    communication."""
    if not batch.pairs:
        return batch.lengths, cap or max(batch.lengths)
    n = batch.lengths
    units = tuple(n[2 * k] + n[2 * k + 1] for k in range(len(n) // 2))
    if cap is None:
        return units, max(units)
    for k, u in enumerate(units):
        if u > cap:
            raise ValueError(
                f"preference pair {k} (samples {2 * k}, {2 * k + 1}) has {n[2 * k]} + {n[2 * k + 1]} = {u} "
                f"tokens, more than max_tokens_per_microbatch={cap}: a pair runs in one microbatch"
            )
    return units, cap


def expand_program(program: Iterator[Piece], batch: Batch) -> Iterator[Piece]:
    """A program over pair units as one over samples: unit ``k`` becomes samples ``2k, 2k + 1``
    (adjacent, chosen first). Lazy, so work stealing still decides each piece at run time."""
    if not batch.pairs:
        yield from program
        return
    for piece in program:
        mbs = tuple(tuple(i for k in mb for i in (2 * k, 2 * k + 1)) for mb in piece.microbatches)
        yield piece._replace(microbatches=mbs)
