"""A dataset wherever it lives (``odcfn.data.sources``) in whichever TRL format its columns say
(``odcfn.data.formats``) -> ``TokenDataset`` (supervised fine-tuning) or ``(chosen, rejected)``
pairs (preference optimization).

The format is found from the first row's columns and every row must then have that format's
columns. Token records need no tokenizer; the other formats are tokenized through a local
tokenizer directory, once: the result is cached as token-id shards (``odcfn.data.chat``'s
cache: safetensors, nothing unpickled) under ``cache_dir`` (default: beside the data), keyed by
the data's contents, the tokenizer's files and the format, so a rerun or another rank reads
the shards instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from odcfn.batch import Sample
from odcfn.data.dataset import TokenDataset
from odcfn.data.sources import Row, Source, iter_rows, resolve, source_sha256

__all__ = ["first_format", "iter_pairs", "read_sft"]


def _rows(src: Source, task: str) -> tuple[str, Iterator[Row]]:
    """The format of ``src`` for ``task`` (from its first row) and all its rows."""
    from odcfn.data.formats import detect_format

    rows = iter_rows(src)
    first = next(rows, None)
    if first is None:
        raise ValueError(f"{src.path}: no rows")
    if not isinstance(first.rec, dict):
        raise ValueError(f"{first.where}: expected an object (a row with named columns), got "
                         f"{type(first.rec).__name__}")
    return detect_format(list(first.rec), first.where, task), itertools.chain([first], rows)


def first_format(path: str | os.PathLike, task: str = "sft") -> str:
    """The format of ``path``'s rows for ``task`` (a ValueError naming the columns if none)."""
    return _rows(resolve(path), task)[0]


def _key(src: Source, tokenizer_dir: str | os.PathLike, tok: Any, fmt: str) -> str:
    from odcfn.data.chat import CACHE_VERSION, TOKENIZER_FILES

    h = hashlib.sha256(f"odcfn-rows-v{CACHE_VERSION}\0{fmt}\0{source_sha256(src.path)}".encode())
    for name in TOKENIZER_FILES:
        p = Path(tokenizer_dir) / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes())
    h.update(str(getattr(tok, "chat_template", None)).encode())
    return h.hexdigest()[:32]


def _rel(src: Source, file: str) -> str:
    return "" if file == src.path else Path(file).relative_to(src.path).as_posix()


def _tokenize(src: Source, fmt: str, rows: Iterator[Row], tok: Any) -> tuple[list, list, list]:
    from odcfn.data.formats import tokenize_sft_row
    from odcfn.data.records import UnreadFields, record_to_sample

    samples, lines, files = [], [], []
    unread = UnreadFields(src.path)  # token records: per-token extras refused, other fields named once
    for row in rows:
        if not isinstance(row.rec, dict):
            raise ValueError(f"{row.where}: expected an object with the columns of the first row")
        if fmt == "tokens":  # limits are checked below, with the tokenized formats'
            unread.add(row.rec, row.where)
            samples.append(record_to_sample(row.rec, row.where, None, None))
        else:
            samples.append(tokenize_sft_row(tok, fmt, row.rec, row.where))
        if not files or files[-1][1] != row.file:
            files.append((len(lines), row.file))
        lines.append(row.line)
    unread.warn()
    return samples, lines, files


def read_sft(
    path: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    *,
    vocab_size: int | None = None,
    max_length: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> TokenDataset:
    """Every row of ``path`` as a supervised fine-tuning sample; errors name ``file:line`` (or
    ``file: row i``) and the column."""
    from odcfn.data.chat import CACHE_LOCK

    with CACHE_LOCK:  # ranks that are threads of one process tokenize once (the second reads the cache)
        return _read_sft(resolve(path), tokenizer_dir, vocab_size, max_length, cache_dir)


def _read_sft(src: Source, tokenizer_dir, vocab_size, max_length, cache_dir) -> TokenDataset:
    from odcfn.data.chat import load_tokenizer, read_cache, write_cache

    fmt, rows = _rows(src, "sft")
    tok = None
    if fmt == "tokens":
        samples, lines, files = _tokenize(src, fmt, rows, None)
    else:
        if tokenizer_dir is None:
            from odcfn.data.formats import FORMATS

            cols = " + ".join(FORMATS[fmt][0])
            raise ValueError(f"{src.path}: rows in the {FORMATS[fmt][1]} format ({cols}) "
                             "are text: set data.tokenizer to a local tokenizer directory to tokenize them")
        tok = load_tokenizer(tokenizer_dir) if fmt == "messages" else _plain_tokenizer(tokenizer_dir)
        root = Path(cache_dir) if cache_dir is not None else Path(f"{src.path}.odcfn-cache")
        final = root / _key(src, tokenizer_dir, tok, fmt)
        cached = read_cache(final)
        if cached is not None:
            samples, lines = cached
            meta = json.loads((final / "manifest.json").read_text())
            files = [(start, str(Path(src.path) / rel) if rel else src.path) for start, rel in meta["files"]]
        else:
            samples, lines, files = _tokenize(src, fmt, rows, tok)
            root.mkdir(parents=True, exist_ok=True)
            meta = {"files": [[s, _rel(src, f)] for s, f in files], "format": fmt}
            write_cache(final, samples, lines, meta)
    data = TokenDataset(tuple(samples), src.path, tuple(lines), tuple(files))
    for i, s in enumerate(data.samples):  # limits are checked on every read: not in the key
        top = int(s.tokens.max())
        if vocab_size is not None and top >= vocab_size:
            extra = f" (tokenizer {tokenizer_dir} has {len(tok)} tokens)" if tok is not None else ""
            raise ValueError(f"{data.where(i)}: token id {top} is outside the model's vocab_size={vocab_size}"
                             + extra)
        if max_length is not None and s.length > max_length:
            raise ValueError(f"{data.where(i)}: sample has {s.length} tokens, more than "
                             f"max_length={max_length}")
    return data


def _plain_tokenizer(tokenizer_dir: str | os.PathLike) -> Any:
    """A local tokenizer for text rows: a chat template is needed only by conversational rows
    (which say so, by row), so its absence is not refused here."""
    from odcfn.data.chat import load_tokenizer

    try:
        return load_tokenizer(tokenizer_dir)
    except ValueError as e:
        if "no chat template" not in str(e):
            raise
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def iter_pairs(path: str | os.PathLike, tok: Any) -> Iterator[tuple[Row, tuple[Sample, Sample]]]:
    """Every preference row of ``path`` (explicit or implicit prompt) with its ``(chosen,
    rejected)`` samples, checked as a pair (``odcfn.preference.check_pairs``) and named by row."""
    from odcfn.batch import Batch
    from odcfn.data.formats import tokenize_pair_row
    from odcfn.preference import check_pairs

    fmt, rows = _rows(resolve(path), "dpo")
    for row in rows:
        if not isinstance(row.rec, dict):
            raise ValueError(f"{row.where}: expected an object with the columns of the first row")
        pair = tokenize_pair_row(tok, fmt, row.rec, row.where)
        try:  # named by its row here, not later by its index in some minibatch
            check_pairs(Batch(pair, pairs=True))
        except ValueError as e:
            raise ValueError(f"{row.where}: {e}") from None
        yield row, pair
