"""``execute``: run one rank's program (plan pieces) on a transport up to its one Sync, with the
executor of ``odcfn.step.execute``; the result the step reads back."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from odcfn.batch import Batch
from odcfn.model import Model
from odcfn.schedule.plan import Plan
from odcfn.schedule.program import Piece, assemble_plan
from odcfn.sharding import Layout
from odcfn.step.execute import Executor
from odcfn.step.ordered_push import OrderedPusher
from odcfn.trace import Event
from odcfn.transport.base import Transport

__all__ = ["ExecResult", "execute"]


@dataclass
class ExecResult:
    loss_sum: float  # global, after the sync: the weighted, i.e. final, loss
    grad_norm: float  # global L2 norm of the unclipped gradient of the normalised loss
    events: list[Event] = field(default_factory=list)
    riders: torch.Tensor | None = None  # the summed extra stats the caller had ride the sync
    loss_metrics: tuple[float, ...] = ()  # a loss object's metric sums, in its metric_names order
    expert_loads: torch.Tensor | None = None  # a mixture's tokens per expert, sparse layers x E, summed
    aux_loss: float | None = None  # a mixture's load-balancing loss, the part of loss_sum it makes



def execute(
    program: Iterable[Piece],
    *,
    model: Model,
    layout: Layout,
    batch: Batch,
    transport: Transport,
    compute_dtype: torch.dtype,
    comm: str = "odc",
    device: torch.device | str = "cpu",
    riders: torch.Tensor | None = None,
    loss: Any,
    deterministic: bool = False,
    slots: int = 0,
    router_bias: torch.Tensor | None = None,
) -> tuple[ExecResult, Plan]:
    """Run a rank's program (``odcfn.schedule.policy.prepare_program``: a static plan is one
    piece, work stealing one piece per decision) up to and including its one Sync; the
    transport then holds this rank's gradient shards. Returns the result and the plan that ran.
    ``riders``: float64 values summed over the ranks in the same sync (``ExecResult.riders``).
    ``deterministic``: ODC pushes taken in a fixed (microbatch slot, rank) order (``StepConfig``;
    ``slots``: the most microbatches any rank runs; the program must be static)."""
    t0 = time.perf_counter()
    ex = Executor(model, layout, batch, transport, compute_dtype, torch.device(device), loss)
    ex.riders, ex.t0, ex.router_bias = riders, t0, router_bias
    if deterministic and comm == "odc":
        program = list(program)  # static (work stealing is refused): one piece
        mine = sum(len(p.microbatches) for p in program)
        ex.ordered = OrderedPusher(transport, layout, max(slots, mine), mine)
    events = ex.events
    ran: list[Piece] = []
    stats = None
    for piece in program:
        offset = len(ex.microbatches)
        ex.microbatches.extend(piece.microbatches)
        ran.append(piece)
        got = ex.run_steps(piece.steps, offset, t0, events)
        stats = got if got is not None else stats
    if stats is None:
        raise ValueError("the program has no Sync step")
    plan = assemble_plan(ex.rank, comm, model.unit_names, ran)
    m = len(loss.metric_names)
    extra = tuple(float(x) for x in stats[2:2 + m])
    n = 0 if ex.loads is None else ex.loads.numel() + 1  # the loads, then the aux loss
    loads = None if ex.loads is None else stats[2 + m:1 + m + n].reshape(ex.loads.shape).cpu()
    aux = None if ex.loads is None else float(stats[1 + m + n])
    norm = float(stats[1].clamp_min(0).sqrt())
    result = ExecResult(float(stats[0]), norm, events, stats[2 + m + n:], extra, loads, aux)
    return result, plan
