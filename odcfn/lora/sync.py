"""RL weight sync of a LoRA state: the adapters only, or the merged weights, on every rank or one.

LoRA composes the step's ``gather_params`` (the step wing does not know LoRA): the adapters are
just the adapter units, the merged weights the full params with ``merge`` applied.
"""

from __future__ import annotations

import torch

from odcfn.lora.core import adapter_units, merge
from odcfn.model import Model
from odcfn.step.logprobs import gather_params
from odcfn.step.state import TrainState

__all__ = ["gather_adapters", "gather_merged"]


def _adapters(state: TrainState) -> dict:
    model = getattr(state, "model", None)
    ads = adapter_units(model) if isinstance(model, Model) else {}
    if not ads:
        raise ValueError("gather_adapters/gather_merged need a LoRA model's state (odcfn.lora.apply)")
    return ads


def gather_adapters(
    state: TrainState, dst: int | None = None, *, dtype: torch.dtype | None = None
) -> dict | None:
    """``{adapter unit: {projection path: {lora_A, lora_B}}}`` on every rank or only ``dst``; only
    the adapter units travel (r * (d_in + d_out) per projection). ``dtype`` as ``gather_params``:
    by default the dtype ``train_step`` publishes."""
    return gather_params(state, dst, units=tuple(_adapters(state)), dtype=dtype)


def gather_merged(
    state: TrainState, dst: int | None = None, *, dtype: torch.dtype | None = None
) -> dict | None:
    """The base model's params with ``W + scale * B A`` folded in (``odcfn.lora.merge``, in fp64),
    on every rank or only ``dst``."""
    _adapters(state)
    full = gather_params(state, dst, dtype=dtype)
    return None if full is None else merge(state.model, full)
