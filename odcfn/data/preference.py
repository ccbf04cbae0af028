"""Preference records -> (chosen, rejected) sample pairs that train on the answers only.

One pair per JSONL line, in TRL's two formats::

    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5"}                       # plain text
    {"prompt": [{"role": "user", "content": "2 + 2?"}],                            # conversational
     "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "5"}]}

Plain text: the prompt's tokens then the answer's, the answer (and the tokenizer's end-of-sequence
token, which the model must learn to emit, as TRL appends it) the only targets. Conversational:
the tokenizer's own chat template renders ``prompt + answer``; the targets are the tokens past
the prompt rendered with the generation prompt (the answer's turns and whatever closes them), so
assistant turns inside the prompt's history are context, not targets. A template under which the
prompt does not render as a prefix is refused for that line rather than guessed at.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from odcfn.batch import Batch, Sample
from odcfn.data.chat import load_tokenizer
from odcfn.data.records import jsonl_records
from odcfn.preference.pairs import check_pairs

__all__ = ["odd_record", "read_preference_jsonl", "tokenize_pair", "warn_odd"]

FIELDS = ("prompt", "chosen", "rejected")


def _render(tok: Any, msgs: list, gen: bool) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def _messages(msgs: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: must be a non-empty list of messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
            raise ValueError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return [dict(m) for m in msgs]


def _plain(tok: Any, prompt: str, answer: str, where: str) -> Sample:
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        a = a + [tok.eos_token_id]
    if not p or not a:
        raise ValueError(f"{where}: the prompt or the answer tokenizes to nothing")
    ids = torch.tensor(p + a, dtype=torch.int32)
    return Sample(ids, torch.arange(len(ids)) >= len(p))


def _chat(tok: Any, prompt: list, answer: list, where: str) -> Sample:
    before = _render(tok, prompt, True)
    text = _render(tok, prompt + answer, False)
    if not text.startswith(before):
        raise ValueError(
            f"{where}: the chat template does not render the prompt as a prefix of prompt + answer"
        )
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [b > len(before) for _, b in enc["offset_mapping"]]  # a token reaching into the answer
    if not any(mask[1:]):
        raise ValueError(f"{where}: no answer token after the first token: nothing to train on")
    return Sample(torch.tensor(enc["input_ids"], dtype=torch.int32), torch.tensor(mask))


def tokenize_pair(tok: Any, rec: Any, where: str = "record") -> tuple[Sample, Sample]:
    """One preference record -> ``(chosen, rejected)`` samples; a ValueError naming the record
    and field for anything else."""
    if not isinstance(rec, Mapping) or any(k not in rec for k in FIELDS):
        got = sorted(rec) if isinstance(rec, Mapping) else type(rec).__name__
        raise ValueError(f"{where}: expected an object with {list(FIELDS)}, got {got}")
    prompt = rec["prompt"]
    if isinstance(prompt, str):
        for k in ("chosen", "rejected"):
            if not isinstance(rec[k], str):
                raise ValueError(f"{where}: '{k}' must be text like the prompt, got {type(rec[k]).__name__}")
        return tuple(_plain(tok, prompt, rec[k], f"{where} {k}") for k in ("chosen", "rejected"))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{where}: conversational records need a tokenizer with a chat template")
    msgs = _messages(prompt, f"{where} prompt")
    out = []
    for k in ("chosen", "rejected"):
        if not isinstance(rec[k], list):
            raise ValueError(f"{where}: '{k}' must be a list of messages like the prompt")
        answer = _messages(rec[k], f"{where} {k}")
        out.append(_chat(tok, msgs, answer, f"{where} {k}"))
    return out[0], out[1]


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
    """Every line's ``(chosen, rejected)`` pair (for ``odcfn.preference_batch``), through the
    local tokenizer in ``tokenizer_dir``; errors name the file, line and field. A pair whose
    member is longer than ``max_length`` is an error (not silently truncated). Odd pairs
    (``odd_record``) are named in one warning."""
    tok = load_tokenizer(tokenizer_dir)
    pairs, odd = [], []
    for _, where, rec in jsonl_records(path):
        pair = tokenize_pair(tok, rec, where)
        why = odd_record(rec)
        if why is not None:
            odd.append(f"{where} {why}")
        try:  # named by line here, not later by its pair index in some minibatch
            check_pairs(Batch(pair, pairs=True))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        for k, s in zip(("chosen", "rejected"), pair):
            if max_length is not None and s.length > max_length:
                raise ValueError(f"{where} {k}: {s.length} tokens, more than max_length={max_length}")
        pairs.append(pair)
    line = warn_odd(odd)
    if line is not None:
        warnings.warn(f"read_preference_jsonl: {line}", UserWarning, stacklevel=2)
    return pairs
