"""LoRA as a pure transformation of a model and its params, PEFT-compatible.

``model, params = odcfn.lora.apply(model, params, rank=16, alpha=32)`` puts the adapters of each
unit with targeted projections in their own unit, ``lora.<unit>``, placed right before it and
read by it (like a tied weight): ``{"self_attn": {"q_proj": {"lora_A": (r, d_in), "lora_B":
(d_out, r)}}}``. The projection then computes PEFT's ``W x + b + scale * B (A x)`` with
``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), A drawn like PEFT's (kaiming-uniform,
``a=sqrt(5)``: U(-1/sqrt(d_in), 1/sqrt(d_in))) and B zero, so the new model starts equal to
the base. The base units are ``Model.frozen``: a ``TrainState`` of the LoRA model trains the
adapters only (gather-only base, no accumulator, no scatter, no optimizer state for it).

The adapter units are sharded like any unit (see docs/lora.md for the measured trade-off
against replicating them). Exports: ``save_peft`` / ``load_peft`` (PEFT's files), ``merge``
(the base params with ``W + scale * B A`` folded in, for ``odcfn.models.to_hf``),
``gather_adapters`` / ``gather_merged`` (RL weight sync).
"""

from odcfn.lora.core import (
    LoraSpec,
    adapter_units,
    apply,
    apply_to_shards,
    base_model,
    dropout_mask,
    merge,
    spec,
)
from odcfn.lora.peft_io import load_peft, load_peft_tensors, peft_state_dict, save_peft, write_peft
from odcfn.lora.sync import gather_adapters, gather_merged

__all__ = [
    "LoraSpec",
    "adapter_units",
    "apply",
    "apply_to_shards",
    "base_model",
    "dropout_mask",
    "gather_adapters",
    "gather_merged",
    "load_peft",
    "load_peft_tensors",
    "merge",
    "peft_state_dict",
    "save_peft",
    "spec",
    "write_peft",
]
