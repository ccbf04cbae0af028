"""``odcfn train``'s preference data (``train.task = "dpo"``): TRL-format prompt/chosen/rejected
JSONL through the local tokenizer (``odcfn.data.preference``), read and checked once before any
rank starts like the SFT data (``odcfn.sft.prepare``), and the minibatch of every step as an
``odcfn.preference_batch`` of ``data.batch_size`` pairs, with the reference log-probs attached
once the reference pass (``odcfn.sft.ref_logprobs``) has filled them in."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from odcfn.batch import Batch, Sample
from odcfn.data.dataset import TokenDataset
from odcfn.sft.config import SFTConfig

__all__ = ["PreparedPairs", "prepare_pairs"]

_SHOW = 5


@dataclass(frozen=True)
class PreparedPairs:
    """The pairs a preference run trains on (``PreparedData``'s counterpart: the loop, the
    opening lines and the summary read the same attributes)."""

    pairs: tuple[tuple[Sample, Sample], ...]
    source: str
    lines: tuple[int, ...]  # each pair's 1-based line in the file
    per_epoch: int
    dropped: tuple[str, ...] = ()  # file:line of each pair left out for its length
    odd: tuple[str, ...] = ()  # "file:line why" of each pair that teaches nothing (odd_record)
    # the reference's per-token log-probs of every sample (chosen_0, rejected_0, ...); None until
    # the reference pass, and for reference-free losses
    ref: tuple[torch.Tensor, ...] | None = None
    truncated: tuple[str, ...] = ()  # never: a cut answer is refused by the config
    skip_steps: frozenset[int] = field(default_factory=frozenset)  # never: every member has an answer

    @property
    def samples(self) -> tuple[Sample, ...]:
        return tuple(s for pair in self.pairs for s in pair)

    @property
    def dataset(self) -> TokenDataset:
        """The members as one dataset (``chosen_0, rejected_0, ...``): sizes for the opening lines."""
        return TokenDataset(self.samples, self.source, tuple(n for n in self.lines for _ in (0, 1)))

    def tokens_sha256(self) -> str:
        """A digest of every member's tokens and targets: the reference cache's key covers what
        the tokenizer and the length policy made of the file, not only its bytes."""
        h = hashlib.sha256()
        for s in self.samples:
            h.update(s.length.to_bytes(8, "little"))
            h.update(s.tokens.to(torch.int64).numpy().tobytes())
            mask = torch.ones(s.length, dtype=torch.bool) if s.loss_mask is None else s.loss_mask.bool()
            h.update(mask.numpy().tobytes())
        return h.hexdigest()

    def indices(self, step: int, batch_size: int, seed: int, shuffle: bool) -> list[int]:
        """The pair indices of step ``step``'s minibatch: a pure function of the step, as for SFT."""
        from odcfn.data.records import epoch_order

        epoch, i = divmod(step, self.per_epoch)
        return epoch_order(len(self.pairs), epoch, seed, shuffle)[i * batch_size:(i + 1) * batch_size]

    def batch(self, step: int, d: Any) -> Batch:
        """Step ``step``'s minibatch (``d``: the ``[data]`` section)."""
        from odcfn.preference import with_ref_logprobs

        ids = self.indices(step, d.batch_size, d.seed, d.shuffle)
        ref = None if self.ref is None else [self.ref[2 * k + m] for k in ids for m in (0, 1)]
        # preference_batch's checks ran when the file was read (prepare_pairs), and odd pairs were
        # named once in the opening lines: not again by every rank at every step
        batch = Batch(tuple(s for k in ids for s in self.pairs[k]), pairs=True)
        return batch if ref is None else with_ref_logprobs(batch, ref)

    def report(self) -> dict[str, Any]:
        return {"samples": 2 * len(self.pairs), "pairs": len(self.pairs), "truncated": [],
                "dropped": list(self.dropped), "skipped_steps": []}


def _names(where: list[str]) -> str:
    more = f" and {len(where) - _SHOW} more" if len(where) > _SHOW else ""
    return ", ".join(where[:_SHOW]) + more


def _too_long(cfg: SFTConfig, pair: tuple[Sample, Sample]) -> str | None:
    """Why ``pair`` does not fit, or None: each member within ``data.max_length``, both within
    one microbatch (a pair always runs in one: ``odcfn.preference``)."""
    c, r = pair
    m, cap = cfg.data.max_length, cfg.train.max_tokens_per_microbatch
    if m is not None and max(c.length, r.length) > m:
        return f"a member has {max(c.length, r.length)} tokens, more than data.max_length={m}"
    if cap is not None and c.length + r.length > cap:
        return (f"the pair has {c.length} + {r.length} tokens, more than train.max_tokens_per_microbatch="
                f"{cap} (a pair runs in one microbatch)")
    return None


def prepare_pairs(cfg: SFTConfig, vocab_size: int) -> PreparedPairs:
    """Read and check every pair of ``data.path`` (file:line named for each problem)."""
    from odcfn.data.chat import load_tokenizer
    from odcfn.data.preference import odd_record, tokenize_pair
    from odcfn.data.records import jsonl_records
    from odcfn.preference import check_pairs

    d = cfg.data
    tok = load_tokenizer(d.tokenizer)
    pairs, lines, long, odd = [], [], [], []
    for lineno, where, rec in jsonl_records(d.path):
        pair = tokenize_pair(tok, rec, where)
        try:  # named by line now, as read_preference_jsonl does: not by a pair index mid-run
            check_pairs(Batch(pair, pairs=True))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        for member, s in zip(("chosen", "rejected"), pair):
            top = int(s.tokens.max())
            if top >= vocab_size:
                raise ValueError(f"{where} {member}: token id {top} is >= the model's vocab_size "
                                 f"{vocab_size} (data.tokenizer does not fit the model)")
        why = _too_long(cfg, pair)
        if why is not None:
            long.append((where, why))
            continue
        strange = odd_record(rec)
        if strange is not None:  # trained, and named in the opening lines
            odd.append(f"{where} {strange}")
        pairs.append(pair)
        lines.append(lineno)
    if long and d.long_samples == "error":
        raise ValueError(f"{long[0][0]}: {long[0][1]} ({len(long)} such pair(s): "
                         f"{_names([w for w, _ in long])}); raise the limit, or set "
                         "data.long_samples = \"drop\"")
    dropped = [w for w, _ in long]
    if not pairs:
        what = "every pair is too long" if long else "no pairs"
        raise ValueError(f"{d.path}: {what}: nothing to train on")
    per_epoch = len(pairs) // d.batch_size
    if per_epoch == 0:
        raise ValueError(f"{d.path}: {len(pairs)} pair(s), fewer than data.batch_size = {d.batch_size} "
                         "(pairs per minibatch with train.task = \"dpo\")")
    return PreparedPairs(tuple(pairs), d.path, tuple(lines), per_epoch, tuple(dropped), odd=tuple(odd))
