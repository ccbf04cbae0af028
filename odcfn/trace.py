"""Per-rank event traces, recorded by the runtime (and by the simulator, in the same format)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["COMPUTE_KINDS", "Event", "bubble_rate", "makespan"]

COMPUTE_KINDS = ("forward", "backward")


@dataclass(frozen=True)
class Event:
    rank: int
    kind: str  # forward | backward | gather | scatter | collective | release | sync | straggle
    name: str  # the unit (or "" for sync)
    start: float  # seconds, from the start of the step on this rank's clock
    end: float
    mb: int = -1

    @property
    def duration(self) -> float:
        return self.end - self.start


def makespan(events: Sequence[Event]) -> float:
    return max((e.end for e in events), default=0.0) - min((e.start for e in events), default=0.0)


def bubble_rate(events_per_rank: Sequence[Sequence[Event]], step_time: float | None = None) -> float:
    """1 - (sum over ranks of busy compute time) / (ranks x step time)."""
    if not events_per_rank:
        raise ValueError("bubble_rate needs at least one rank's events")
    if step_time is None:
        step_time = max(makespan(evs) for evs in events_per_rank)
    if step_time <= 0:
        return 0.0
    busy = sum(e.duration for evs in events_per_rank for e in evs if e.kind in COMPUTE_KINDS)
    return 1.0 - busy / (len(events_per_rank) * step_time)
