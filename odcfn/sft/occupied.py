"""Refuse to write over what a user already has: ``odcfn export`` into a directory that holds
files (another model, a LoRA base) and ``odcfn train --init`` over an edited ``run.toml`` stop
with an error naming what is there, unless ``--force`` says to overwrite.

The error is a ``FileExistsError``: an ``OSError``, so the CLI reports it in one line with exit
status 2 like every other user mistake."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["refuse_existing_files", "refuse_nonempty_dir"]

_SHOW = 5  # entries named in a message


def _names(entries: list[str]) -> str:
    more = f" and {len(entries) - _SHOW} more" if len(entries) > _SHOW else ""
    return ", ".join(entries[:_SHOW]) + more


def refuse_nonempty_dir(path: str | os.PathLike, what: str, *, force: bool) -> None:
    """Raise unless ``path`` is missing, an empty directory, or ``force``; ``what`` names the
    command in the message (``"odcfn export"``)."""
    p = Path(path)
    if force or not p.exists():
        return
    if not p.is_dir():
        raise FileExistsError(f"{what}: {p} exists and is not a directory; give another path")
    entries = sorted(e.name + ("/" if e.is_dir() else "") for e in p.iterdir())
    if entries:
        raise FileExistsError(
            f"{what}: {p} is not empty (it holds {_names(entries)}); give an empty or new "
            "directory, or --force to write over it"
        )


def refuse_existing_files(paths: list[Path], what: str, *, force: bool) -> None:
    """Raise unless none of ``paths`` exists, or ``force``."""
    there = [str(p) for p in paths if p.exists()]
    if there and not force:
        raise FileExistsError(
            f"{what}: {_names(there)} already exist(s); choose another directory, or --force to "
            "overwrite"
        )
