"""``odcfn train``'s ``[offload]`` section: the owners' fp32 masters and optimizer state in a
slower tier (``odcfn.Offload``, docs/memory.md), checked when the config is read. Its own module
so that ``odcfn.sft.config`` stays one screenful per concern; ``config`` imports it, never the
reverse."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from odcfn.sft.keys import check_key
from odcfn.step.offload_config import Offload, check_space

__all__ = ["OffloadSection", "check_offload", "step_offload"]


@dataclass(frozen=True)
class OffloadSection:
    """``[offload]``: ``budget_gib`` 0 is off; ``path`` a directory (unset: host memory)."""

    budget_gib: float = 0.0
    path: str | None = None
    prefetch: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):
            check_key("offload", f.name, getattr(self, f.name), f.type)


def step_offload(section: OffloadSection) -> Offload | None:
    """The run's ``StepConfig.offload`` (None: everything in memory)."""
    if not section.budget_gib:
        return None
    return Offload(path=section.path, budget_gib=section.budget_gib, prefetch=section.prefetch)


def check_offload(cfg: Any) -> None:
    """What ``[offload]`` needs when it is on: a writable directory, a synchronous run. The
    budget against the model's largest unit and the free space against the whole state are
    checked when the state is built, before the first step communicates."""
    off = step_offload(cfg.offload)
    if off is None:
        return
    try:
        check_space(off, 0)
    except ValueError as e:
        raise ValueError(f"config: offload.path: {e}") from None
    from odcfn.step.stale_config import max_staleness

    if max_staleness(cfg.train.staleness):
        raise ValueError(
            "config: [offload] cannot be combined with train.staleness >= 1 yet (the stale "
            "owners update outside the streamed update); set offload.budget_gib = 0"
        )
