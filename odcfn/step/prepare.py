"""What every pass over a minibatch does before any communication (``train_step``, ``grad_step``,
``log_probs`` and the bounded-staleness step alike): the input checks, the schedule options the
model implies, the minibatch fingerprint."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import torch

from odcfn.batch import Batch, check_token_range
from odcfn.model import Model
from odcfn.moe.router import check_routing
from odcfn.schedule.plan import ScheduleOptions
from odcfn.schedule.policy import policy_info
from odcfn.sharding import Layout, make_layout
from odcfn.sharding.layout import check_shards
from odcfn.step import fingerprint
from odcfn.step.devices import state_device
from odcfn.step.frozen_quant import frozen_format
from odcfn.step.stale_config import max_staleness
from odcfn.step.state import TrainState, check_fields
from odcfn.transport.base import supports_odc

__all__ = ["check_inputs", "minibatch_fingerprint", "recording", "schedule_options"]


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
    opts = state.config.options
    if opts is not None and opts.hpz:  # hierarchical shards: groups inside the shard group
        opts.check_hpz(state.mesh.shard_count, state.config.comm)
        if max_staleness(state.config.staleness):  # peers' slices could hold different versions
            raise ValueError(
                f"ScheduleOptions.reshard_after_forward={opts.hpz} (hierarchical shards) needs "
                "StepConfig(staleness=0)"
            )
        if not callable(getattr(state.transport, "gather_group", None)):
            raise TypeError(
                f"ScheduleOptions.reshard_after_forward={opts.hpz} needs a transport with group "
                f"gathers (LocalWorld's, ShmTransport, the GPU ones); "
                f"{type(state.transport).__name__} has none"
            )
    layout = make_layout(state.model, state.mesh)
    check_shards(state.params, layout, state.model.dtype, frozen_dtype=state.config.compute_dtype,
                 one_device=False, frozen_format=frozen_format(state.config))
    state_device(state)  # one device, but for offloaded masters in host memory (LoRA + offload on a GPU)
    check_token_range(batch, state.model.vocab_size)
    check_routing(batch, state.model.router)  # routing replay's expert indices
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


def recording(balance: Any, seen: list) -> Any:
    """A user's balancer callable that keeps what it returned: unlike the built-in ones it may
    differ by rank (unseeded randomness, rank-aware code), so its assignment joins the
    fingerprint."""
    if policy_info(balance) is not None:
        return balance

    def recorded(lengths, world_size, max_tokens):
        seen.append(balance(lengths, world_size, max_tokens))
        return seen[-1]

    return recorded


def minibatch_fingerprint(
    state: TrainState, batch: Batch, layout: Layout, assignment: list | None = None, extra: Any = None
) -> tuple[list[int], list[str]]:
    """This rank's minibatch fingerprint words and what each describes (for the error);
    ``extra``: the pass's own options (a log-prob pass's head), which must agree too."""
    key = fingerprint.layout_key(state, layout, batch.step)
    if batch.pairs:  # ranks that disagree on pairing would pack different microbatches
        key += " pairs"
    if state.router_bias is not None:  # ranks whose biases differ would route differently
        raw = state.router_bias.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
        key += f" router_bias={hashlib.sha256(raw).hexdigest()[:16]}"
    config = state.config
    if assignment is not None:
        config = (config, [[list(map(int, mb)) for mb in r] for r in assignment])
    if extra is not None:
        config = (config, extra)
    words = fingerprint.minibatch_words(batch, config, key)
    lengths = repr(batch.lengths) if len(batch) <= 16 else f"{batch.lengths[:16]}... ({len(batch)} samples)"
    detail = [f"lengths {lengths}, {batch.num_loss_tokens} loss tokens", f"token hash {words[1]:05x}",
              fingerprint.stable_repr(config)[:300], key[:300]]
    first = batch.samples[0].extras if batch.samples else {}
    kinds = [f"{k}: {v.dtype} x {tuple(v.shape[1:])}" for k, v in sorted(first.items())]
    detail.append(f"extras {kinds}"[:300])
    detail += [", ".join(f"extras[{k!r}]" for k in names) + f", hash {w:05x}" if names else "no extra"
               for names, w in zip(fingerprint.extra_slots(batch), words[5:])]
    return words, detail
