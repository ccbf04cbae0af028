"""Bounded staleness in the simulator: minibatches chained by parameter versions, not a barrier.

The runtime's rule (docs/staleness.md): minibatch ``j`` of a rank reads parameter versions
``>= j - τ``; version ``k + 1`` exists once every rank's pushes for step ``k`` have reached the
owners (each owner applies ``k`` when every rank counted itself done with it, in step order).
τ = 0 is the synchronous ODC step: version ``j`` needs everybody's step ``j - 1``.

Static ODC plans make this a recurrence on per-rank durations. Before its sync an ODC plan meets
nobody (owners never wait, no collectives), so rank ``r``'s minibatch ``j``, started with idle
streams at ``s``, has its pushes landed at ``s + D[j][r]``, where ``D[j][r]`` is the synchronous
simulator's sync arrival for that minibatch (``SimResult.arrivals``). Then

    start[j][r]   = max(done[j-1][r], published[j - τ])        (start[0][r] = 0)
    done[j][r]    = start[j][r] + D[j][r]
    published[k+1] = max(published[k], max_r(start[k][r] + (D[k][r] + P)))

with ``P`` the sync's time under the comm model (``2 log2(W)`` latencies): announcing "done with
``k``" to every owner and its "version ``k+1`` published" back is charged what the sync costs,
so τ >= 1 only ever relaxes τ = 0's constraints and never gets slower, and at τ = 0 every rank
starts minibatch ``j + 1`` at the sync's end: the sum of the synchronous makespans, bit for bit
(the ``D + P`` grouping above is what makes the float sums identical). A rank flushes its own
pushes before it starts its next minibatch, as before a sync. The run ends when the last version
is published (``stale.drain``: every step applied everywhere).

Not modelled: the owners' optimizer time (the synchronous simulator has none either), a per-unit
τ (hybrid dicts: every unit here reads at the rank's τ), a rank pinning a newer version for a
later unit of the same minibatch (the lag is taken at the minibatch's start, so it is an upper
bound), and work stealing (its steals depend on which ranks share a minibatch at the same
moment, which the recurrence does not track); collective plans cannot run stale at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import Plan
from odcfn.schedule.simengine import Engine, mesh_for
from odcfn.schedule.simmodel import ZERO_COMM, CommModel, SimResult, Workload
from odcfn.schedule.simulate import simulate
from odcfn.sharding import Mesh

__all__ = ["StaleResult", "StaleTimeline", "check_staleness", "simulate_staleness", "stale_timeline"]


def check_staleness(tau: object, name: str = "staleness") -> int:
    """τ as an int >= 0, or a ``ValueError`` naming ``name`` (a bool is refused, as in StepConfig)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)) or tau < 0:
        raise ValueError(f"{name} must be an int >= 0 (τ: how many versions a read may lag), got {tau!r}")
    return int(tau)


@dataclass(frozen=True, eq=False)
class StaleTimeline:
    """When each rank starts and finishes each minibatch under τ (arrays are minibatch x rank)."""

    staleness: int
    starts: np.ndarray  # (M, W): when the rank starts minibatch j (the versions it needs exist)
    done: np.ndarray  # (M, W): when its pushes of minibatch j have all landed
    published: np.ndarray  # (M + 1,): when version k exists at every owner (published[0] = 0)
    publish: float  # P: what announcing "done" and publishing a version costs (the sync's time)

    @property
    def makespan(self) -> float:
        """When the last step is applied everywhere (the end of the last sync at τ = 0)."""
        return float(self.published[-1])

    @property
    def limit(self) -> float:
        """No τ beats this: the largest per-rank sum of minibatch times, plus the last publish."""
        return float((self.done - self.starts).sum(axis=0).max()) + self.publish

    @property
    def lags(self) -> np.ndarray:
        """(M, W): ``j - v``, ``v`` the newest version published when the rank starts minibatch
        ``j`` (what its first gather pins; its own step ``j`` is not yet in any version)."""
        m = len(self.starts)
        newest = np.searchsorted(self.published, self.starts, side="right") - 1  # published is sorted
        return np.arange(m)[:, None] - np.minimum(newest, np.arange(m)[:, None])

    @property
    def wait(self) -> np.ndarray:
        """Per rank: time between its pushes of one minibatch landing and its next start (at τ = 0
        the sync's wait), the last one up to the final publish."""
        nxt = np.vstack([self.starts[1:], np.full((1, self.starts.shape[1]), self.makespan)])
        return (nxt - self.done).sum(axis=0)


def stale_timeline(durations: Sequence[Sequence[float]] | np.ndarray, staleness: int, publish: float = 0.0
                   ) -> StaleTimeline:
    """The recurrence of the module docstring on ``durations[j][r]`` (rank r's minibatch j, from
    an idle start to its pushes landed) at τ = ``staleness``, publishing in ``publish`` seconds."""
    tau = check_staleness(staleness)
    d = np.asarray(durations, dtype=np.float64)
    if d.ndim != 2 or d.size == 0 or not np.isfinite(d).all() or (d < 0).any():
        raise ValueError(f"durations must be a non-empty minibatches x ranks array of finite times >= 0, "
                         f"got shape {d.shape}")
    if not (math.isfinite(publish) and publish >= 0):
        raise ValueError(f"publish must be a finite time >= 0, got {publish!r}")
    m, w = d.shape
    starts, done = np.zeros((m, w)), np.zeros((m, w))
    published = np.zeros(m + 1)
    for j in range(m):
        if j:
            s = done[j - 1]
            if j - tau >= 1:  # version j - τ needs step j - τ - 1 applied everywhere
                s = np.maximum(s, published[j - tau])
            starts[j] = s
        done[j] = starts[j] + d[j]
        # owners apply in step order, so a version never appears before the one below it
        published[j + 1] = max(published[j], float((starts[j] + (d[j] + publish)).max()))
    return StaleTimeline(tau, starts, done, published, float(publish))


@dataclass(frozen=True, eq=False)
class StaleResult:
    """A run of several minibatches under one τ: the timeline and the work done in it."""

    timeline: StaleTimeline
    busy: tuple[float, ...]  # per rank: forward + backward time over all minibatches
    num_samples: int
    num_tokens: int

    @property
    def staleness(self) -> int:
        return self.timeline.staleness

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    @property
    def bubble_rate(self) -> float:
        """As ``SimResult.bubble_rate``: 1 - compute time / (ranks x run time)."""
        t = self.makespan
        return 1.0 - sum(self.busy) / (len(self.busy) * t) if t > 0 else 0.0

    @property
    def wait_rate(self) -> float:
        """The share of rank-time spent waiting for versions (at τ = 0: at the sync)."""
        t = self.makespan
        return float(self.timeline.wait.sum()) / (len(self.busy) * t) if t > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.makespan if self.makespan > 0 else math.inf

    @property
    def lag_mean(self) -> float:
        return float(self.timeline.lags.mean())

    @property
    def lag_max(self) -> int:
        return int(self.timeline.lags.max())


def simulate_staleness(
    plans: Sequence[Sequence[Plan]],
    lengths: Sequence[Sequence[int]],
    staleness: Sequence[int] = (0, 1),
    *,
    workload: Workload | None = None,
    cost: CostModel = DEFAULT_COST,
    comm: CommModel = ZERO_COMM,
    mesh: Mesh | None = None,
    slowdowns: Sequence[Sequence[float] | None] | None = None,
) -> dict[int, StaleResult]:
    """Minibatch ``j`` is ``plans[j]`` (every rank's ODC plan) over ``lengths[j]``, with rank
    slowdowns ``slowdowns[j]``; each is simulated once, synchronously (``simulate``), and the
    runs at every τ in ``staleness`` are chained from those same timings. τ = 0 gives the sum of
    ``simulate``'s makespans exactly."""
    taus = [check_staleness(t) for t in staleness]
    if not plans or len(plans) != len(lengths):
        raise ValueError(f"need one lengths list per minibatch of plans: {len(plans)} plans, "
                         f"{len(lengths)} lengths")
    slowdowns = [None] * len(plans) if slowdowns is None else list(slowdowns)
    if len(slowdowns) != len(plans):
        raise ValueError(f"slowdowns has {len(slowdowns)} entries for {len(plans)} minibatches")
    world = len(plans[0])
    for j, ps in enumerate(plans):
        if len(ps) != world:
            raise ValueError(f"minibatch {j} has {len(ps)} plans, minibatch 0 has {world}")
        if any(p.comm != "odc" for p in ps):
            raise ValueError(f"minibatch {j} has collective plans: every rank meets at every unit's "
                             "collective, so none can run ahead (bounded staleness needs comm='odc')")
    work = workload or Workload(plans[0][0].units)
    mesh = mesh_for(mesh, world)
    runs: list[SimResult] = [
        simulate(ps, ls, workload=work, cost=cost, comm=comm, mesh=mesh, slowdown=sd, record=False)
        for ps, ls, sd in zip(plans, lengths, slowdowns)
    ]
    publish = Engine(work, mesh, comm, False).sync_time  # the sync's own cost, one definition
    durations = np.array([r.arrivals for r in runs])
    busy = tuple(float(b) for b in np.array([r.busy for r in runs]).sum(axis=0))
    n, tok = sum(r.num_samples for r in runs), sum(r.num_tokens for r in runs)
    return {t: StaleResult(stale_timeline(durations, t, publish), busy, n, tok) for t in taus}
