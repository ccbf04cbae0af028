"""RL weight sync of a LoRA state: the adapters only, or the merged weights, on every rank or one
(``odcfn.gather_params(state, dst, adapters_only=True / merged=True)``)."""

from __future__ import annotations

from odcfn.step.logprobs import gather_params
from odcfn.step.state import TrainState

__all__ = ["gather_adapters", "gather_merged"]


def gather_adapters(state: TrainState, dst: int | None = None) -> dict | None:
    """``{adapter unit: {projection path: {lora_A, lora_B}}}`` on every rank or only ``dst``."""
    return gather_params(state, dst, adapters_only=True)


def gather_merged(state: TrainState, dst: int | None = None) -> dict | None:
    """The base model's params with ``W + scale * B A`` folded in (``odcfn.lora.merge``)."""
    return gather_params(state, dst, merged=True)
