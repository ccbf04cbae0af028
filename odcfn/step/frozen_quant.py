"""A frozen base kept resident only in its gather format (ZeRO++'s MixZ++, QLoRA-style training):
``StepConfig(quantize_frozen=True)`` with a ``gather_format``.

A frozen unit (``Model.frozen``: a LoRA base) never changes and is only ever gathered, and a
gather of it delivers its shard's round trip through ``gather_format``. So its owner encodes
the shard once, when the state is created (``keep``), and holds only those bytes
(``kernels.quant.resident``: the payload and the fp32 block scales, viewed as the format's
element type, so the dtype names the format). Every pass that publishes in that format copies
the bytes as they are (``kernels.quant.publish``); a pass that publishes in another one
(``gather_params``: the params unquantized) gets the unit decoded into its dtype first
(``for_pass``). The compute sees exactly the values it saw with the full-precision base and the
same ``gather_format``, so training and log-probs are unchanged bit for bit; what changes is what
``gather_params`` (and ``odcfn.lora.gather_merged``) return for the base: its dequantized values.

Trained units are untouched: fp32 masters, encoded at each publish as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from odcfn.kernels.quant import Format, decode, get_format, resident
from odcfn.sharding import Layout
from odcfn.tree import tree_leaves

__all__ = ["StateBytes", "check_config", "for_pass", "frozen_format", "is_resident", "keep", "state_bytes"]

KEY = "StepConfig.quantize_frozen"


def check_config(cfg: Any) -> None:
    """The key's refusals, at ``StepConfig`` construction (before any communication)."""
    if not isinstance(cfg.quantize_frozen, bool):
        raise TypeError(f"{KEY} must be a bool, got {type(cfg.quantize_frozen).__name__}")
    if cfg.quantize_frozen and cfg.gather_format is None:
        raise ValueError(
            f"{KEY}=True needs a gather_format ('int8', 'fp8_e4m3' or 'bf16'): the frozen units are "
            "kept in the format their gathers move, and there is none"
        )


def frozen_format(cfg: Any) -> Format | None:
    """The format ``cfg`` keeps frozen units in (None: as they were given)."""
    if not getattr(cfg, "quantize_frozen", False):
        return None
    return get_format(cfg.gather_format, cfg.quant_block)


def resident_numel(fmt: Format, n: int) -> int:
    """Elements of a resident shard of ``n`` values: ``fmt.nbytes(n)`` bytes as its element type."""
    return fmt.nbytes(n) // fmt.itemsize


def is_resident(t: torch.Tensor, fmt: Format | None, n: int) -> bool:
    """``t`` is a shard of ``n`` values held in ``fmt`` (``kernels.quant.resident``'s form)."""
    return fmt is not None and t.dtype == fmt.element_dtype and t.shape == (resident_numel(fmt, n),)


def keep(params: Mapping[str, torch.Tensor], layout: Layout, fmt: Format | None) -> dict[str, torch.Tensor]:
    """``params`` with every frozen shard encoded once into ``fmt`` (those already held in it
    stay as they are); trained shards untouched. The caller drops the old tensors: the
    full-precision copy of the base is then gone."""
    out = dict(params)
    if fmt is None:
        return out
    for u in layout.units:
        t = out[u.name]
        if u.frozen and not is_resident(t, fmt, u.shard_size):
            out[u.name] = resident(t.detach(), fmt)
    return out


def for_pass(
    shards: Mapping[str, torch.Tensor], layout: Layout, fmt: Format | None, pass_fmt: Format | None,
    dtype: torch.dtype,
) -> Mapping[str, torch.Tensor]:
    """The shards a pass publishing in ``pass_fmt`` hands its transport: the resident ones
    decoded into ``dtype`` (fresh tensors, this pass only) when ``pass_fmt`` is another format
    than the one they are held in; as they are otherwise."""
    if fmt is None or pass_fmt == fmt:
        return shards
    out = dict(shards)
    for u in layout.units:
        t = out[u.name]
        if u.frozen and is_resident(t, fmt, u.shard_size):
            buf = torch.empty(u.shard_size, dtype=dtype, device=t.device)
            out[u.name] = decode(t.view(torch.uint8), fmt, buf)
    return out


@dataclass(frozen=True)
class StateBytes:
    """Bytes of the tensors a ``TrainState`` holds, by kind (``state_bytes``)."""

    frozen: int  # the frozen units' shards (a LoRA base): resident form under quantize_frozen
    trained: int  # the trained units' master shards
    optimizer: int  # the optimizer state's tensors

    @property
    def total(self) -> int:
        return self.frozen + self.trained + self.optimizer


def state_bytes(state: Any) -> StateBytes:
    """What ``state`` holds, in bytes: its frozen shards, trained shards and optimizer tensors
    (the transport's published copies and accumulators are the transport's, not counted). With
    ``StepConfig.offload`` the trained shards and the optimizer state are views of the slow tier:
    counted here, resident only as the page cache keeps them."""
    frozen = set(state.model.frozen)
    size = {k: v.numel() * v.element_size() for k, v in state.params.items()}
    leaves = [x for x in tree_leaves(state.opt_state) if isinstance(x, torch.Tensor)]
    opt = sum(x.numel() * x.element_size() for x in leaves)
    return StateBytes(
        frozen=sum(b for k, b in size.items() if k in frozen),
        trained=sum(b for k, b in size.items() if k not in frozen),
        optimizer=opt,
    )
