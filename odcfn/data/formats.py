"""TRL's dataset formats, found from a file's columns, each in its standard (text) and its
conversational (a list of ``{"role", "content"}`` messages) form, tokenized as TRL 1.16's
trainers do, so that a dataset trains on the same token ids and targets here as there:

=====================  ===================================  ============================
format                 columns                              task
=====================  ===================================  ============================
token records          ``input_ids`` (+ ``loss_mask``)      sft (``odcfn.data.records``)
language modeling      ``text`` / ``messages``              sft
prompt-completion      ``prompt`` + ``completion``          sft (rl: the prompt)
preference             ``prompt`` + ``chosen`` + ``rejected``  dpo
implicit prompt        ``chosen`` + ``rejected``            dpo
prompt-only            ``prompt``                           rl (``odcfn.data.prompts``)
=====================  ===================================  ============================

The rules (TRL's ``SFTTrainer`` / ``DPOTrainer`` dataset preparation):

- text is tokenized with the tokenizer's special tokens (``tok(text)``: a BOS where the
  tokenizer adds one), and the end-of-sequence token is appended to the text that ends the
  sample (``text``, ``completion``, ``chosen``, ``rejected``) unless it ends with it already;
- conversations are rendered with the tokenizer's chat template and tokenized without special
  tokens (the template writes them); a conversation ends where the template closes its turn;
- ``text``: every token is a target; ``messages``: the assistant turns only (TRL's
  ``assistant_only_loss``; ``odcfn.data.chat``);
- prompt + answer: ``prompt`` and ``prompt + answer`` are tokenized apart and the answer's
  targets start where the two token sequences diverge (tokens can merge across the boundary,
  and templates may render a prompt alone differently); a pair's two members share the prompt
  up to the earlier of their two divergences;
- implicit prompt: the prompt is the longest common prefix of ``chosen`` and ``rejected``
  (characters, or whole messages), a space before the point where they differ going to the
  answers, and each answer keeps at least its last character or message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from odcfn.batch import Sample

__all__ = [
    "FORMATS", "TASK_FORMATS", "describe_formats", "detect_format", "encode_text", "form_of",
    "tokenize_pair_row", "tokenize_sft_row",
]

# format -> (the columns it needs, its name in messages); detection tries them in this order:
# the most specific first, as TRL does (a tokenized dataset is taken as such whatever else it has)
FORMATS: dict[str, tuple[tuple[str, ...], str]] = {
    "tokens": (("input_ids",), "token records"),
    "preference": (("prompt", "chosen", "rejected"), "preference"),
    "implicit_preference": (("chosen", "rejected"), "preference with an implicit prompt"),
    "prompt_completion": (("prompt", "completion"), "prompt-completion"),
    "messages": (("messages",), "conversational language modeling"),
    "text": (("text",), "language modeling"),
    "prompt_only": (("prompt",), "prompt-only"),
}
TASK_FORMATS: dict[str, tuple[str, ...]] = {
    "sft": ("tokens", "text", "messages", "prompt_completion"),
    "dpo": ("preference", "implicit_preference"),
    # an RL row's other columns (a reference completion, an answer) are the reward's fields
    "rl": ("prompt_only", "prompt_completion"),
}
_ANSWERS = ("text", "completion", "chosen", "rejected")  # the columns that end a sample (EOS)


def describe_formats() -> str:
    """What each format needs, for the message that refuses a file matching none."""
    tasks = {f: "/".join(t for t, fs in TASK_FORMATS.items() if f in fs) for f in FORMATS}
    return "; ".join(f"{name} ({tasks[f]}): {' + '.join(repr(c) for c in cols)}"
                     for f, (cols, name) in FORMATS.items())


def detect_format(columns: Sequence[str], where: str, task: str = "sft") -> str:
    """The format of a file whose first row (``where``) has ``columns``, for ``task``; a
    ValueError naming the columns and what each format needs when none fits."""
    have = set(columns)
    found = next((f for f, (cols, _) in FORMATS.items() if set(cols) <= have), None)
    if found is None:
        raise ValueError(f"{where}: the columns {sorted(have)} match no dataset format; each format needs "
                         f"these columns: {describe_formats()}")
    if found not in TASK_FORMATS[task]:
        name = FORMATS[found][1]
        fits = [t for t, fs in TASK_FORMATS.items() if found in fs]
        reads = "; ".join(f"{FORMATS[f][1]}: {' + '.join(FORMATS[f][0])}" for f in TASK_FORMATS[task])
        raise ValueError(f"{where}: the columns {sorted(have)} are the {name} format, which trains with "
                         f"train.task = {fits[0]!r}, not {task!r} (train.task = {task!r} reads: {reads})")
    return found


def _messages(value: Any, where: str, column: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: column {column!r} is an empty list of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
            raise ValueError(f"{where}: column {column!r}: message {i} must be an object with string 'role' "
                             f"and 'content', got {m!r:.80}")
        out.append({k: v for k, v in m.items() if v is not None})  # arrow's absent struct fields
    return out


def form_of(rec: Mapping[str, Any], fmt: str, where: str) -> str:
    """``"standard"`` or ``"conversational"``: the form of a row of format ``fmt``, after checking
    that every column the format needs is there, non-empty and of that one form."""
    cols = FORMATS[fmt][0]
    missing = [c for c in cols if rec.get(c) is None]
    if missing:
        raise ValueError(f"{where}: no {missing[0]!r} column; the file is in the {FORMATS[fmt][1]} format, "
                         f"which needs {' + '.join(repr(c) for c in cols)} in every row (the row has "
                         f"{sorted(rec)})")
    forms = {}
    for c in cols:
        v = rec[c]
        if isinstance(v, str):
            forms[c] = "standard"
        elif isinstance(v, list):
            forms[c] = "conversational"
        else:
            raise ValueError(f"{where}: column {c!r} must be text or a list of chat messages, got "
                             f"{type(v).__name__}")
        # an explicit-prompt pair's empty answer still prefers or rejects the end of the answer (the
        # EOS / end of turn): named as odd when read (odcfn.data.preference.odd_record), not refused
        empty_ok = fmt == "preference" and c in ("chosen", "rejected")
        if c in _ANSWERS and not empty_ok and not (v.strip() if isinstance(v, str) else v):
            raise ValueError(f"{where}: column {c!r} is empty: nothing to train on")
    if len(set(forms.values())) > 1:
        raise ValueError(f"{where}: columns mix the standard and the conversational form ("
                         + ", ".join(f"{c!r}: {f}" for c, f in forms.items()) + "); use text in all or "
                         "lists of messages in all")
    return next(iter(forms.values()))


def encode_text(tok: Any, text: str) -> list[int]:
    """Plain text as TRL tokenizes it: with the tokenizer's special tokens (``tok(text)``)."""
    return list(tok(text)["input_ids"])


def _chat_ids(tok: Any, msgs: list, gen: bool) -> list[int]:
    # render, then tokenize without special tokens: what apply_chat_template(tokenize=True) does
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _with_eos(tok: Any, text: str) -> str:
    eos = tok.eos_token
    return text if eos is None or text.endswith(eos) else text + eos


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _sample(ids: list[int], start: int, where: str, column: str) -> Sample:
    mask = torch.arange(len(ids)) >= start
    if not bool(mask[1:].any()):
        raise ValueError(f"{where}: column {column!r} leaves no token to train on after the prompt")
    return Sample(torch.tensor(ids, dtype=torch.int32), mask)


def _need_template(tok: Any, where: str) -> None:
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{where}: conversational rows need a tokenizer with a chat template")


def _need_assistant(msgs: list, where: str, column: str) -> None:
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"{where}: column {column!r} has no 'assistant' turn, so no token would be "
                         "trained on")


def tokenize_sft_row(tok: Any, fmt: str, rec: Mapping[str, Any], where: str) -> Sample:
    """One ``text`` / ``messages`` / ``prompt`` + ``completion`` row -> its ``Sample``."""
    form = form_of(rec, fmt, where)
    if fmt == "messages":
        if form != "conversational":
            raise ValueError(f"{where}: column 'messages' must be a list of chat messages, got text")
        from odcfn.data.chat import tokenize_chat

        _need_template(tok, where)
        msgs = _messages(rec["messages"], where, "messages")
        _need_assistant(msgs, where, "messages")
        return tokenize_chat(tok, msgs, f"{where} column 'messages'")
    if fmt == "text":
        if form != "standard":
            raise ValueError(f"{where}: column 'text' must be text; conversations go in a 'messages' column")
        return _sample(encode_text(tok, _with_eos(tok, rec["text"])), 0, where, "text")
    if fmt != "prompt_completion":
        raise ValueError(f"{where}: the {FORMATS[fmt][1]} format is not supervised fine-tuning data")
    if form == "standard":
        prompt = encode_text(tok, rec["prompt"])
        full = encode_text(tok, rec["prompt"] + _with_eos(tok, rec["completion"]))
    else:
        _need_template(tok, where)
        p, c = _messages(rec["prompt"], where, "prompt"), _messages(rec["completion"], where, "completion")
        _need_assistant(c, where, "completion")
        prompt, full = _chat_ids(tok, p, True), _chat_ids(tok, p + c, False)
    return _sample(full, _common_prefix(prompt, full), where, "completion")


def _implicit_prompt(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
    """``(prompt, chosen answer, rejected answer)`` from two sequences sharing a prefix."""
    n = min(len(chosen), len(rejected))
    diff = next((i for i in range(n) if chosen[i] != rejected[i]), None)
    if diff is None:  # one is a prefix of the other: each answer keeps its last element
        idx = n - 1
    else:  # a space just before the difference goes to the answers
        idx = diff - 1 if diff > 0 and isinstance(chosen, str) and chosen[diff - 1] == " " else diff
    if idx <= 0:
        unit = "character" if isinstance(chosen, str) else "message"
        raise ValueError(f"{where}: columns 'chosen' and 'rejected' differ from their first {unit}, so they "
                         "share no prompt; give the prompt in a 'prompt' column")
    return chosen[:idx], chosen[idx:], rejected[idx:]


def tokenize_pair_row(tok: Any, fmt: str, rec: Mapping[str, Any], where: str) -> tuple[Sample, Sample]:
    """One preference row (explicit or implicit prompt) -> its ``(chosen, rejected)`` samples."""
    form = form_of(rec, fmt, where)
    if form == "conversational":
        _need_template(tok, where)
        chosen, rejected = (_messages(rec[k], where, k) for k in ("chosen", "rejected"))
        prompt = _messages(rec["prompt"], where, "prompt") if fmt == "preference" else None
    else:
        chosen, rejected, prompt = rec["chosen"], rec["rejected"], rec.get("prompt")
    if fmt == "implicit_preference":
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected, where)
    if form == "conversational":
        p_ids = _chat_ids(tok, prompt, True)
        full = [_chat_ids(tok, prompt + a, False) for a in (chosen, rejected)]
    else:
        p_ids = encode_text(tok, prompt)
        full = [encode_text(tok, prompt + _with_eos(tok, a)) for a in (chosen, rejected)]
    start = min(_common_prefix(p_ids, ids) for ids in full)
    c, r = (_sample(ids, start, where, k) for ids, k in zip(full, ("chosen", "rejected")))
    return c, r
