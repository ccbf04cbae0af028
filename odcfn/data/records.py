"""SFT data: files of token-id samples with loss masks -> deterministic minibatches.

One sample per JSONL line (or parquet row)::

    {"input_ids": [1, 5, 9, 2], "loss_mask": [0, 0, 1, 1]}
    {"input_ids": [1, 7, 3],    "labels": [-100, 7, 3]}

``loss_mask[t] = 1`` makes token ``t`` a prediction target (predicted from ``t - 1``); a
Hugging Face style ``labels`` column (``-100`` = ignored) is accepted instead. Neither: every
token after the first is a target.

Those three are every field a token record is read for. Per-token extras (``Sample.extras``:
routing replay's ``routed_experts``, a policy-gradient loss's ``advantages`` / ``old_logprobs`` /
``prox_logprobs`` / ``ref_logprobs``) are not read from data files: they come from the code that
builds the samples (the RL loop, the rollout engine). A record that carries one is refused, naming
its line (it was meant to count); any other field (an id, a source) is named once per file in a
warning, with how many lines have it and the first, and otherwise ignored.

Minibatches are a pure function of ``(dataset, step)``: epoch ``step // steps_per_epoch`` is a
permutation seeded by ``(seed, epoch)``. Resuming at step ``k`` therefore needs nothing but
``k``, and every rank computes the same minibatch (and so the same balance) without talking.

Chat transcripts (``{"messages": [...]}``) with a tokenizer: ``odcfn.data.chat``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from odcfn._check import check_int, is_int
from odcfn.batch import Batch, Sample
from odcfn.data.dataset import TokenDataset

__all__ = [
    "TokenDataset",
    "UnreadFields",
    "batch_at",
    "batch_indices",
    "epoch_order",
    "iterate_batches",
    "read_dataset",
    "read_jsonl",
    "read_parquet",
    "steps_per_epoch",
    "synthetic_records",
    "write_jsonl",
]

IGNORE_INDEX = -100
FIELDS = ("input_ids", "loss_mask", "labels")  # what a token record is read for
# the library's per-token extras (Sample.extras), which data files do not carry: refused by name
EXTRA_FIELDS = ("routed_experts", "advantages", "old_logprobs", "prox_logprobs", "ref_logprobs")


class UnreadFields:
    """The unknown fields of one file's records: how many records have each, and the first."""

    def __init__(self, path: Any) -> None:
        self.path, self.seen = path, {}  # field -> [count, first where]

    def add(self, rec: Any, where: str) -> None:
        if not isinstance(rec, Mapping):
            return
        for k in rec:
            if k in EXTRA_FIELDS:
                raise ValueError(
                    f"{where}: field {k!r} is a per-token extra (odcfn.Sample extras[{k!r}]), which token "
                    "data files do not carry: a record is read for input_ids, loss_mask or labels only. "
                    "Build the samples in code to use it (odcfn.Sample(tokens, loss_mask, extras={...})), "
                    "or drop the field"
                )
            if k not in FIELDS:
                self.seen.setdefault(k, [0, where])[0] += 1

    def warn(self) -> None:
        """One warning naming every unknown field (none: nothing said)."""
        if not self.seen:
            return
        named = ", ".join(f"{k!r} ({n} line{'s' if n != 1 else ''}, first {w})"
                          for k, (n, w) in self.seen.items())
        warnings.warn(f"{self.path}: fields not read: {named}; a token record is read for input_ids, "
                      "loss_mask or labels only (docs/sft.md)", UserWarning, stacklevel=3)


def record_to_sample(rec: Any, where: str, vocab_size: int | None, max_length: int | None) -> Sample:
    if not isinstance(rec, Mapping):
        raise ValueError(f"{where}: expected an object with 'input_ids', got {type(rec).__name__}")
    ids = rec.get("input_ids")
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError(f"{where}: 'input_ids' must be a non-empty list of token ids")
    if not all(is_int(t) for t in ids):
        raise ValueError(f"{where}: 'input_ids' must hold integers only")
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        raise ValueError(f"{where}: token ids span [{lo}, {hi}], outside [0, {vocab_size or 'inf'})")
    if max_length is not None and len(ids) > max_length:
        raise ValueError(f"{where}: sample has {len(ids)} tokens, more than max_length={max_length}")
    mask = rec.get("loss_mask")
    labels = rec.get("labels")
    if mask is not None and labels is not None:
        raise ValueError(f"{where}: give 'loss_mask' or 'labels', not both")
    if labels is not None:
        if not isinstance(labels, (list, tuple)):
            raise ValueError(f"{where}: 'labels' must be a list")
        mask = [int(x != IGNORE_INDEX) for x in labels]
    if mask is not None:
        if not isinstance(mask, (list, tuple)) or len(mask) != len(ids):
            got = len(mask) if isinstance(mask, (list, tuple)) else type(mask).__name__
            raise ValueError(f"{where}: loss mask has length {got}, input_ids has {len(ids)}")
        if any(m not in (0, 1, True, False) for m in mask):
            raise ValueError(f"{where}: 'loss_mask' must hold 0/1 values")
        mask_t = torch.tensor([bool(m) for m in mask], dtype=torch.bool)
    else:
        mask_t = None
    return Sample(torch.tensor(ids, dtype=torch.int32), mask_t)


def jsonl_records(path: str | os.PathLike) -> Iterator[tuple[int, str, Any]]:
    """``(line number, "file:line", record)`` for every non-blank line of a JSONL file; a line that
    is not UTF-8 or not JSON is a ValueError naming its file and line."""
    with open(path, "rb") as f:  # bytes: a bad byte is reported with its line, not the file's offset
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                why = f"byte {e.start + 1} of the line: {e.reason}"
                raise ValueError(f"{where}: not valid UTF-8 ({why})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            yield lineno, where, rec


def read_jsonl(
    path: str | os.PathLike, *, vocab_size: int | None = None, max_length: int | None = None
) -> TokenDataset:
    """Samples from a JSONL file; errors name the file and line."""
    samples, lines, unread = [], [], UnreadFields(path)
    for lineno, where, rec in jsonl_records(path):
        unread.add(rec, where)
        samples.append(record_to_sample(rec, where, vocab_size, max_length))
        lines.append(lineno)
    unread.warn()
    return TokenDataset(tuple(samples), str(path), tuple(lines))


def read_parquet(
    path: str | os.PathLike, *, vocab_size: int | None = None, max_length: int | None = None
) -> TokenDataset:
    """Samples from a parquet file with an ``input_ids`` list column (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    rows = pq.read_table(path).to_pylist()
    unread, samples = UnreadFields(path), []
    for i, r in enumerate(rows):
        rec = {k: v for k, v in r.items() if v is not None}
        unread.add(rec, f"{path}: row {i}")
        samples.append(record_to_sample(rec, f"{path}: row {i}", vocab_size, max_length))
    unread.warn()
    return TokenDataset(tuple(samples), str(path), tuple(range(len(samples))))


def read_dataset(
    path: str | os.PathLike, *, vocab_size: int | None = None, max_length: int | None = None
) -> TokenDataset:
    """``.jsonl``/``.json`` or ``.parquet``, by suffix."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return read_jsonl(path, vocab_size=vocab_size, max_length=max_length)
    if suffix in (".parquet", ".pq"):
        return read_parquet(path, vocab_size=vocab_size, max_length=max_length)
    raise ValueError(f"{path}: unknown data format {suffix!r}; use .jsonl or .parquet")


def write_jsonl(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> Path:
    """Write records (dicts with ``input_ids`` and optional ``loss_mask``) one per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps({k: list(map(int, v)) for k, v in rec.items()}) + "\n")
    return path


def synthetic_records(
    lengths: Sequence[int], vocab_size: int, *, prompt_fraction: float = 0.3, seed: int = 0
) -> list[dict[str, list[int]]]:
    """SFT-shaped records: a prompt (masked out) followed by a response (trained on)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, vocab_size, (int(n),), generator=g).tolist()
        prompt = min(int(n) - 1, max(1, round(prompt_fraction * int(n))))
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (int(n) - prompt)})
    return out


# --- minibatches -------------------------------------------------------------------------------


def steps_per_epoch(dataset: TokenDataset, batch_size: int, *, drop_last: bool = True) -> int:
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = len(dataset) // batch_size if drop_last else -(-len(dataset) // batch_size)
    if n == 0:
        raise ValueError(f"dataset has {len(dataset)} samples, fewer than batch_size={batch_size}")
    return n


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The order in which epoch ``epoch`` visits ``n`` samples."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def batch_at(
    dataset: TokenDataset,
    step: int,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Batch:
    """The minibatch of global step ``step`` (0-based): a pure function of its arguments."""
    ids = batch_indices(dataset, step, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
    return Batch(tuple(dataset.samples[j] for j in ids))


def batch_indices(
    dataset: TokenDataset,
    step: int,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
) -> list[int]:
    """The dataset indices of ``batch_at``'s minibatch (without building it)."""
    check_int(step, "step", at_least=0)
    per_epoch = steps_per_epoch(dataset, batch_size, drop_last=drop_last)
    epoch, i = divmod(step, per_epoch)
    order = epoch_order(len(dataset), epoch, seed, shuffle)
    return order[i * batch_size : (i + 1) * batch_size]


def iterate_batches(
    dataset: TokenDataset,
    batch_size: int,
    *,
    start_step: int = 0,
    num_steps: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Iterator[tuple[int, Batch]]:
    """``(step, batch)`` from ``start_step`` on (forever when ``num_steps`` is None)."""
    step = start_step
    while num_steps is None or step < start_step + num_steps:
        yield step, batch_at(dataset, step, batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
        step += 1
