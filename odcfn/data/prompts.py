"""RL prompts: TRL's prompt-only format -> ``odcfn.rl.Prompt`` (token ids, text, the row's fields).

One prompt per JSONL line (or parquet row), the prompt as plain text or as chat messages, and
beside it whatever the reward reads (TRL's ``answer``, or verl's nested
``reward_model.ground_truth``)::

    {"prompt": "2 + 3 =", "answer": "5"}
    {"prompt": [{"role": "user", "content": "2 + 3?"}], "reward_model": {"ground_truth": "5"}}

Conversational prompts are rendered with the tokenizer's own chat template and the generation
prompt (``add_generation_prompt=True``: the text ends where the assistant's answer begins); a
plain string is tokenized with the tokenizer's special tokens, as TRL's GRPO trainer does
(``odcfn.data.formats.encode_text``). A file whose first row has no ``prompt`` column is refused
naming its columns and what each format needs. Every
other field of the row goes to ``Prompt.fields``. Every row is checked when it is read, and a
problem is named by ``file:line`` (parquet: ``file: row i``) and key: no or an empty prompt, a
token outside the model's vocabulary, a prompt that leaves the engine no room to answer, a field
the reward needs that the row lacks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from odcfn.data.prompt import Prompt

__all__ = ["PromptDataset", "get_field", "prompt_records", "read_prompts", "tokenize_prompt"]

_MISSING = object()


@dataclass(frozen=True)
class PromptDataset:
    """The prompts of a file, each with where it came from (``file:line``)."""

    prompts: tuple[Prompt, ...]
    source: str
    where: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def num_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def prompt_records(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` for every row of ``path``: a ``.jsonl`` / ``.json`` (one object a line) or
    ``.parquet`` file, a folder of them, or a datasets directory (``odcfn.data.sources``);
    ``where`` is ``file:line`` or ``file: row i``."""
    from odcfn.data.sources import iter_rows

    for row in iter_rows(path):
        yield row.where, row.rec


def get_field(row: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    """``row[key]``; a dotted key also reads nested objects (``reward_model.ground_truth``) or
    a flattened column of that name. ``default`` (or a ``KeyError``) when it is absent or null."""
    if row.get(key) is not None:
        return row[key]
    node: Any = row
    for part in key.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        node = node[part]
    return node


def _messages(msgs: list, where: str) -> list[dict[str, str]]:
    if not msgs:
        raise ValueError(f"{where}: 'prompt' is an empty list of messages: an empty prompt")
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
            raise ValueError(f"{where}: prompt[{i}] must be an object with string 'role' and 'content', "
                             f"got {m!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


def tokenize_prompt(tok: Any, rec: Any, where: str = "record") -> tuple[list[int], str, dict[str, Any]]:
    """One row -> ``(token ids, the prompt's text as the model sees it, the row's other fields)``;
    a ``ValueError`` naming ``where`` and the key for anything else."""
    if not isinstance(rec, Mapping):
        raise ValueError(f"{where}: expected an object with 'prompt', got {type(rec).__name__}")
    if "prompt" not in rec:
        raise ValueError(f"{where}: no 'prompt' key (the row has {sorted(rec)}); a prompt is text or a "
                         "list of chat messages")
    prompt = rec["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: 'prompt' is empty")
        text = prompt
    elif isinstance(prompt, list):
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"{where}: a conversational 'prompt' needs a tokenizer with a chat template")
        text = tok.apply_chat_template(_messages(prompt, where), tokenize=False, add_generation_prompt=True)
    else:
        raise ValueError(f"{where}: 'prompt' must be text or a list of chat messages, got "
                         f"{type(prompt).__name__}")
    if isinstance(prompt, str):
        from odcfn.data.formats import encode_text

        ids = encode_text(tok, text)
    else:  # the template wrote the special tokens
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError(f"{where}: 'prompt' tokenizes to no tokens: an empty prompt")
    return ids, text, {k: v for k, v in rec.items() if k != "prompt"}


def _check_fields(fields: Mapping[str, Any], required: Sequence[Any], who: str, where: str) -> None:
    """Each entry of ``required`` is a key, or a tuple of keys of which one must be present."""
    for need in required:
        keys = (need,) if isinstance(need, str) else tuple(need)
        if all(get_field(fields, k, None) is None for k in keys):
            names = " or ".join(repr(k) for k in keys)
            raise ValueError(f"{where}: no {names} field, which {who} reads (the row has "
                             f"{sorted(['prompt', *fields])})")


def read_prompts(
    path: str | os.PathLike,
    tokenizer: Any,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
    required_fields: Sequence[Any] = (),
    reward_name: str = "the reward",
) -> PromptDataset:
    """Every prompt of ``path`` through ``tokenizer`` (a loaded tokenizer, or a local tokenizer
    directory). ``max_model_len``: the engine's limit (prompt + at least one new token), None
    to leave lengths to the caller. ``required_fields``: what the reward reads (each entry a
    key or a tuple of alternatives, dotted for nested objects)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from odcfn.data.chat import load_tokenizer

        tokenizer = load_tokenizer(tokenizer)
    from odcfn.data.formats import detect_format

    prompts, wheres = [], []
    for where, rec in prompt_records(path):
        if not prompts and isinstance(rec, Mapping):  # the format, from the first row's columns
            detect_format(list(rec), where, "rl")
        ids, text, fields = tokenize_prompt(tokenizer, rec, where)
        top = max(ids)
        if vocab_size is not None and top >= vocab_size:
            raise ValueError(f"{where}: 'prompt' has token id {top}, outside the model's vocabulary "
                             f"[0, {vocab_size}) (the tokenizer does not fit the model)")
        if max_model_len is not None and len(ids) >= max_model_len:
            raise ValueError(f"{where}: 'prompt' has {len(ids)} tokens; the engine's maximum length is "
                             f"{max_model_len} (prompt + at least one new token)")
        _check_fields(fields, required_fields, reward_name, where)
        prompts.append(Prompt(ids, text, fields))
        wheres.append(where)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return PromptDataset(tuple(prompts), str(path), tuple(wheres))
