"""The exact replay of a bounded-staleness run (``odcfn.reference.replay(..., exact=True)``).

A stale run is a deterministic function of its record: the plan each rank ran in each step and
the version of each unit it gathered (``odcfn.step.stale.record(metrics, plans=True)``). This
module recomputes it on one process with the runtime's own pieces, so that a run with
``StepConfig(deterministic=True)`` equals it bit for bit:

- each rank's share of step ``k`` is the runtime's ``Executor`` running that rank's recorded plan
  (same microbatches, same packing, same unit functions, same order of steps) on a transport
  whose gathers copy the recorded versions' shards and whose pushes go, owner piece by owner
  piece, into that rank's own fp32 sums (``versions_det.accumulate``);
- each owner's gradient is ``versions_det.rank_order_sum`` of those sums, and the optimizer
  updates each owner's shards on their own, as ``stale._Owner.apply`` does.

It is therefore no independent check of the executor or of the gradient maths (the independent
``replay`` differentiates the loss sample by sample for that); it checks the stale protocol:
that every gather read the version it recorded, unmixed and untorn, that every push reached its
owner's step once, and that owners applied steps in order on the right versions.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from odcfn import trainable
from odcfn.batch import Batch
from odcfn.model import Model
from odcfn.optim import Optimizer
from odcfn.schedule.plan import Plan
from odcfn.sharding import Layout, Mesh, make_layout, shard, unshard
from odcfn.step.execute import Executor
from odcfn.step.state import StepConfig
from odcfn.transport.base import Counters, Done, Handle
from odcfn.transport.versions_det import accumulate, rank_order_sum
from odcfn.tree import PyTree

__all__ = ["replay_exact"]

Shards = dict[str, torch.Tensor]


class _Recorded:
    """The transport one rank's executor sees in the replay of one step."""

    def __init__(self, mesh: Mesh, layout: Layout, versions: Mapping[str, int],
                 history: Mapping[int, Sequence[Shards]], parts: Sequence[Shards]) -> None:
        self.mesh, self.layout, self.versions = mesh, layout, versions
        self.history, self.parts = history, parts
        self.counters = Counters()  # the executor's trace reads bytes moved; a replay moves none

    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        if unit not in self.versions:
            raise ValueError(f"replay: rank {self.mesh.rank}'s plan gathers {unit!r}, which its record "
                             "does not list (a record of another run?)")
        v, size = self.versions[unit], self.layout[unit].shard_size
        for o, shards in enumerate(self.history[v]):  # owner by owner, as StaleLocal.gather copies
            out[o * size:(o + 1) * size].copy_(shards[unit])
        return Done()

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        size = self.layout[unit].shard_size
        for o, part in enumerate(self.parts):  # the pieces StaleLocal.scatter_accumulate adds
            accumulate(part, unit, grad[o * size:(o + 1) * size])
        return Done()


class _ReplayExecutor(Executor):
    def sync(self) -> torch.Tensor:  # the pushes are already in place; nobody to tell
        return self.loss_sum


def _plan(entry: Any, k: int, r: int) -> Plan:
    if not isinstance(entry, Plan):
        raise TypeError(f"replay(exact=True): record[{k}][{r}] holds sample ids, not the plan that ran: "
                        "make the record with odcfn.step.stale.record(metrics, plans=True)")
    return entry


def replay_exact(model: Model, params: PyTree, optimizer: Optimizer, batches: Sequence[Batch],
                 record: Sequence[Sequence[tuple[Any, Mapping[str, int]]]], *, start: int = 0,
                 config: StepConfig | None = None, router_bias: torch.Tensor | None = None) -> PyTree:
    """The params a stale run ends with (``odcfn.reference.replay(..., exact=True)``):
    ``record[k][r] = (plan, {unit: version})`` of rank ``r`` in step ``start + k``; ``config``:
    the run's ``StepConfig`` (its loss and compute dtype); ``router_bias``: a mixture's fixed
    aux-loss-free bias (the run's ``TrainState.router_bias``). Bit-identical to a run with
    ``deterministic=True``; equal to any other stale run up to fp32 summation order."""
    config = StepConfig() if config is None else config
    world = {len(ranks) for ranks in record}
    if len(world) != 1:
        raise ValueError(f"replay: every step of the record needs the same ranks, got {sorted(world)}")
    w = world.pop()
    meshes = [Mesh(w, r) for r in range(w)]
    layouts = [make_layout(model, m) for m in meshes]
    dtype = config.compute_dtype or model.dtype
    first: list[Shards] = []
    for m in meshes:  # as TrainState.create shards the full params for each rank
        s = dict(shard(params, model, m))
        if config.compute_dtype is not None and model.frozen and dtype.itemsize < model.dtype.itemsize:
            s.update({u: s[u].to(dtype) for u in model.frozen})
        first.append(s)
    history: dict[int, list[Shards]] = {start: first}
    device = next(iter(first[0].values())).device  # compute follows the shards, as in the run
    opts = [optimizer.for_layout(lay) for lay in layouts]
    states = [optimizer.init(trainable.split(model, s)) for s in first]
    trained = [u.name for u in layouts[0].units if not u.frozen]
    sizes = {u.name: u.shard_size for u in layouts[0].units}
    # the oldest version each step onwards still reads: older ones are dropped as the replay goes
    oldest = [min([k + start, *(v for _, vs in ranks for v in vs.values())])
              for k, ranks in enumerate(record)]
    for i in range(len(oldest) - 2, -1, -1):
        oldest[i] = min(oldest[i], oldest[i + 1])
    for i, (batch, ranks) in enumerate(zip(batches, record, strict=True)):
        k = start + i
        batch = copy.copy(batch)
        object.__setattr__(batch, "step", k)  # as the stale train_step keys training-time randomness
        parts: list[list[Shards]] = [[{} for _ in range(w)] for _ in range(w)]  # [owner][rank]
        for r, (entry, versions) in enumerate(ranks):
            plan = _plan(entry, k, r)
            if bad := {u: v for u, v in versions.items() if v not in history or v > k}:
                raise ValueError(f"replay: rank {r} read versions {bad} at step {k}, outside {start}..{k}")
            t = _Recorded(meshes[r], layouts[r], versions, history, [p[r] for p in parts])
            ex = _ReplayExecutor(model, layouts[r], batch, t, dtype, device, config.loss)
            ex.router_bias = router_bias  # routes as the run did
            ex.microbatches.extend(plan.microbatches)
            ex.run_steps(plan.steps, 0, time.perf_counter(), ex.events)
        new: list[Shards] = []
        for o in range(w):  # each owner's update on its own shards, as stale._Owner.apply
            grads = rank_order_sum(parts[o], trained, sizes)
            mine = history[k][o]
            ours, theirs = trainable.split(model, grads), trainable.split(model, mine)
            upd, states[o] = opts[o].update(ours, states[o], theirs)
            new.append({**mine, **upd} if model.frozen else upd)
        history[k + 1] = new
        keep = oldest[i + 1] if i + 1 < len(oldest) else k + 1
        for v in [v for v in history if v < keep]:
            del history[v]
    return unshard(history[max(history)], model, meshes[0])
