"""``odcfn train``'s preference data (``train.task = "dpo"``): TRL-format prompt/chosen/rejected
rows (``odcfn.data.formats``; a file, a folder of shards or a datasets directory) through the
local tokenizer, read and checked once before any rank starts like the SFT data
(``odcfn.sft.prepare``), and the minibatch of every step as an ``odcfn.preference_batch`` of
``data.batch_size`` pairs, with the reference log-probs attached once the reference
pass (``odcfn.sft.ref_logprobs``) has filled them in."""

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
    # the reference's per-token log-probs of every sample (chosen_0, rejected_0, ...); None until
    # the reference pass, and for reference-free losses
    ref: tuple[torch.Tensor, ...] | None = None
    truncated: tuple[str, ...] = ()  # never: a cut answer is refused by the config
    skip_steps: frozenset[int] = field(default_factory=frozenset)  # never: every member has an answer
    odd: tuple[str, ...] = ()  # "file:line why" of each pair that teaches nothing (odd_record)
    eval: tuple[tuple[Sample, Sample], ...] | None = None  # data.eval_path's pairs, read and checked
    eval_ref: tuple[torch.Tensor, ...] | None = None  # their reference log-probs ([eval], odcfn.sft.evaluate)

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


def _read_pairs(cfg: SFTConfig, path: str, vocab_size: int, tok: Any) -> tuple[list, list, list[str], list]:
    """Every pair of ``path`` that fits, its line (or row), where each pair too long was, and the
    odd pairs (``odcfn.data.preference.odd_record``: trained, and named in the opening lines)."""
    from odcfn.data.preference import odd_record
    from odcfn.data.readers import iter_pairs

    d = cfg.data
    pairs, lines, long, odd = [], [], [], []
    for row, pair in iter_pairs(path, tok):
        for member, s in zip(("chosen", "rejected"), pair):
            top = int(s.tokens.max())
            if top >= vocab_size:
                raise ValueError(f"{row.where} {member}: token id {top} is >= the model's vocab_size "
                                 f"{vocab_size} (data.tokenizer does not fit the model)")
        why = _too_long(cfg, pair)
        if why is not None:
            long.append((row.where, why))
            continue
        strange = odd_record(row.rec)
        if strange is not None:
            odd.append(f"{row.where} {strange}")
        pairs.append(pair)
        lines.append(row.line)
    if long and d.long_samples == "error":
        raise ValueError(f"{long[0][0]}: {long[0][1]} ({len(long)} such pair(s): "
                         f"{_names([w for w, _ in long])}); raise the limit, or set "
                         "data.long_samples = \"drop\"")
    if not pairs:
        what = "every pair is too long" if long else "no pairs"
        raise ValueError(f"{path}: {what}: nothing to train on")
    return pairs, lines, [w for w, _ in long], odd


def prepare_pairs(cfg: SFTConfig, vocab_size: int) -> PreparedPairs:
    """Read and check every pair of ``data.path`` (file:line, or file: row, named for each
    problem), and of ``data.eval_path`` when it is given."""
    from odcfn.data.chat import load_tokenizer

    d = cfg.data
    tok = load_tokenizer(d.tokenizer)
    pairs, lines, dropped, odd = _read_pairs(cfg, d.path, vocab_size, tok)
    per_epoch = len(pairs) // d.batch_size
    if per_epoch == 0:
        raise ValueError(f"{d.path}: {len(pairs)} pair(s), fewer than data.batch_size = {d.batch_size} "
                         "(pairs per minibatch with train.task = \"dpo\")")
    # a held-out pair always has loss tokens: an empty answer is refused by its row
    held_out = tuple(_read_pairs(cfg, d.eval_path, vocab_size, tok)[0]) if d.eval_path else None
    return PreparedPairs(tuple(pairs), d.path, tuple(lines), per_epoch, tuple(dropped), odd=tuple(odd),
                         eval=held_out)
