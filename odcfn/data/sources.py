"""Where a dataset's rows live: ``data.path`` is one of

- a JSONL file (one JSON object a line; ``.jsonl`` or ``.json``) or a parquet file;
- a folder of such shards (read in the order of their sorted relative paths, subfolders
  included: the layout of a dataset repository's ``data/train-0000x-of-0000n.parquet``);
- a ``datasets`` directory written by ``Dataset.save_to_disk`` (read with the ``datasets``
  library, the ``datasets`` extra; ``load_from_disk`` reads local files only, nothing is
  downloaded). A ``DatasetDict``'s directory is refused naming its splits: name one.

Every row comes with where it is, for errors: ``file:line`` for JSONL, ``file: row i`` (0-based)
for parquet and ``datasets``. A column that is null in a row (parquet's and arrow's way of
saying that a row lacks it) is absent from that row.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Row", "Source", "iter_rows", "resolve", "row_where", "source_sha256"]

JSONL = (".jsonl", ".json")
PARQUET = (".parquet", ".pq")


@dataclass(frozen=True)
class Source:
    """A resolved ``data.path``: its kind and the files its rows are read from, in order."""

    path: str
    kind: str  # "jsonl", "parquet", "folder" or "datasets"
    files: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    file: str  # the shard it is in (the directory itself for a ``datasets`` directory)
    line: int  # 1-based line of a JSONL file, else 0-based row
    where: str  # "file:line" or "file: row i"
    rec: Any


def row_where(file: str, line: int) -> str:
    """How errors name row ``line`` of ``file`` (``Row.where``)."""
    return f"{file}:{line}" if Path(file).suffix.lower() in JSONL else f"{file}: row {line}"


def _datasets_dir(root: Path) -> bool:
    return (root / "state.json").is_file() and (root / "dataset_info.json").is_file()


def resolve(path: str | os.PathLike) -> Source:
    """What ``path`` is, or a ValueError saying what it should be."""
    root = Path(path)
    suffix = root.suffix.lower()
    if root.is_file():
        if suffix in JSONL:
            return Source(str(root), "jsonl", (str(root),))
        if suffix in PARQUET:
            return Source(str(root), "parquet", (str(root),))
        raise ValueError(f"{root}: unknown data format {suffix!r}; use .jsonl, .parquet, a folder of "
                         "them, or a datasets directory (save_to_disk)")
    if not root.is_dir():
        raise ValueError(f"{root} does not exist (a .jsonl or .parquet file, a folder of them, or a "
                         "datasets directory written by save_to_disk)")
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        raise ValueError(f"{root} is a datasets DatasetDict with splits {splits}: name one split's "
                         f"directory, e.g. {root / (splits[0] if splits else 'train')}")
    if _datasets_dir(root):
        return Source(str(root), "datasets", (str(root),))
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in JSONL + PARQUET
         # hidden files and folders (.git, caches) are not data
         and not any(part.startswith((".", "_")) for part in p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        seen = sorted(p.name for p in root.iterdir())[:8]
        raise ValueError(f"{root}: a folder without .jsonl or .parquet shards (found {seen}) and not a "
                         "datasets directory (save_to_disk writes state.json and dataset_info.json)")
    return Source(str(root), "folder", tuple(str(p) for p in files))


def _load_datasets(path: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"reading {path} (a datasets directory) needs the datasets library: "
                          "pip install 'odcfn[datasets]'") from None
    return datasets.load_from_disk(path)


def _parquet_rows(file: str) -> Iterator[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {file} needs pyarrow: pip install 'odcfn[data]'") from None
    pf = pq.ParquetFile(file)
    i = 0
    for batch in pf.iter_batches():  # a shard's row groups one at a time, not the whole table
        for rec in batch.to_pylist():
            yield Row(file, i, f"{file}: row {i}", {k: v for k, v in rec.items() if v is not None})
            i += 1


def _file_rows(file: str) -> Iterator[Row]:
    if Path(file).suffix.lower() in JSONL:
        from odcfn.data.records import jsonl_records

        for lineno, where, rec in jsonl_records(file):
            yield Row(file, lineno, where, rec)
    else:
        yield from _parquet_rows(file)


def iter_rows(path: str | os.PathLike | Source) -> Iterator[Row]:
    """Every row of ``path`` (see the module docstring), in order."""
    src = path if isinstance(path, Source) else resolve(path)
    if src.kind == "datasets":
        ds = _load_datasets(src.path)
        for i, rec in enumerate(ds):
            yield Row(src.path, i, f"{src.path}: row {i}", {k: v for k, v in rec.items() if v is not None})
        return
    for file in src.files:
        yield from _file_rows(file)


def source_sha256(path: str | os.PathLike) -> str:
    """A digest of what ``path`` holds (for caches and resume checks): a file's bytes (the plain
    sha256 of the file, as earlier runs recorded it), or every data file of a folder or
    ``datasets`` directory with its relative name."""
    src = resolve(path)
    if src.kind in ("jsonl", "parquet"):
        return _update(hashlib.sha256(), Path(src.path)).hexdigest()
    root = Path(src.path)
    files = src.files if src.kind == "folder" else sorted(p for p in root.rglob("*") if p.is_file())
    h = hashlib.sha256(f"odcfn-source-{src.kind}".encode())
    for f in map(Path, files):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        _update(h, f).update(b"\0")
    return h.hexdigest()


def _update(h: Any, path: Path) -> Any:
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
    return h
