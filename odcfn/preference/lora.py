"""The reference policy of a LoRA run without a second model: the base, adapters off.

Its own module because the LoRA wing imports the models, which import the losses: the preference
data and losses below them must not import it back."""

from __future__ import annotations

from typing import Any

import torch

from odcfn.lora import adapter_units

__all__ = ["lora_reference"]


def lora_reference(state: Any) -> Any:
    """The reference of a LoRA policy: the same state with every adapter shard zero, so each
    adapted projection is its base one (``B·A = 0``) exactly. It shares the base shards (no
    second model in memory); pass it to ``odcfn.log_probs`` for ``ref_logprobs``. Not for
    training (the adapters would stay zero)."""
    adapters = adapter_units(state.model)
    if not adapters:
        raise ValueError("lora_reference: the model has no LoRA adapters")
    params = {k: torch.zeros_like(v) if k in adapters else v for k, v in state.params.items()}
    return state.replace(params=params)
