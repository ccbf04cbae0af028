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
from dataclasses import replace
from typing import Any

import torch

from odcfn import preference, trainable
from odcfn.batch import Batch, check_token_range
from odcfn.kernels.base import supports_odc
from odcfn.losses import check_loss, loss_metrics
from odcfn.model import Model
from odcfn.optim import clip_scale
from odcfn.schedule.plan import ScheduleOptions
from odcfn.schedule.policy import policy_info, prepare_program
from odcfn.sharding import Layout, make_layout
from odcfn.sharding.layout import check_shards
from odcfn.step import fingerprint, stale
from odcfn.step.execute import execute
from odcfn.step.state import StepConfig, StepMetrics, TrainState, check_fields, donate

__all__ = ["StepMetrics", "check_inputs", "grad_step", "train_step"]


def check_inputs(state: TrainState, batch: Batch) -> Layout:
    """Every check a pass over ``batch`` needs (train, grad and log-prob passes alike), before any
    communication and identically on every rank; returns the layout."""
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an odcfn.TrainState (TrainState.create), got {type(state).__name__}")
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be an odcfn.Batch, got {type(batch).__name__}")
    check_fields(state)
    if state.config.comm == "odc" and not supports_odc(state.transport):
        raise TypeError(
            f"comm='odc' needs a point-to-point transport (ShmTransport, LocalWorld's, the GPU ones); "
            f"{type(state.transport).__name__} only does collectives: use StepConfig(comm='collective')"
        )
    layout = make_layout(state.model, state.mesh)
    check_shards(state.params, layout, state.model.dtype, frozen_dtype=state.config.compute_dtype)
    check_token_range(batch, state.model.vocab_size)
    return layout


def schedule_options(options: ScheduleOptions | None, model: Model, remat: bool = False) -> ScheduleOptions:
    """The schedule options with the model's tied-weight uses, which the plan must gather, and
    every unit rematerialised when ``remat`` (``StepConfig.remat``)."""
    options = options or ScheduleOptions()
    if remat:
        options = replace(options, remat=frozenset(model.unit_names))
    if options.uses and options.uses != model.uses:
        raise ValueError(f"ScheduleOptions.uses={options.uses} differs from the model's {model.uses}")
    if options.frozen and options.frozen != frozenset(model.frozen):
        raise ValueError(
            f"ScheduleOptions.frozen={sorted(options.frozen)} differs from the model's {model.frozen}"
        )
    options = replace(options, uses=model.uses) if model.uses else options
    if options.routed and options.routed != model.routed:
        raise ValueError("ScheduleOptions.routed differs from the model's experts (Model.routed)")
    options = replace(options, routed=model.routed) if model.routed else options
    passthrough = frozenset(u.name for u in model.units if getattr(u.fwd, "passthrough", False))
    if options.passthrough and options.passthrough != passthrough:
        raise ValueError(
            f"ScheduleOptions.passthrough={sorted(options.passthrough)} differs from the model's"
        )
    if passthrough:
        options = replace(options, passthrough=passthrough)
    return replace(options, frozen=frozenset(model.frozen)) if model.frozen else options


def _recording(balance: Any, seen: list) -> Any:
    """A user's balancer callable that keeps what it returned: unlike the built-in ones it may
    differ by rank (unseeded randomness, rank-aware code), so its assignment joins the
    fingerprint."""
    if policy_info(balance) is not None:
        return balance

    def recorded(lengths, world_size, max_tokens):
        seen.append(balance(lengths, world_size, max_tokens))
        return seen[-1]

    return recorded


def _fingerprint(
    state: TrainState, batch: Batch, layout: Layout, assignment: list | None = None
) -> tuple[list[int], list[str]]:
    """This rank's minibatch fingerprint words and what each describes (for the error)."""
    m, mesh = state.model, state.mesh
    key = (f"{[(u.name, u.shard_size) for u in layout.units]} W={mesh.world_size} "
           f"{mesh.sharding}/{mesh.node_size} {m.dtype} {m.config_key}")
    if m.frozen:  # ranks that disagree on what is trained would push into missing accumulators
        key += f" frozen={list(m.frozen)}"
    if batch.step is not None:  # ranks at different steps would draw different dropout masks
        key += f" step={batch.step}"
    if batch.pairs:  # ranks that disagree on pairing would pack different microbatches
        key += " pairs"
    config = state.config
    if assignment is not None:
        config = (config, [[list(map(int, mb)) for mb in r] for r in assignment])
    words = fingerprint.minibatch_words(batch, config, key)
    lengths = repr(batch.lengths) if len(batch) <= 16 else f"{batch.lengths[:16]}... ({len(batch)} samples)"
    detail = [f"lengths {lengths}, {batch.num_loss_tokens} loss tokens", f"token hash {words[1]:05x}",
              fingerprint.stable_repr(config)[:300], key[:300]]
    return words, detail


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
        _recording(cfg.balance, seen), lengths, units=model.unit_names, world_size=mesh.world_size,
        rank=mesh.rank,
        max_tokens=cap, comm=cfg.comm, options=schedule_options(cfg.options, model, cfg.remat), cost=cfg.cost,
        fetch_add=getattr(transport, "fetch_add", None),
        max_counters=getattr(transport, "max_counters", None),
    )
    program = preference.expand_program(program, batch)
    dtype = cfg.compute_dtype or model.dtype
    device = next(iter(state.params.values())).device  # compute follows the parameter shards
    words, detail = _fingerprint(state, batch, layout, seen[-1] if seen else None)
    before = transport.counters.copy()
    transport.begin_step(layout, state.params, dtype)
    result, plan = execute(
        program, model=model, layout=layout, batch=batch, transport=transport,
        compute_dtype=dtype, comm=cfg.comm, device=device, riders=fingerprint.encode(words, device),
        loss=cfg.loss, deterministic=cfg.deterministic,
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
    return transport.grad_shards(), metrics, layout


def expert_load_metrics(model: Model, loads: torch.Tensor) -> dict[str, Any]:
    """Each sparse layer's tokens per expert over the minibatch (``moe/load/<unit>``, E values)
    and their max over mean (``moe/load_max_over_mean/<unit>``; 1.0 is perfect balance)."""
    out: dict[str, Any] = {}
    for (unit, _), load in zip(model.routed, loads):
        out[f"moe/load/{unit}"] = load.clone()
        mean = float(load.mean())
        out[f"moe/load_max_over_mean/{unit}"] = float(load.max()) / mean if mean else 0.0
    return out


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
    grads, metrics, _ = _grads(state, batch)
    return {k: g.clone() for k, g in trainable.split(state.model, grads).items()}, metrics


def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
    """One optimizer step on one minibatch: ``(new state, metrics)``."""
    if isinstance(state, TrainState) and isinstance(state.config, StepConfig) and stale.active(state.config):
        return stale.train_step(state, batch)  # τ >= 1: per-owner versions, no global sync
    grads, metrics, layout = _grads(state, batch)
    if metrics.extra.get("skipped_nonfinite"):  # nonfinite="skip": nothing changes
        return state, metrics
    scale = clip_scale(metrics.grad_norm, state.config.max_grad_norm)
    optimizer = state.optimizer.for_layout(layout)  # a decay mask needs it
    trained = trainable.split(state.model, state.params)  # frozen units: no state, never updated
    grads = trainable.split(state.model, grads)
    inplace = {"inplace": True} if state.config.donate and optimizer.inplace else {}
    params, opt_state = optimizer.update(grads, state.opt_state, trained, grad_scale=scale, **inplace)
    params = {**state.params, **params} if state.model.frozen else params
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    if state.config.donate:
        donate(state)
    return new_state, metrics
