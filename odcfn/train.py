"""``grad_step`` and ``train_step``: balance -> compile -> execute -> one sync -> update."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from odcfn.batch import Batch
from odcfn.kernels.base import Counters, Transport
from odcfn.model import Model
from odcfn.optim import Optimizer, clip_scale
from odcfn.runtime import execute, execute_stealing
from odcfn.schedule.balance import (
    WORK_STEALING,
    Balancer,
    get_balancer,
)
from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import Comm, Plan, ScheduleOptions, compile_plan, owner_steps
from odcfn.schedule.steal import WorkStealing, steal_plan
from odcfn.sharding import Layout, Mesh, make_layout
from odcfn.sharding.layout import check_shards
from odcfn.trace import Event

__all__ = ["StepMetrics", "grad_step", "train_step"]


@dataclass
class StepMetrics:
    loss: float
    grad_norm: float
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    step_time: float  # this rank's wall time for the step, sync included
    plan: Plan
    counters: Counters  # what the transport did during this step
    events: list[Event] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.step_time

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.step_time


def _validate(
    params: Mapping[str, torch.Tensor], batch: Batch, model: Model, mesh: Mesh,
    transport: Transport, comm: str,
) -> Layout:
    if not isinstance(model, Model):
        raise TypeError(f"model must be an odcfn.Model, got {type(model).__name__}")
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be an odcfn.Batch, got {type(batch).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be an odcfn.Mesh, got {type(mesh).__name__}")
    if comm not in ("odc", "collective"):
        raise ValueError(f"comm must be 'odc' or 'collective', got {comm!r}")
    if transport.mesh != mesh:
        raise ValueError(f"transport serves {transport.mesh}, but train_step was given {mesh}")
    layout = make_layout(model, mesh)
    check_shards(params, layout, model.dtype)
    return layout


def grad_step(
    params: Mapping[str, torch.Tensor],
    batch: Batch,
    *,
    model: Model,
    mesh: Mesh,
    transport: Transport,
    comm: Comm = "odc",
    balance: str | Balancer | WorkStealing = "round_robin",
    max_tokens_per_microbatch: int | None = None,
    options: ScheduleOptions | None = None,
    compute_dtype: torch.dtype | None = None,
    slowdown: float = 1.0,
    cost: CostModel | None = None,
) -> tuple[dict[str, torch.Tensor], StepMetrics]:
    """Gradient shards (this rank's, of the minibatch-mean loss) and metrics for one minibatch.

    The returned gradients are the transport's accumulators: valid until the next step.
    All input checks happen before any communication, identically on every rank.
    """
    t0 = time.perf_counter()
    layout = _validate(params, batch, model, mesh, transport, comm)
    cap = max(batch.lengths) if max_tokens_per_microbatch is None else max_tokens_per_microbatch
    if isinstance(balance, str) and balance == WORK_STEALING:
        balance = WorkStealing()
    stealing = isinstance(balance, WorkStealing)
    if stealing:  # dynamic: samples move between ranks at run time (ODC only)
        if comm != "odc":
            raise ValueError(
                f"balance='work_stealing' needs comm='odc' (got comm={comm!r}): collectives need "
                "every rank to run the same microbatches in lockstep, known in advance"
            )
        sp = steal_plan(
            batch.lengths, mesh.world_size, cap, cost=cost or DEFAULT_COST, split_cost=balance.split_cost
        )
        limit = getattr(transport, "max_counters", None)
        if limit is not None and sp.num_counters > limit:
            raise ValueError(
                f"work stealing needs {sp.num_counters} shared counters for {len(batch)} samples on "
                f"{mesh.world_size} ranks; this transport has {limit}: use a smaller minibatch"
            )
        owner_steps(model.unit_names, options)  # bad options fail here, not later
    else:
        assignment = get_balancer(balance, cost=cost)(batch.lengths, mesh.world_size, cap)
        plan = compile_plan(model.unit_names, assignment, mesh.rank, comm, options)
    dtype = compute_dtype or model.dtype
    device = next(iter(params.values())).device  # compute follows the parameter shards
    before = transport.counters.copy()
    transport.begin_step(layout, params, dtype)
    if stealing:
        result, plan = execute_stealing(
            sp, model=model, layout=layout, batch=batch, transport=transport,
            compute_dtype=dtype, options=options, policy=balance, slowdown=slowdown, device=device,
        )
    else:
        result = execute(
            plan, model=model, layout=layout, batch=batch, transport=transport,
            compute_dtype=dtype, slowdown=slowdown, device=device,
        )
    metrics = StepMetrics(
        loss=result.loss_sum / batch.num_loss_tokens,
        grad_norm=result.grad_norm,
        num_samples=len(batch),
        num_tokens=sum(batch.lengths),
        num_loss_tokens=batch.num_loss_tokens,
        step_time=time.perf_counter() - t0,
        plan=plan,
        counters=transport.counters - before,
        events=result.events,
    )
    return transport.grad_shards(), metrics


def train_step(
    params: Mapping[str, torch.Tensor],
    batch: Batch,
    *,
    opt_state: dict,
    model: Model,
    optimizer: Optimizer,
    mesh: Mesh,
    transport: Transport,
    comm: Comm = "odc",
    balance: str | Balancer | WorkStealing = "round_robin",
    max_tokens_per_microbatch: int | None = None,
    options: ScheduleOptions | None = None,
    compute_dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    slowdown: float = 1.0,
    cost: CostModel | None = None,
) -> tuple[dict[str, torch.Tensor], dict, StepMetrics]:
    """One optimizer step on one minibatch; returns (new params, new opt_state, metrics)."""
    grads, metrics = grad_step(
        params, batch, model=model, mesh=mesh, transport=transport, comm=comm, balance=balance,
        max_tokens_per_microbatch=max_tokens_per_microbatch, options=options,
        compute_dtype=compute_dtype, slowdown=slowdown, cost=cost,
    )
    scale = clip_scale(metrics.grad_norm, max_grad_norm)
    new_params, new_state = optimizer.update(grads, opt_state, params, grad_scale=scale)
    return new_params, new_state, metrics
