"""``grad_step`` and ``train_step``: validate -> program -> execute (one sync) -> update.

```
cfg = state.config
program = prepare_program(cfg.balance, batch.lengths, ...)   # every check, no communication
transport.begin_step(layout, params, dtype)                  # publish this step's shards
result, plan = execute(program, ...)                         # gathers, compute, pushes, ONE sync
params, opt_state = optimizer.update(grads, ...)             # each rank updates what it owns
```
"""

from __future__ import annotations

import copy
import math
import time

import torch

from odcfn import preference, trainable
from odcfn.batch import Batch
from odcfn.losses import check_loss, loss_metrics
from odcfn.moe.router import update_bias
from odcfn.optim import clip_scale
from odcfn.schedule.policy import prepare_program, resolve_policy
from odcfn.sharding import Layout
from odcfn.step import fingerprint, offload, stale
from odcfn.step.agree import check_trained_units
from odcfn.step.experts import expert_load_metrics
from odcfn.step.frozen_quant import frozen_format
from odcfn.step.ordered_push import check_counters, check_head
from odcfn.step.prepare import (
    check_inputs,
    minibatch_fingerprint,
    recording,
    schedule_options,
)
from odcfn.step.run import execute
from odcfn.step.state import StepConfig, StepMetrics, TrainState, donate
from odcfn.step.wire import begin_step, check_transport, step_wire

__all__ = ["StepMetrics", "check_inputs", "grad_step", "minibatch_fingerprint", "train_step"]


def _grads(state: TrainState, batch: Batch) -> tuple[dict[str, torch.Tensor], StepMetrics, Layout]:
    """The transport's accumulators (valid until its next step), the step's metrics, the layout."""
    t0 = time.perf_counter()
    layout = check_inputs(state, batch)
    if batch.step != state.step:  # training-time randomness (LoRA dropout) is keyed on the step
        batch = copy.copy(batch)  # the caller's batch is not changed; no re-validation
        object.__setattr__(batch, "step", state.step)
    cfg, model, transport, mesh = state.config, state.model, state.transport, state.mesh
    check_loss(cfg.loss).validate(batch)  # the extras it needs, on every rank, before any communication
    # a pair batch is balanced one unit per pair (odcfn.preference): both members in one microbatch
    lengths, cap = preference.schedule_lengths(batch, cfg.max_tokens_per_microbatch)
    seen: list = []
    program = prepare_program(
        recording(cfg.balance, seen), lengths, units=model.unit_names, world_size=mesh.world_size,
        rank=mesh.rank,
        max_tokens=cap, comm=cfg.comm, options=schedule_options(cfg.options, model, cfg.remat), cost=cfg.cost,
        fetch_add=getattr(transport, "fetch_add", None),
        max_counters=getattr(transport, "max_counters", None),
    )
    program = preference.expand_program(program, batch)
    published = offload.shards(state)  # offloaded masters: their resident copies
    device = next(iter(published.values())).device  # compute follows the parameter shards
    if cfg.deterministic:
        check_head(cfg.loss, device)
    slots = 0
    if cfg.deterministic and cfg.comm == "odc":  # the turn order spans the busiest rank's microbatches
        check_counters(sum(not u.frozen for u in layout.units), getattr(transport, "max_counters", None))
        assignment = seen[-1] if seen else resolve_policy(cfg.balance, cfg.comm, cfg.cost)(
            batch.lengths, mesh.world_size, cap)
        slots = max(len(r) for r in assignment)
    dtype = cfg.compute_dtype or model.dtype
    words, detail = minibatch_fingerprint(state, batch, layout, seen[-1] if seen else None)
    wire = step_wire(cfg)
    check_transport(transport, wire)  # a transport without quantized formats: refused here
    before = transport.counters.copy()
    check_trained_units(transport, layout, mesh)  # before the first push into a missing accumulator
    hpz = cfg.options.hpz if cfg.options is not None and cfg.comm == "odc" else 0
    if hpz and callable(getattr(transport, "reserve_secondary", None)):
        transport.reserve_secondary(hpz)  # transports whose hpZ slices need room laid out first (GPU)
    begin_step(transport, layout, published, dtype, wire, frozen_format(cfg))
    result, plan = execute(
        program, model=model, layout=layout, batch=batch, transport=transport,
        compute_dtype=dtype, comm=cfg.comm, device=device, riders=fingerprint.encode(words, device),
        loss=cfg.loss, deterministic=cfg.deterministic, slots=slots, router_bias=state.router_bias,
    )
    # every rank sees the same sums, so every rank raises alike (before any optimizer step)
    fingerprint.check_agreement(result.riders, mesh.world_size, words, detail)
    finite = math.isfinite(result.loss_sum) and math.isfinite(result.grad_norm)
    if not finite and cfg.nonfinite == "raise":
        raise FloatingPointError(
            f"step {state.step}: the minibatch's loss sum is {result.loss_sum} and its gradient norm "
            f"{result.grad_norm}: refusing the step (params and optimizer state unchanged; "
            "StepConfig(nonfinite='skip') skips such steps instead)"
        )
    metrics = StepMetrics(
        loss=result.loss_sum,
        grad_norm=result.grad_norm,
        num_samples=len(batch),
        num_tokens=sum(batch.lengths),
        num_loss_tokens=batch.num_loss_tokens,
        step_time=time.perf_counter() - t0,
        plan=plan,
        counters=transport.counters - before,
        events=result.events,
        extra=loss_metrics(cfg.loss, result.loss_metrics, batch.num_loss_tokens),
    )
    if not finite:
        metrics.extra["skipped_nonfinite"] = True
    if result.expert_loads is not None:
        metrics.extra.update(expert_load_metrics(model, result.expert_loads))
        if model.router.aux_coef:  # included in metrics.loss; off (0) unless output_router_logits
            metrics.extra["moe/aux_loss"] = result.aux_loss
    return transport.grad_shards(), metrics, layout


def grad_step(state: TrainState, batch: Batch) -> tuple[dict[str, torch.Tensor], StepMetrics]:
    """This rank's gradient shards of the minibatch-mean loss, and the step's metrics.

    The gradients are copies the caller owns (the next step does not overwrite them). Every
    input check happens before any communication, identically on every rank.
    """
    if isinstance(state, TrainState) and isinstance(state.config, StepConfig) and stale.active(state.config):
        raise ValueError(
            "grad_step cannot run with StepConfig.staleness >= 1: under staleness the owners consume "
            "a step's gradients themselves, asynchronously (use train_step, or staleness=0)"
        )
    grads, metrics, _ = _grads(offload.adopt(state), batch)
    return {k: g.clone() for k, g in trainable.split(state.model, grads).items()}, metrics


def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
    """One optimizer step on one minibatch: ``(new state, metrics)``."""
    if isinstance(state, TrainState) and isinstance(state.config, StepConfig) and stale.active(state.config):
        return stale.train_step(state, batch)  # τ >= 1: per-owner versions, no global sync
    state = offload.adopt(state)
    stream = offload.prefetch(state)  # offloaded state: the first units load during the compute
    try:
        grads, metrics, layout = _grads(state, batch)
    except BaseException:
        if stream is not None:
            stream.cancel()
        raise
    if metrics.extra.get("skipped_nonfinite"):  # nonfinite="skip": nothing changes
        if stream is not None:
            stream.cancel()
        return state, metrics
    scale = clip_scale(metrics.grad_norm, state.config.max_grad_norm)
    optimizer = state.optimizer.for_layout(layout)  # a decay mask needs it
    trained = trainable.split(state.model, state.params)  # frozen units: no state, never updated
    grads = trainable.split(state.model, grads)
    if stream is not None:  # streamed unit by unit through the budget, in place
        params, opt_state = state.params, offload.update(state, stream, optimizer, grads, scale)
    else:
        inplace = {"inplace": True} if state.config.donate and optimizer.inplace else {}
        params, opt_state = optimizer.update(grads, state.opt_state, trained, grad_scale=scale, **inplace)
        params = {**state.params, **params} if state.model.frozen else params
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    if state.router_bias is not None:  # aux-loss-free balancing, from the loads the sync summed
        loads = torch.stack([metrics.extra[f"moe/load/{u}"] for u, _ in state.model.routed])
        new_state = new_state.replace(
            router_bias=update_bias(state.router_bias, loads, state.config.expert_bias_rate))
    if state.config.donate or stream is not None:
        donate(state)
    return new_state, metrics
