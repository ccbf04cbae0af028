"""Chat transcripts -> token-id samples that train on the assistant's tokens only.

One conversation per JSONL line::

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

The text is the tokenizer's own chat template (``AutoTokenizer.from_pretrained(dir)``, a local
directory: nothing is downloaded). Which tokens are targets follows from the template itself:
assistant turn ``i`` is the text that ``messages[: i + 1]`` renders beyond ``messages[: i]``
rendered with the generation prompt, i.e. its content and whatever closes the turn (the
end-of-turn token the model must learn to emit). The whole conversation is tokenized once;
a token is a target when its characters overlap an assistant span. A template under which a
conversation's prefixes do not render as prefixes (some templates drop earlier reasoning) is
refused for that line rather than guessed at. A template that marks the assistant's output
with ``{% generation %}`` blocks (TRL's training templates) says itself what is trained: its
marks decide, as they do for TRL's ``assistant_only_loss``.

Tokenizing is slow, so the result is cached as token-id shards (safetensors; nothing is
unpickled) under ``cache_dir`` keyed by the data file's bytes and the tokenizer's files: a
rerun, or another rank, reads the shards instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from odcfn.batch import Sample
from odcfn.data.dataset import TokenDataset
from odcfn.data.records import jsonl_records

__all__ = [
    "CACHE_VERSION", "TOKENIZER_FILES", "chat_cache_key", "load_tokenizer", "read_chat_jsonl",
    "tokenize_chat",
]

CACHE_VERSION = 2  # 2: templates with {% generation %} marks train what they mark
# One reader at a time per process: ranks that are threads of one process must not import
# transformers concurrently (a half-initialised module reads as "not installed") nor tokenize
# the same file twice (the second one finds the first one's cache).
CACHE_LOCK = threading.RLock()
_SHARD_SAMPLES = 4096
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)  # fmt: skip


def load_tokenizer(directory: str | os.PathLike) -> Any:
    """A local Hugging Face tokenizer with a chat template and character offsets (fast)."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"tokenizer directory {root} does not exist")
    with CACHE_LOCK:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            import importlib.util

            if importlib.util.find_spec("transformers") is None:
                raise ImportError("chat data needs transformers: pip install transformers") from None
            raise ImportError(f"importing transformers for chat data failed: {e}") from e
        tok = AutoTokenizer.from_pretrained(str(root), local_files_only=True)
    if not getattr(tok, "chat_template", None):
        raise ValueError(
            f"tokenizer {root} has no chat template (chat_template.jinja or tokenizer_config.json's "
            "'chat_template'): chat data cannot be rendered"
        )
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"tokenizer {root} is not a fast one (tokenizer.json): chat data needs its offsets")
    return tok


def _messages(rec: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(rec, Mapping) or "messages" not in rec:
        raise ValueError(f"{where}: expected an object with 'messages'")
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: messages[{i}] must be an object with 'role' and 'content'")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"{where}: messages[{i}].{key} must be a string, got {m.get(key)!r}")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError(f"{where}: messages has no 'assistant' turn, so no token would be trained on")
    return [dict(m) for m in msgs]


def _render(tok: Any, msgs: list, gen: bool) -> str:
    return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


_GENERATION = re.compile(r"{%-?\s*generation\s*-?%}")


def _marked(tok: Any, messages: list[dict[str, str]], where: str) -> Sample:
    """The template's own ``{% generation %}`` marks as the targets (transformers computes them)."""
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    if not any(mask[1:]):
        raise ValueError(f"{where}: the chat template's {{% generation %}} marks cover no token after the "
                         "first: nothing to train on")
    return Sample(torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool))


def tokenize_chat(tok: Any, messages: list[dict[str, str]], where: str = "messages") -> Sample:
    """One conversation -> ``Sample(tokens, loss_mask)`` with the assistant spans as targets."""
    if _GENERATION.search(str(tok.chat_template or "")):
        return _marked(tok, messages, where)
    text = _render(tok, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = _render(tok, messages[:i], True) if i else "", _render(tok, messages[: i + 1], False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise ValueError(
                f"{where}: the chat template does not render messages[{i}] as an extension of the turns "
                "before it, so its tokens cannot be told apart"
            )
        spans.append((len(before), len(upto)))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if not ids:
        raise ValueError(f"{where}: the chat template renders to no tokens")
    mask = [any(a < e and b > s for s, e in spans) for a, b in offsets]
    if not any(mask[1:]):
        raise ValueError(f"{where}: no assistant token after the first token: nothing to train on")
    return Sample(torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool))


def chat_cache_key(path: str | os.PathLike, tokenizer_dir: str | os.PathLike, tok: Any = None) -> str:
    """Hash of what decides the token ids: the data file, the tokenizer's files, this code."""
    h = hashlib.sha256(f"odcfn-chat-v{CACHE_VERSION}".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    for name in TOKENIZER_FILES:
        p = Path(tokenizer_dir) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    if tok is not None:
        h.update(str(tok.chat_template).encode())
    return h.hexdigest()[:32]


def write_cache(final: Path, samples: list[Sample], lines: list[int], meta: dict | None = None) -> None:
    """Shards + manifest (with ``meta``) into a private directory, renamed into place in one step:
    concurrent writers (ranks) never see a half cache, and the first rename wins."""
    from safetensors.torch import save_file

    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    names = []
    for k in range(0, len(samples), _SHARD_SAMPLES):
        part = samples[k : k + _SHARD_SAMPLES]
        at = lines[k : k + _SHARD_SAMPLES]
        name = f"shard-{len(names):05d}.safetensors"
        save_file(
            {
                "input_ids": torch.cat([s.tokens for s in part]).to(torch.int32),
                "loss_mask": torch.cat([s.loss_mask for s in part]).to(torch.uint8),
                "lengths": torch.tensor([s.length for s in part], dtype=torch.int64),
                "lines": torch.tensor(at, dtype=torch.int64),
            },
            str(tmp / name),
        )
        names.append(name)
    doc = {"version": CACHE_VERSION, "shards": names, **(meta or {})}
    (tmp / "manifest.json").write_text(json.dumps(doc))
    try:
        os.rename(tmp, final)
    except OSError:  # another writer got there first: its cache is the same
        shutil.rmtree(tmp, ignore_errors=True)


def read_cache(final: Path) -> tuple[list[Sample], list[int]] | None:
    from safetensors.torch import load_file

    manifest = final / "manifest.json"
    if not manifest.is_file():
        return None
    doc = json.loads(manifest.read_text())
    out, lines = [], []
    for name in doc["shards"]:
        t = load_file(str(final / name))
        n = t["lengths"].tolist()
        for ids, mask in zip(t["input_ids"].split(n), t["loss_mask"].split(n)):
            out.append(Sample(ids.clone(), mask.bool()))
        lines += t["lines"].tolist()
    return out, lines


def read_chat_jsonl(
    path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike,
    *,
    vocab_size: int | None = None,
    max_length: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> TokenDataset:
    """Chat transcripts as a ``TokenDataset``; errors name ``file:line`` and the field. The token
    ids are cached under ``cache_dir`` (default: ``<path>.odcfn-cache`` beside the data).
    Thread-safe: concurrent callers in one process tokenize once."""
    with CACHE_LOCK:
        return _read_chat_jsonl(path, tokenizer_dir, vocab_size, max_length, cache_dir)


def _read_chat_jsonl(path, tokenizer_dir, vocab_size, max_length, cache_dir) -> TokenDataset:
    suffix = Path(path).suffix.lower()
    if suffix not in (".jsonl", ".json"):
        raise ValueError(f"{path}: chat data (a tokenizer is given) must be .jsonl, got {suffix!r}")
    tok = load_tokenizer(tokenizer_dir)
    root = Path(cache_dir) if cache_dir is not None else Path(f"{path}.odcfn-cache")
    final = root / chat_cache_key(path, tokenizer_dir, tok)
    cached = read_cache(final)
    if cached is not None:
        samples, lines = cached
    else:
        samples, lines = [], []
        for lineno, where, rec in jsonl_records(path):
            samples.append(tokenize_chat(tok, _messages(rec, where), where))
            lines.append(lineno)
        if samples:
            root.mkdir(parents=True, exist_ok=True)
            write_cache(final, samples, lines)
    for s, lineno in zip(samples, lines):  # limits are checked on every read: not in the key
        where = f"{path}:{lineno}"
        if vocab_size is not None and int(s.tokens.max()) >= vocab_size:
            raise ValueError(
                f"{where}: token id {int(s.tokens.max())} is outside the model's vocab_size="
                f"{vocab_size} (tokenizer {tokenizer_dir} has {len(tok)} tokens)"
            )
        if max_length is not None and s.length > max_length:
            raise ValueError(f"{where}: sample has {s.length} tokens, more than max_length={max_length}")
    return TokenDataset(tuple(samples), str(path), tuple(lines))
