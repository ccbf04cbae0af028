"""``Offload``: where an owner's fp32 master shards and optimizer state live when they do not
stay in memory (``StepConfig(offload=Offload(...))``), and the checks a config gets before any
communication. The store and the streamed update are ``odcfn.step.offload_store`` and
``odcfn.step.offload``."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from odcfn._check import ArgTypeError, check_int, is_number

__all__ = ["Offload", "check_budget", "check_space"]

GIB = 1 << 30


@dataclass(frozen=True)
class Offload:
    """Keep each owner's fp32 master shards and optimizer state in a slower tier.

    ``path``: a directory on local disk; the state lives in one file per rank there, unlinked as
    soon as it is mapped (nothing is left behind by a crash; checkpoints go through
    ``odcfn.save``). None: host memory (pinned on CUDA), the tier for GPU runs.
    ``budget_gib``: the most memory the update holds of that state at once (one unit being
    updated plus ``prefetch`` units read ahead); it must hold the largest unit ``1 + prefetch``
    times. ``prefetch``: how many units a background thread reads ahead of the update; the first
    ones are read while the step's forward and backward run.
    The published copy that gathers read stays resident, so no gather waits on the slow tier.
    """

    path: str | os.PathLike | None = None
    budget_gib: float = 1.0
    prefetch: int = 2

    def __post_init__(self) -> None:
        if self.path is not None:
            if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
                raise ArgTypeError(
                    f"Offload.path must be a directory (str or os.PathLike) or None, got {self.path!r}"
                )
            object.__setattr__(self, "path", os.fspath(self.path))
        b = self.budget_gib
        if not is_number(b) or not 0 < b < float("inf"):
            raise ValueError(f"Offload.budget_gib must be a finite number > 0, got {b!r}")
        check_int(self.prefetch, "Offload.prefetch", at_least=0)

    @property
    def budget_bytes(self) -> int:
        return int(self.budget_gib * GIB)


def check_budget(offload: Offload, unit_bytes: dict[str, int]) -> None:
    """A ValueError naming ``Offload.budget_gib`` when it cannot hold the largest unit once plus
    the prefetch window (``unit_bytes``: each trained unit's offloaded bytes on this rank)."""
    if not unit_bytes:
        return
    name, big = max(unit_bytes.items(), key=lambda kv: kv[1])
    need = big * (1 + offload.prefetch)
    if offload.budget_bytes < need:
        raise ValueError(
            f"Offload.budget_gib={offload.budget_gib} is below one unit plus the prefetch window: "
            f"unit {name!r} holds {big} bytes of master shard and optimizer state on this rank, so "
            f"prefetch={offload.prefetch} needs at least {need / GIB:.6g} GiB"
        )


def check_space(offload: Offload, need: int) -> Path | None:
    """The directory of ``Offload.path`` after checking it is a writable directory with ``need``
    free bytes: a ValueError naming ``Offload.path`` otherwise (None: the host-memory tier)."""
    if offload.path is None:
        return None
    d = Path(offload.path)
    if not d.is_dir():
        raise ValueError(f"Offload.path={offload.path!r} is not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"Offload.path={offload.path!r} is not writable")
    free = shutil.disk_usage(d).free
    if free < need:
        raise ValueError(
            f"Offload.path={offload.path!r} has {free / GIB:.3f} GiB free, the offloaded state needs "
            f"{need / GIB:.3f} GiB"
        )
    return d
