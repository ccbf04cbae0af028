"""``odcfn train``'s data, read and checked once before any rank starts: every sample against
the model's vocabulary and the length limit (``data.max_length`` and the microbatch cap), every
minibatch of the run for loss tokens. A problem is reported with its ``file:line`` before the
first step, not at the step that would have hit it; ``data.long_samples`` ("truncate" /
"drop") and ``data.skip_empty_minibatches`` choose what to do instead of stopping.

The data is read wherever it lives and in whichever TRL format its columns name
(``odcfn.data.readers``); ``[[data.sources]]`` are read and fitted one by one, then mixed by
weight (``odcfn.data.mixture``); ``data.eval_path`` is read and checked the same way (and must
have loss tokens), kept for the evaluation."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from odcfn.batch import Sample
from odcfn.data.dataset import TokenDataset
from odcfn.sft.config import SFTConfig

__all__ = ["PreparedData", "length_limit", "prepare_data", "prepare_quietly"]

_SHOW = 5  # data lines named in a message


@dataclass(frozen=True)
class PreparedData:
    """The dataset a run trains on and what was done to it (for the run's summary)."""

    dataset: TokenDataset
    per_epoch: int
    truncated: tuple[str, ...] = ()  # file:line of each sample cut to the length limit
    dropped: tuple[str, ...] = ()  # file:line of each sample left out for its length
    skip_steps: frozenset[int] = field(default_factory=frozenset)  # 0-based steps without loss tokens
    mixture: Any = None  # [[data.sources]]: an odcfn.data.mixture.Mixture over their concatenation
    eval: TokenDataset | None = None  # data.eval_path, read and checked
    formats: tuple[str, ...] = ()  # each source's format (odcfn.data.formats.FORMATS)

    def indices(self, step: int, d: Any) -> list[int]:
        """The dataset indices of step ``step``'s minibatch (``d``: the ``[data]`` section)."""
        if self.mixture is not None:
            return self.mixture.indices(step)
        from odcfn.data.records import batch_indices

        return batch_indices(self.dataset, step, d.batch_size, seed=d.seed, shuffle=d.shuffle)

    def batch(self, step: int, d: Any) -> Any:
        """Step ``step``'s minibatch (``d``: the ``[data]`` section): a pure function of the step."""
        from odcfn.batch import Batch

        return Batch(tuple(self.dataset.samples[j] for j in self.indices(step, d)))

    def report(self) -> dict[str, Any]:
        return {
            "samples": len(self.dataset),
            "truncated": list(self.truncated),
            "dropped": list(self.dropped),
            "skipped_steps": sorted(s + 1 for s in self.skip_steps),  # 1-based, like the metrics
        }


def length_limit(cfg: SFTConfig) -> tuple[int | None, str]:
    """The longest sample a run can train on and the setting that sets it: a sample must fit
    one microbatch (``train.max_tokens_per_microbatch``) and ``data.max_length``."""
    limits = [(cfg.data.max_length, "data.max_length"),
              (cfg.train.max_tokens_per_microbatch, "train.max_tokens_per_microbatch")]
    limits = [(n, k) for n, k in limits if n is not None]
    return min(limits) if limits else (None, "")


def _read(cfg: SFTConfig, path: str, vocab_size: int) -> TokenDataset:
    """Token records as they are; TRL's text formats through data.tokenizer, tokenized once and cached."""
    from odcfn.data.readers import read_sft

    d = cfg.data
    return read_sft(path, d.tokenizer, vocab_size=vocab_size, cache_dir=d.cache_dir)


def _names(where: list[str]) -> str:
    more = f" and {len(where) - _SHOW} more" if len(where) > _SHOW else ""
    return ", ".join(where[:_SHOW]) + more


def _fit_lengths(cfg: SFTConfig, data: TokenDataset) -> tuple[TokenDataset, list[str], list[str]]:
    limit, key = length_limit(cfg)
    if limit is None:
        return data, [], []
    long = [i for i, s in enumerate(data.samples) if s.length > limit]
    if not long:
        return data, [], []
    where = [data.where(i) for i in long]
    policy = cfg.data.long_samples
    if policy == "error":
        raise ValueError(
            f"{where[0]}: sample has {data.samples[long[0]].length} tokens, more than {key}={limit} "
            f"({len(long)} such sample(s): {_names(where)}); raise {key}, or set "
            'data.long_samples = "truncate" or "drop"'
        )
    keep: list[Sample] = []
    kept: list[Any] = []  # where each kept sample came from
    for i, s in enumerate(data.samples):
        if s.length > limit:
            if policy == "drop":
                continue
            mask = None if s.loss_mask is None else s.loss_mask[:limit]
            s = Sample(s.tokens[:limit], mask)
        keep.append(s)
        kept.append(data.origin(i))
    if not keep:
        raise ValueError(f"{data.source}: every sample is longer than {key}={limit}: nothing to train on")
    out = TokenDataset.from_origins(tuple(keep), data.source, kept)
    return out, (where if policy == "truncate" else []), (where if policy == "drop" else [])


def _empty_steps(cfg: SFTConfig, prepared: PreparedData) -> frozenset[int]:
    """The steps of ``[0, train.steps)`` whose minibatch has no loss token: an error naming the
    first one, or (``data.skip_empty_minibatches``) the set to skip."""
    from odcfn.data.records import epoch_order

    data, per_epoch = prepared.dataset, prepared.per_epoch
    if all(s.num_loss_tokens > 0 for s in data.samples):
        return frozenset()  # the usual case: no minibatch can be empty
    d, b = cfg.data, cfg.data.batch_size
    empty: set[int] = set()
    order: list[int] = []
    for step in range(cfg.train.steps):
        epoch, i = divmod(step, per_epoch)
        if prepared.mixture is not None:
            ids = prepared.mixture.indices(step)
        else:  # one permutation per epoch, not one per step
            if i == 0 or not order:
                order = epoch_order(len(data), epoch, d.seed, d.shuffle)
            ids = order[i * b : (i + 1) * b]
        if all(data.samples[j].num_loss_tokens == 0 for j in ids):
            if not d.skip_empty_minibatches:
                raise ValueError(
                    f"data: the minibatch of step {step + 1} ({_names([data.where(j) for j in ids])}) "
                    "has no loss tokens, so it has no loss to train on; fix those lines' loss masks, "
                    "or set data.skip_empty_minibatches = true to skip such steps"
                )
            empty.add(step)
    return frozenset(empty)


def prepare_data(cfg: SFTConfig, vocab_size: int) -> Any:
    """Read ``cfg.data.path`` and check all of it against ``cfg`` (see the module docstring);
    ``train.task = "dpo"``: its preference pairs (``odcfn.sft.preference.PreparedPairs``);
    ``"rl"``: its prompts (``odcfn.sft.rl_data.PreparedPrompts``)."""
    from odcfn.data.records import steps_per_epoch

    if cfg.train.task == "dpo":
        from odcfn.sft.preference import prepare_pairs

        return prepare_pairs(cfg, vocab_size)
    if cfg.train.task == "rl":  # prompts (odcfn.sft.rl_data)
        from odcfn.sft.rl_data import prepare_prompts

        return prepare_prompts(cfg, vocab_size)

    from odcfn.data.readers import first_format

    d = cfg.data
    parts, truncated, dropped, formats = [], [], [], []
    for src in d.sources or [{"path": d.path, "weight": 1.0}]:
        data, cut, left = _fit_lengths(cfg, _read(cfg, src["path"], vocab_size))
        parts.append(data)
        truncated += cut
        dropped += left
        formats.append(first_format(src["path"]))
    if d.sources:
        from odcfn.data.mixture import Mixture

        data = TokenDataset.from_origins(tuple(s for p in parts for s in p.samples), "data.sources",
                                         [p.origin(i) for p in parts for i in range(len(p))])
        mixture = Mixture([len(p) for p in parts], [s["weight"] for s in d.sources], d.batch_size,
                          seed=d.seed, shuffle=d.shuffle)
        per_epoch = max(1, len(data) // d.batch_size)  # nominal: a mixture repeats small sources
    else:
        mixture = None
        try:
            per_epoch = steps_per_epoch(data, d.batch_size)
        except ValueError as e:
            raise ValueError(f"{d.path}: {e} (data.batch_size)") from None
    prepared = PreparedData(data, per_epoch, tuple(truncated), tuple(dropped), mixture=mixture,
                            eval=_read_eval(cfg, vocab_size), formats=tuple(formats))
    return replace(prepared, skip_steps=_empty_steps(cfg, prepared))


def _read_eval(cfg: SFTConfig, vocab_size: int) -> TokenDataset | None:
    """``data.eval_path`` read like the training data (the same length policy), with loss tokens."""
    path = cfg.data.eval_path
    if path is None:
        return None
    data, _, _ = _fit_lengths(cfg, _read(cfg, path, vocab_size))
    if sum(s.num_loss_tokens for s in data.samples) == 0:
        raise ValueError(
            f"{data.where(0)}: data.eval_path {path} has no loss tokens: none of its {len(data)} rows "
            f"({_names([data.where(i) for i in range(len(data))])}) has a target after its first token "
            "(its 'loss_mask' / 'labels' columns are all 0), so its loss would be 0/0; give a held-out "
            "set with targets"
        )
    return data


def prepare_quietly(cfg: SFTConfig, vocab_size: int) -> Any:
    """``prepare_data`` without its warnings (fields not read, ...): for a rank process whose data
    the launcher, or torchrun's rank 0, read and named once already. Only in a process of its own:
    the filter is process-wide (threads ranks take the launcher's data and read nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepare_data(cfg, vocab_size)
