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
from collections.abc import Mapping
from typing import Any

from odcfn.batch import Sample

__all__ = ["read_preference_jsonl", "tokenize_pair"]


def tokenize_pair(tok: Any, rec: Any, where: str = "record") -> tuple[Sample, Sample]:
    """One preference record -> ``(chosen, rejected)`` samples; a ValueError naming the record
    and column for anything else."""
    from odcfn.data.formats import detect_format, tokenize_pair_row

    if not isinstance(rec, Mapping):
        raise ValueError(f"{where}: expected an object with 'prompt', 'chosen' and 'rejected', got "
                         f"{type(rec).__name__}")
    return tokenize_pair_row(tok, detect_format(list(rec), where, "dpo"), rec, where)


def read_preference_jsonl(
    path: str | os.PathLike, tokenizer_dir: str | os.PathLike, *, max_length: int | None = None
) -> list[tuple[Sample, Sample]]:
    """Every row's ``(chosen, rejected)`` pair (for ``odcfn.preference_batch``) of ``path`` (a
    file, a folder of shards or a datasets directory: ``odcfn.data.sources``), through the local
    tokenizer in ``tokenizer_dir``; errors name the file, row and column. A pair whose member is
    longer than ``max_length`` is an error (not silently truncated)."""
    from odcfn.data.chat import load_tokenizer
    from odcfn.data.readers import iter_pairs

    pairs = []
    for row, pair in iter_pairs(path, load_tokenizer(tokenizer_dir)):
        for k, s in zip(("chosen", "rejected"), pair):
            if max_length is not None and s.length > max_length:
                raise ValueError(f"{row.where} {k}: {s.length} tokens, more than max_length={max_length}")
        pairs.append(pair)
    return pairs
