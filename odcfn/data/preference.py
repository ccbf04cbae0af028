"""Preference records -> (chosen, rejected) sample pairs that train on the answers only.

One pair per row, in TRL's formats (``odcfn.data.formats``: the same token ids and targets as
TRL's ``DPOTrainer``), standard or conversational, the prompt explicit or implicit::

    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}                       # plain text
    {"prompt": [{"role": "user", "content": "2 + 2?"}],                            # conversational
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5"}]}
    {"chosen": "2 + 2 = 4", "rejected": "2 + 2 = 5"}                              # implicit prompt

Plain text: ``prompt + answer`` and the tokenizer's end-of-sequence token (which the model must
learn to emit, as TRL appends it), the tokens past the prompt the only targets. Conversational:
the tokenizer's own chat template renders ``prompt + answer``; the targets are the tokens past
the prompt rendered with the generation prompt (the answer's turns and whatever closes them), so
assistant turns inside the prompt's history are context, not targets.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from odcfn.batch import Sample

__all__ = ["odd_record", "read_preference_jsonl", "tokenize_pair", "warn_odd"]


def tokenize_pair(tok: Any, rec: Any, where: str = "record") -> tuple[Sample, Sample]:
    """One preference record -> ``(chosen, rejected)`` samples; a ValueError naming the record
    and column for anything else."""
    from odcfn.data.formats import detect_format, tokenize_pair_row

    if not isinstance(rec, Mapping):
        raise ValueError(f"{where}: expected an object with 'prompt', 'chosen' and 'rejected', got "
                         f"{type(rec).__name__}")
    return tokenize_pair_row(tok, detect_format(list(rec), where, "dpo"), rec, where)


def _empty(answer: Any) -> bool:
    if isinstance(answer, str):
        return not answer.strip()
    return isinstance(answer, list) and all(not str(m.get("content", "")).strip() for m in answer
                                            if isinstance(m, Mapping))


def odd_record(rec: Mapping[str, Any]) -> str | None:
    """Why a valid record trains without teaching anything, or None: chosen identical to
    rejected (the loss is a constant, ln 2 for ``sigmoid``, and its gradient zero) or an empty
    answer (only the end-of-sequence token or the template's end of turn is preferred or
    dispreferred). Named, not refused: a dataset may hold a few on purpose."""
    if rec["chosen"] == rec["rejected"]:
        return "chosen and rejected are identical"
    empty = [k for k in ("chosen", "rejected") if _empty(rec[k])]
    return f"{' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty" if empty else None


def warn_odd(odd: list[str], show: int = 5) -> str | None:
    """One line naming the odd pairs (``"file:line why"`` each), or None when there are none."""
    if not odd:
        return None
    more = f" and {len(odd) - show} more" if len(odd) > show else ""
    return (f"{len(odd)} odd pair(s): {'; '.join(odd[:show])}{more} (an identical pair adds a constant "
            "to the loss and nothing to the gradient; an empty answer prefers or rejects only the end of "
            "the answer)")


def read_preference_jsonl(
    path: str | os.PathLike, tokenizer_dir: str | os.PathLike, *, max_length: int | None = None
) -> list[tuple[Sample, Sample]]:
    """Every row's ``(chosen, rejected)`` pair (for ``odcfn.preference_batch``) of ``path`` (a
    file, a folder of shards or a datasets directory: ``odcfn.data.sources``), through the local
    tokenizer in ``tokenizer_dir``; errors name the file, row and column. A pair whose member is
    longer than ``max_length`` is an error (not silently truncated). Odd pairs (``odd_record``)
    are named in one warning."""
    from odcfn.data.chat import load_tokenizer
    from odcfn.data.readers import iter_pairs

    pairs, odd = [], []
    for row, pair in iter_pairs(path, load_tokenizer(tokenizer_dir)):
        why = odd_record(row.rec)
        if why is not None:
            odd.append(f"{row.where} {why}")
        for k, s in zip(("chosen", "rejected"), pair):
            if max_length is not None and s.length > max_length:
                raise ValueError(f"{row.where} {k}: {s.length} tokens, more than max_length={max_length}")
        pairs.append(pair)
    line = warn_odd(odd)
    if line is not None:
        warnings.warn(f"read_preference_jsonl: {line}", UserWarning, stacklevel=2)
    return pairs
