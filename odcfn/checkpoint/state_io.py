"""Save and load a whole ``TrainState``: its params, optimizer state and step, as a sharded
checkpoint (``odcfn.save`` / ``odcfn.load``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from odcfn.checkpoint import sharded
from odcfn.step.state import TrainState, check_opt_state


def save(
    path: str | os.PathLike,
    state: TrainState,
    *,
    extra: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    timeout: float = 60.0,
) -> os.PathLike:
    """Write ``state``'s params, optimizer state and step as a sharded checkpoint (every rank
    calls it; returns once it is committed). ``extra``: JSON metadata kept in the manifest.
    A committed checkpoint at ``path`` is replaced only with ``overwrite=True``, atomically."""
    if not isinstance(state, TrainState):
        raise TypeError(f"odcfn.save(path, state): state must be a TrainState, got {type(state).__name__}")
    return sharded.write_shards(
        path, state.params, state.opt_state, state.step, model=state.model, mesh=state.mesh,
        extra=extra, overwrite=overwrite, timeout=timeout,
    )


def load(path: str | os.PathLike, state: TrainState) -> TrainState:
    """``state`` with the params, optimizer state and step of checkpoint ``path``, resharded for
    this state's mesh (the checkpoint may come from another world size or sharding)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"odcfn.load(path, state): state must be a TrainState, got {type(state).__name__}")
    params, opt_state, step = sharded.read_shards(path, model=state.model, mesh=state.mesh)
    # a checkpoint of another optimizer (SGD's into AdamW's state) would fail only in the update
    check_opt_state(opt_state, state.opt_state, f"odcfn.load: the opt_state of checkpoint {os.fspath(path)}")
    return state.replace(params=params, opt_state=opt_state, step=step)
