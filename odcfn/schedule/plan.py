"""The plan compiler: one rank's program for one minibatch, as a tuple of frozen steps.

The same Plan is executed by ``odcfn.step.execute`` on a transport and timed by the simulator, so a
measured trace and a simulated one line up step by step. The steps and ``Plan`` themselves live
in ``odcfn.schedule.plan_ir`` (re-exported here); this module holds the options and the compiler.

ODC mode: each rank runs its own microbatches (counts may differ) with point-to-point
``Gather``/``ScatterAccumulate`` and meets the others only at the final ``Sync``.
Collective mode (the FSDP baseline): ``AllGather``/``ReduceScatter`` that every rank in the shard
group issues in the same order, so ranks with fewer microbatches run empty ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from odcfn.schedule.plan_ir import (
    COLLECTIVE_STEPS,  # noqa: F401  (re-exported: the IR's collective step kinds)
    AllGather,
    Assignment,
    Backward,
    Comm,
    Forward,
    Gather,
    Plan,
    ReduceScatter,
    Release,
    Reshard,
    ScatterAccumulate,
    Step,
    Sync,
)

__all__ = [
    "AllGather",
    "Assignment",
    "Backward",
    "Comm",
    "Forward",
    "Gather",
    "Plan",
    "ReduceScatter",
    "Release",
    "Reshard",
    "ScatterAccumulate",
    "ScheduleOptions",
    "Step",
    "Sync",
    "compile_forward_plan",
    "compile_plan",
    "microbatch_steps",
]


@dataclass(frozen=True)
class ScheduleOptions:
    prefetch: int = 1  # gathers issued this many compute steps ahead of their use
    # True: free gathered params after forward, re-gather them for backward from their owners;
    # False: keep them until backward; an int k (hierarchical shards, ZeRO++'s hpZ, FSDP2's
    # integer form): keep a 1/k secondary shard in k-rank groups (ranks [0, k), [k, 2k), ...) and
    # re-gather for backward from the group only. k must divide the shard group's size.
    reshard_after_forward: bool | int = True
    remat: frozenset[str] = field(default_factory=frozenset)  # units recomputed in backward
    # (unit, earlier units whose parameters it also reads): tied weights. train_step fills it
    # from the model (``Model.uses``); each use costs a gather of the used unit
    uses: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # units not trained (``Model.frozen``, filled by train_step): no push ever; no Backward
    # before the first trained unit (nothing upstream needs the activation gradient)
    frozen: frozenset[str] = field(default_factory=frozenset)
    # units whose fwd reads none of their own parameters and returns x (LoRA's adapter units,
    # read by the layer after them): never gathered for their own Forward/Backward
    passthrough: frozenset[str] = field(default_factory=frozenset)
    # (unit, its expert units): a mixture of experts (``Model.routed``, filled by train_step).
    # The experts are not steps of the chain: ODC gathers them inside the unit's steps
    # (``Forward.routed``), collective mode all-gathers every one of them with the unit, as FSDP
    routed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    expert_group: int = 8  # ODC: experts of one unit gathered (resident) at once

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"ScheduleOptions.prefetch must be an int >= 0, got {self.prefetch!r}")
        k = self.reshard_after_forward
        if not isinstance(k, (bool, int)) or (not isinstance(k, bool) and k < 1):
            raise ValueError(
                f"ScheduleOptions.reshard_after_forward must be True, False or an int k >= 1 (the "
                f"hierarchical shard group's size), got {k!r}"
            )
        g = self.expert_group
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"ScheduleOptions.expert_group must be an int >= 1, got {g!r}")
        object.__setattr__(self, "routed", tuple((str(u), tuple(es)) for u, es in self.routed))
        object.__setattr__(self, "remat", frozenset(self.remat))
        object.__setattr__(self, "frozen", frozenset(self.frozen))
        object.__setattr__(self, "passthrough", frozenset(self.passthrough))
        object.__setattr__(self, "uses", tuple((str(u), tuple(vs)) for u, vs in self.uses))

    @property
    def hpz(self) -> int:
        """The hierarchical shard group's size (``reshard_after_forward=k``), 0 if none."""
        k = self.reshard_after_forward
        return 0 if isinstance(k, bool) else k

    def check_hpz(self, group_size: int, comm: Comm = "odc") -> None:
        """``reshard_after_forward=k`` against the shard group (the world under full sharding):
        called before any communication."""
        k = self.hpz
        if not k:
            return
        if group_size % k:
            raise ValueError(
                f"ScheduleOptions.reshard_after_forward={k} does not divide the shard group's size "
                f"{group_size} (the world size under full sharding)"
            )
        if comm != "odc":
            raise ValueError(
                f"ScheduleOptions.reshard_after_forward={k} (hierarchical shards) needs comm='odc'; "
                "collective mode takes True or False"
            )



def chain(units: Sequence[str], options: ScheduleOptions) -> list[str]:
    """The units the forward runs through: all but the expert units (``ScheduleOptions.routed``)."""
    experts = {e for _, es in options.routed for e in es}
    return [u for u in units if u not in experts]


def microbatch_steps(units: Sequence[str], mb: int, comm: Comm, options: ScheduleOptions) -> list[Step]:
    """Forward then backward of one microbatch, each gather right before its first use."""
    gather = Gather if comm == "odc" else AllGather
    push = ScatterAccumulate if comm == "odc" else ReduceScatter
    reshard = options.reshard_after_forward is not False
    k = options.hpz if comm == "odc" else 0
    units = chain(units, options)
    uses = dict(options.uses)
    experts = dict(options.routed)
    # collective mode gathers every expert with its unit (FSDP); ODC routes inside the step
    held_with = {u: (*uses.get(u, ()), *(experts.get(u, ()) if comm == "collective" else ())) for u in units}
    routed = {u: options.expert_group for u in experts} if comm == "odc" else {}
    last = len(units) - 1
    steps: list[Step] = []
    held: set[str] = set()
    secondary: set[str] = set()  # units whose group shard this microbatch built (hpZ)
    borrowed: dict[str, list[str]] = {}  # used units gathered for a unit's forward, still held

    def get(names: Sequence[str]) -> list[str]:
        """Gather what is not held (from the group's secondary shards once built); returns what
        it gathered."""
        fresh = [n for n in names if n not in held]
        steps.extend(Gather(n, k) if n in secondary else gather(n) for n in fresh)
        held.update(fresh)
        return fresh

    def drop(names: Sequence[str]) -> None:
        names = [n for n in names if n in held]
        steps.extend(Release(n) for n in names)
        held.difference_update(names)

    def own(u: str) -> list[str]:
        return [] if u in options.passthrough else [u]

    first = first_trained(units, options.frozen)
    for i, u in enumerate(units):
        get(own(u))
        extra = get(held_with[u])
        steps.append(Forward(u, mb, remat=u in options.remat, uses=uses.get(u, ()), routed=routed.get(u, 0)))
        if (reshard and i < last) or i < first:  # the last unit's backward follows at once: keep it
            if k and u in held:  # hpZ: its backward re-gathers it from the group
                steps.append(Reshard(u, k))
                held.discard(u)
                secondary.add(u)
            drop([u, *extra])
        else:
            borrowed[u] = extra
    for i in range(last, first - 1, -1):
        u = units[i]
        get(own(u))
        extra = borrowed.pop(u, []) + get(held_with[u])
        steps.append(Backward(u, mb, uses=uses.get(u, ()), routed=routed.get(u, 0)))
        if u not in options.frozen:
            steps.append(push(u))
        if comm == "collective":  # every expert joins the reduce-scatter, used or not
            steps.extend(push(e) for e in experts.get(u, ()) if e not in options.frozen)
        drop([u, *extra])
    return steps


def secondary_steps(units: Sequence[str], options: ScheduleOptions) -> list[Step]:
    """hpZ on a rank without microbatches: it still builds its slice of every group shard its
    group's peers will read in their backward (they wait for it, never for its forwards)."""
    one = microbatch_steps(units, 0, "odc", options)
    built = [s.unit for s in one if isinstance(s, Reshard)]
    return [step for u in built for step in (Gather(u), Reshard(u, options.hpz))]


def first_trained(units: Sequence[str], frozen: frozenset[str]) -> int:
    """Index of the first trained unit: the units before it run forward only (no Backward)."""
    return next((i for i, u in enumerate(units) if u not in frozen), 0)


def _keep_across_microbatches(steps: list[Step]) -> list[Step]:
    """Drop ``Release(u), Gather(u)`` back to back (the first unit at a microbatch boundary):
    parameters cannot change inside a minibatch, so re-fetching them is pure waste."""
    out: list[Step] = []
    for s in steps:
        if (
            isinstance(s, (Gather, AllGather))
            and out
            and isinstance(out[-1], Release)
            and out[-1].unit == s.unit
        ):
            out.pop()
            continue
        out.append(s)
    return out


def hoist_gathers(steps: list[Step], depth: int) -> list[Step]:
    """Move each gather up to ``depth`` compute steps earlier (prefetch), never above a step
    that still uses or frees the same unit's buffer, nor above another gather: gathers keep
    program order, so all-gathers pair up across ranks whose compute steps differ (a forward-only
    plan's ranks run different microbatch counts, some none)."""
    out: list[Step] = []
    for s in steps:
        out.append(s)
        if not isinstance(s, (Gather, AllGather)):
            continue
        i, passed = len(out) - 1, 0
        while i > 0 and passed < depth:
            prev = out[i - 1]
            if getattr(prev, "unit", None) == s.unit or s.unit in getattr(prev, "uses", ()):
                break
            if isinstance(prev, (Sync, Gather, AllGather)):
                break
            out[i - 1], out[i] = out[i], out[i - 1]
            i -= 1
            passed += isinstance(prev, (Forward, Backward))
    return out


def check_remat(units: Sequence[str], options: ScheduleOptions) -> None:
    unknown = sorted(options.remat - set(units))
    if unknown:
        raise ValueError(f"ScheduleOptions.remat names units the model does not have: {unknown}")
    for u, used in options.uses:
        if u not in units or any(v not in units[: units.index(u)] for v in used):
            raise ValueError(
                f"ScheduleOptions.uses has {u!r} using {list(used)}: each must be a unit before it "
                f"(units {list(units)})"
            )


def _check_args(
    assignment: Assignment, rank: int, comm: Comm, options: ScheduleOptions | None
) -> ScheduleOptions:
    if comm not in ("odc", "collective"):
        raise ValueError(f"comm must be 'odc' or 'collective', got {comm!r}")
    if not 0 <= rank < len(assignment):
        raise ValueError(f"rank {rank} is outside the assignment's {len(assignment)} ranks")
    return options or ScheduleOptions()


def compile_plan(
    units: Sequence[str],
    assignment: Assignment,
    rank: int,
    comm: Comm = "odc",
    options: ScheduleOptions | None = None,
) -> Plan:
    """Compile ``rank``'s plan for one minibatch.

    In collective mode every rank gets as many microbatches as the busiest rank, padding with
    empty ones, so that all ranks issue identical collectives.
    """
    options = _check_args(assignment, rank, comm, options)
    check_remat(units, options)
    options.check_hpz(len(assignment), comm)
    mbs = tuple(tuple(m) for m in assignment[rank])
    if comm == "collective":
        n = max(len(a) for a in assignment)
        mbs = mbs + ((),) * (n - len(mbs))
    steps: list[Step] = []
    for i in range(len(mbs)):
        steps += microbatch_steps(units, i, comm, options)
    if not mbs and options.hpz:
        steps += secondary_steps(units, options)
    steps = hoist_gathers(_keep_across_microbatches(steps), options.prefetch)
    steps.append(Sync())
    return Plan(rank, comm, tuple(units), mbs, tuple(steps))


def compile_forward_plan(
    units: Sequence[str],
    assignment: Assignment,
    rank: int,
    comm: Comm = "odc",
    options: ScheduleOptions | None = None,
) -> Plan:
    """A forward-only plan (``odcfn.log_probs``): unit by unit, each gathered once, every
    microbatch of the rank through it, released; then the Sync. No Backward, no scatter.

    Unit-major order gathers each unit once per minibatch whatever the microbatch count (only
    the activations between units are kept, and no autograd graph), so collective mode issues
    the same all-gathers on every rank without padding; an ODC rank with no samples gathers
    nothing.
    """
    options = _check_args(assignment, rank, comm, options)
    mbs = tuple(tuple(m) for m in assignment[rank])
    gather = Gather if comm == "odc" else AllGather
    uses, experts = dict(options.uses), dict(options.routed)
    steps: list[Step] = []
    if mbs or comm == "collective":
        for u in chain(units, options):
            # tied weights: the units it reads are gathered with it; so are all of a unit's
            # experts in collective mode (ODC routes them inside the step)
            held = (*([] if u in options.passthrough else [u]), *uses.get(u, ()),
                    *(experts.get(u, ()) if comm == "collective" else ()))
            routed = options.expert_group if comm == "odc" and u in experts else 0
            steps += [gather(n) for n in held]
            steps += [Forward(u, i, uses=uses.get(u, ()), routed=routed) for i in range(len(mbs))]
            steps += [Release(n) for n in held]
    steps = hoist_gathers(steps, options.prefetch)
    steps.append(Sync())
    return Plan(rank, comm, tuple(units), mbs, tuple(steps))
