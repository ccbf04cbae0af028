"""Save and load a whole ``TrainState``: its params, optimizer state and step, as a sharded
checkpoint (``odcfn.save`` / ``odcfn.load``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from odcfn.checkpoint import feedback as _feedback
from odcfn.checkpoint import frozen, sharded
from odcfn.checkpoint.async_save import AsyncSaver, default_saver
from odcfn.step import offload, stale
from odcfn.step.devices import state_device
from odcfn.step.state import TrainState, check_live, check_opt_state
from odcfn.trainable import split
from odcfn.tree import tree_map

ROUTER_BIAS = "router_bias"  # the manifest's extra key of a mixture's aux-loss-free bias


def savable(
    state: TrainState, extra: Mapping[str, Any] | None, base: str | os.PathLike | None = None
) -> tuple[dict, Any, dict]:
    """``(params, model, extra)`` as a checkpoint holds them: everything, or for a state with
    frozen units (LoRA) the trained units only plus a reference to the frozen base."""
    model, params, extra = state.model, state.params, dict(extra or {})
    if state.router_bias is not None:  # a few floats (layers x experts), exact in JSON
        extra[ROUTER_BIAS] = state.router_bias.detach().cpu().double().tolist()
    if model.frozen:  # the base never changes: keep only what does, and where the base came from
        extra[frozen.KEY] = frozen.base_reference(model, base)
        params, model = split(model, params), frozen.trained_model(model)
    return params, model, extra


def save(
    path: str | os.PathLike,
    state: TrainState,
    *,
    extra: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float = 60.0,
    base: str | os.PathLike | None = None,
    blocking: bool = True,
) -> os.PathLike | AsyncSaver:
    """Write ``state``'s params, optimizer state and step as a sharded checkpoint (every rank
    calls it; returns once it is committed). ``extra``: JSON metadata kept in the manifest.
    A committed checkpoint at ``path`` is replaced only with ``overwrite=True``, atomically.
    A state with frozen units (LoRA) writes its trained units only, with a reference to the
    frozen base: ``base`` (the base checkpoint's path) is recorded with the sha256 of its files.
    ``blocking=False``: return once the shards are snapshotted to host memory and write them in
    the background (``checkpoint.async_save``); returns the process's ``AsyncSaver``, whose
    ``wait()`` gives the committed path or raises the write's error (as does the next save).
    With ``StepConfig(push_error_feedback=True)`` each rank's error-feedback residuals are saved
    in its own file (``checkpoint.feedback``; full sharding only)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"odcfn.save(path, state): state must be a TrainState, got {type(state).__name__}")
    check_live(state, "odcfn.save")
    state = stale.consistent(state, "odcfn.save")  # under staleness: the version every owner applied
    if not isinstance(blocking, bool):
        raise TypeError(f"odcfn.save: blocking must be a bool, got {type(blocking).__name__}")
    params, model, extra = savable(state, extra, base)
    fb = _feedback.saved(state)  # refuses hybrid sharding with residuals, before any file
    saver = default_saver(state.mesh)
    if not blocking:
        saver.save(path, params, state.opt_state, state.step, model=model, mesh=state.mesh,
                   extra=extra, overwrite=overwrite, timeout=timeout, feedback=fb)
        return saver
    saver.wait_or_give_up(path, state.step, state.mesh, timeout)  # one in flight completes (or raises) first
    return sharded.write_shards(
        path, params, state.opt_state, state.step, model=model, mesh=state.mesh,
        extra=extra, overwrite=overwrite, timeout=timeout, feedback=fb,
    )


def load(
    path: str | os.PathLike, state: TrainState, *, base: str | os.PathLike | None = None,
    feedback: str = "strict",
) -> TrainState:
    """``state`` with the params, optimizer state and step of checkpoint ``path``, resharded for
    this state's mesh (the checkpoint may come from another world size or sharding). A state
    with frozen units loads its trained units and keeps its frozen ones, after checking the
    base files the checkpoint records (at ``base`` if they moved) still hash the same.
    Error-feedback residuals (``StepConfig.push_error_feedback``) go back into the state's
    transport; ``feedback="strict"`` (the default) refuses a checkpoint whose residuals do not
    match the state (none where the state has error feedback, or the reverse, another push
    format, block, world size or sharding), ``"reset"`` starts them at zero instead
    (``odcfn.checkpoint.feedback``)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"odcfn.load(path, state): state must be a TrainState, got {type(state).__name__}")
    _feedback.check_mode(feedback)
    if feedback == "strict":  # before the state changes: a mismatch leaves it as it was
        why = _feedback.mismatch(sharded.read_manifest(path).get("extra", {}).get(_feedback.KEY), state)
        if why is not None:
            raise ValueError(f"odcfn.load: checkpoint {os.fspath(path)}: {why}; pass feedback='reset' to "
                             "start the residuals at zero instead")
    # where the state computes: the loaded shards (read into host memory) go there, or for an
    # offloaded state its published copies (its masters go back to host memory)
    device = state_device(state, "odcfn.load: the state's params")
    params, opt_state, step = frozen.load_parts(path, state.model, state.mesh, state.params, base)
    if state.config.offload is None:
        params = {k: v.to(device) for k, v in params.items()}
        opt_state = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, opt_state)
    # a checkpoint of another optimizer (SGD's into AdamW's state) would fail only in the update
    check_opt_state(opt_state, state.opt_state, f"odcfn.load: the opt_state of checkpoint {os.fspath(path)}")
    bias = sharded.read_manifest(path).get("extra", {}).get(ROUTER_BIAS)
    if state.router_bias is not None and bias is not None:  # aux-loss-free balancing continues
        t = torch.tensor(bias, dtype=torch.float32, device=state.router_bias.device)
        if t.shape != state.router_bias.shape:
            raise ValueError(f"odcfn.load: checkpoint {os.fspath(path)} holds a router bias of shape "
                             f"{tuple(t.shape)}, this model's is {tuple(state.router_bias.shape)}")
        state = state.replace(router_bias=t)
    # an offloaded state's shards and optimizer state go back to its slow tier (a new store)
    state = offload.adopt(state.replace(params=params, opt_state=opt_state, step=step), device)
    _feedback.restore(path, sharded.read_manifest(path), state, feedback, device)
    return state
