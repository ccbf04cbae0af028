"""The ground floor of what a step reports: per-rank events, the step's metrics, and the one
definition of makespan, bubble rate and throughput that the runtime, the simulator, the
benchmarks and the SFT loop all use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from odcfn.kernels.base import Counters
    from odcfn.schedule.plan import Plan

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Event",
    "StepMetrics",
    "bubble_rate",
    "makespan",
    "samples_per_s",
    "tokens_per_s",
]

COMPUTE_KINDS = ("forward", "backward")
COMM_KINDS = ("gather", "scatter", "collective", "sync")


@dataclass(frozen=True)
class Event:
    rank: int
    kind: str  # forward | backward | gather | scatter | collective | release | sync
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
    """1 - (sum over ranks of busy compute time) / (ranks x step time): THE bubble rate, for
    measured and simulated traces alike. A slow device's longer compute is busy time."""
    if not events_per_rank:
        raise ValueError("bubble_rate needs at least one rank's events")
    if step_time is None:
        step_time = max(makespan(evs) for evs in events_per_rank)
    if step_time <= 0:
        return 0.0
    busy = sum(e.duration for evs in events_per_rank for e in evs if e.kind in COMPUTE_KINDS)
    return 1.0 - busy / (len(events_per_rank) * step_time)


def _step_time(events_per_rank: Sequence[Sequence[Event]], step_time: float | None) -> float:
    if step_time is not None:
        return step_time
    if not events_per_rank:
        raise ValueError("need at least one rank's events (or an explicit step_time)")
    return max(makespan(evs) for evs in events_per_rank)


def samples_per_s(
    num_samples: int, events_per_rank: Sequence[Sequence[Event]] = (), step_time: float | None = None
) -> float:
    """Minibatch samples over the step time (the slowest rank's makespan unless given)."""
    t = _step_time(events_per_rank, step_time)
    return num_samples / t if t > 0 else float("inf")


def tokens_per_s(
    num_tokens: int, events_per_rank: Sequence[Sequence[Event]] = (), step_time: float | None = None
) -> float:
    t = _step_time(events_per_rank, step_time)
    return num_tokens / t if t > 0 else float("inf")


@dataclass
class StepMetrics:
    """What ``train_step`` / ``grad_step`` report for one minibatch on one rank."""

    loss: float
    grad_norm: float
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    step_time: float  # this rank's wall time for the step, sync included
    plan: Plan  # the plan this rank ran (under work stealing: as it was decided)
    counters: Counters  # what the transport did during this step
    events: list[Event] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the loss's own figures

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.step_time

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.step_time
