"""``odcfn train``'s data, read and checked once before any rank starts: every sample against
the model's vocabulary and the length limit (``data.max_length`` and the microbatch cap), every
minibatch of the run for loss tokens. A problem is reported with its ``file:line`` before the
first step, not at the step that would have hit it; ``data.long_samples`` ("truncate" /
"drop") and ``data.skip_empty_minibatches`` choose what to do instead of stopping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from odcfn.batch import Sample
from odcfn.data.dataset import TokenDataset
from odcfn.sft.config import SFTConfig

__all__ = ["PreparedData", "length_limit", "prepare_data"]

_SHOW = 5  # data lines named in a message


@dataclass(frozen=True)
class PreparedData:
    """The dataset a run trains on and what was done to it (for the run's summary)."""

    dataset: TokenDataset
    per_epoch: int
    truncated: tuple[str, ...] = ()  # file:line of each sample cut to the length limit
    dropped: tuple[str, ...] = ()  # file:line of each sample left out for its length
    skip_steps: frozenset[int] = field(default_factory=frozenset)  # 0-based steps without loss tokens

    def batch(self, step: int, d: Any) -> Any:
        """Step ``step``'s minibatch (``d``: the ``[data]`` section): a pure function of the step."""
        from odcfn.data.records import batch_at

        return batch_at(self.dataset, step, d.batch_size, seed=d.seed, shuffle=d.shuffle)

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


def _read(cfg: SFTConfig, vocab_size: int) -> TokenDataset:
    d = cfg.data
    if d.tokenizer:  # chat transcripts, tokenized once and cached
        from odcfn.data.chat import read_chat_jsonl

        return read_chat_jsonl(d.path, d.tokenizer, vocab_size=vocab_size, cache_dir=d.cache_dir)
    from odcfn.data.records import read_dataset

    return read_dataset(d.path, vocab_size=vocab_size)


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
    lines = data.lines or tuple(range(len(data)))
    keep: list[Sample] = []
    kept_lines: list[int] = []
    for i, s in enumerate(data.samples):
        if s.length > limit:
            if policy == "drop":
                continue
            mask = None if s.loss_mask is None else s.loss_mask[:limit]
            s = Sample(s.tokens[:limit], mask)
        keep.append(s)
        kept_lines.append(lines[i])
    if not keep:
        raise ValueError(f"{data.source}: every sample is longer than {key}={limit}: nothing to train on")
    out = TokenDataset(tuple(keep), data.source, tuple(kept_lines) if data.lines is not None else None)
    return out, (where if policy == "truncate" else []), (where if policy == "drop" else [])


def _empty_steps(cfg: SFTConfig, data: TokenDataset, per_epoch: int) -> frozenset[int]:
    """The steps of ``[0, train.steps)`` whose minibatch has no loss token: an error naming the
    first one, or (``data.skip_empty_minibatches``) the set to skip."""
    from odcfn.data.records import epoch_order

    if all(s.num_loss_tokens > 0 for s in data.samples):
        return frozenset()  # the usual case: no minibatch can be empty
    d, b = cfg.data, cfg.data.batch_size
    empty: set[int] = set()
    order: list[int] = []
    for step in range(cfg.train.steps):
        epoch, i = divmod(step, per_epoch)
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

    data, truncated, dropped = _fit_lengths(cfg, _read(cfg, vocab_size))
    try:
        per_epoch = steps_per_epoch(data, cfg.data.batch_size)
    except ValueError as e:
        raise ValueError(f"{cfg.data.path}: {e} (data.batch_size)") from None
    skip = _empty_steps(cfg, data, per_epoch)
    return PreparedData(data, per_epoch, tuple(truncated), tuple(dropped), skip)
