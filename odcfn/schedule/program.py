"""Programs: what a rank runs for one minibatch, as plan pieces.

A static plan is one piece. A work-stealing rank strings together pieces cut from the static ODC
plan (``OwnerSteps``) and fragments for single stolen samples, one per decision of
``odcfn.schedule.steal.rank_program`` (an ``Action``). Pieces number their microbatches from 0;
``assemble_plan`` renumbers them into the plan the rank actually ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal, NamedTuple

from odcfn.schedule.plan import (
    Backward,
    Comm,
    Forward,
    Gather,
    Plan,
    Release,
    Reshard,
    ScheduleOptions,
    Step,
    Sync,
    check_remat,
    compile_plan,
    hoist_gathers,
    microbatch_steps,
)

__all__ = [
    "Action",
    "OwnerSteps",
    "Piece",
    "action_piece",
    "action_pieces",
    "assemble_plan",
    "owner_steps",
    "realised_plan",
    "stealing_fragment",
    "stealing_pieces",
]


def stealing_fragment(
    units: Sequence[str], mb: int, options: ScheduleOptions | None = None
) -> tuple[Step, ...]:
    """The steps a work-stealing rank runs for one stolen sample: microbatch ``mb``'s forward
    and backward with their gathers prefetched inside it, and no Sync. Used by the runtime and
    the simulator alike."""
    return _fragment(tuple(units), mb, options or ScheduleOptions())


@lru_cache(maxsize=256)
def _fragment(units: tuple[str, ...], mb: int, options: ScheduleOptions) -> tuple[Step, ...]:
    check_remat(units, options)
    return tuple(hoist_gathers(microbatch_steps(units, mb, "odc", options), options.prefetch))


@dataclass(frozen=True)
class OwnerSteps:
    """The ODC plan cut into the pieces a work-stealing owner strings together, deciding each
    microbatch only when it gets there (all with ``mb=0``; renumber when used):

    ``prefix`` (gathers before the first Forward) + ``middle`` x (n - 1) + ``last`` is the plan
    of n microbatches without its Sync, step for step; ``held`` releases what a ``middle``
    leaves gathered for the next microbatch (the same units ``prefix`` gathers), to stop there.
    """

    prefix: tuple[Step, ...]
    middle: tuple[Step, ...]
    last: tuple[Step, ...]
    held: tuple[Step, ...]


def owner_steps(units: Sequence[str], options: ScheduleOptions | None = None) -> OwnerSteps:
    return _owner_steps(tuple(units), options or ScheduleOptions())


@lru_cache(maxsize=64)
def _owner_steps(units: tuple[str, ...], options: ScheduleOptions) -> OwnerSteps:
    def cut(n: int) -> tuple[tuple[Step, ...], list[int]]:
        steps = compile_plan(units, (tuple((0,) for _ in range(n)),), 0, "odc", options).steps[:-1]
        return steps, [i for i, s in enumerate(steps) if isinstance(s, Forward) and s.unit == units[0]]

    one, (a,) = cut(1)
    two, (_, b) = cut(2)
    live: dict[str, None] = {}
    for s in two[:b]:
        if isinstance(s, Gather):
            live[s.unit] = None
        elif isinstance(s, (Release, Reshard)):
            live.pop(s.unit, None)
    return OwnerSteps(tuple(one[:a]), tuple(two[a:b]), tuple(one[a:]), tuple(Release(u) for u in live))


class Action(NamedTuple):
    """What a work-stealing rank does next (decided by ``odcfn.schedule.steal.rank_program``):

    - ``own``: run the next piece of its own list (``more``: its list goes on after it);
    - ``help``: leave its list for a moment to run a slow rank's sample, then come back;
    - ``stop``: its list is over (``more``: free the units kept for a next microbatch);
    - ``steal``: run a sample stolen once its own list was over.
    """

    kind: Literal["own", "help", "stop", "steal"]
    samples: tuple[int, ...]
    more: bool


class Piece(NamedTuple):
    """A slice of a rank's program: plan steps and the microbatches (sample ids) they run,
    numbered from 0 *within the piece* (the runtime and the simulator add the rank's count of
    earlier microbatches). A static plan is one piece; a work-stealing rank's program is one
    piece per decision, each a cached tuple (so the simulator decodes it once)."""

    steps: tuple[Step, ...]
    microbatches: tuple[tuple[int, ...], ...] = ()


def _shift(steps: Sequence[Step], offset: int) -> tuple[Step, ...]:
    if not offset:
        return tuple(steps)
    return tuple(replace(s, mb=s.mb + offset) if isinstance(s, (Forward, Backward)) else s for s in steps)


def action_pieces(
    units: Sequence[str], action: Action, options: ScheduleOptions | None = None
) -> tuple[tuple[Step, ...], ...]:
    """The plan pieces one work-stealing action runs, in order, with ``mb=0``."""
    o = owner_steps(units, options)
    kind, flag = action.kind, action.more
    if kind == "own":
        return (o.middle if flag else o.last,)
    if kind == "stop":
        return (o.held,) if flag else ()
    frag = stealing_fragment(units, 0, options)
    if kind == "steal":
        return (frag,)
    return (o.held, frag, o.prefix)  # help: free what it holds, run it, re-gather


@lru_cache(maxsize=256)
def _action_steps(
    units: tuple[str, ...], kind: str, more: bool, options: ScheduleOptions
) -> tuple[Step, ...]:
    return tuple(s for p in action_pieces(units, Action(kind, (), more), options) for s in p)


def action_piece(units: Sequence[str], action: Action, options: ScheduleOptions | None = None) -> Piece:
    """One work-stealing action as a program piece (its sample, if any, is the piece's mb 0)."""
    steps = _action_steps(tuple(units), action.kind, action.more, options or ScheduleOptions())
    return Piece(steps, (action.samples,) if action.samples else ())


def assemble_plan(rank: int, comm: Comm, units: Sequence[str], pieces: Sequence[Piece]) -> Plan:
    """The plan a rank ran, from the pieces of its program in order (microbatches numbered in
    execution order)."""
    steps: list[Step] = []
    mbs: list[tuple[int, ...]] = []
    for p in pieces:
        steps += _shift(p.steps, len(mbs))
        mbs += p.microbatches
    return Plan(rank, comm, tuple(units), tuple(mbs), tuple(steps))


def stealing_pieces(
    units: Sequence[str], actions: Iterable[Action], options: ScheduleOptions | None = None
) -> Iterator[Piece]:
    """A work-stealing rank's program: the owner's prefix, one piece per action, then the Sync.
    Lazy: each action is taken from ``actions`` only when the previous piece has been run."""
    yield Piece(owner_steps(units, options).prefix)
    for a in actions:
        yield action_piece(units, a, options)
    yield Piece((Sync(),))


def realised_plan(
    units: Sequence[str], rank: int, actions: Sequence[Action], options: ScheduleOptions | None = None
) -> Plan:
    """The plan a work-stealing rank actually ran, microbatches numbered in execution order."""
    return assemble_plan(rank, "odc", units, tuple(stealing_pieces(units, actions, options)))
