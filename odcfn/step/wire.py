"""The step's low-precision communication settings (``StepConfig.gather_format`` / ``push_format``
/ ``push_error_feedback`` / ``quant_block`` / ``quantize_frozen``): checked at construction, handed
to the transport with ``begin_step``. The math is ``odcfn.kernels.quant``; the transports call it
in their publish, gather and push paths; a frozen base held in its format: ``frozen_quant``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from odcfn._check import check_int
from odcfn.kernels.quant import GATHER_FORMATS, PUSH_FORMATS, Format, Wire, check_format
from odcfn.sharding import Layout
from odcfn.step.frozen_quant import check_config as check_frozen_config
from odcfn.step.frozen_quant import for_pass

__all__ = ["begin_step", "check_transport", "check_wire_config", "step_wire"]


def check_wire_config(cfg: Any) -> None:
    """Every refusal a config's wire settings get, at ``StepConfig`` construction (so before any
    communication, and alike on every rank given the same config)."""
    check_format(cfg.gather_format, "StepConfig.gather_format", GATHER_FORMATS)
    check_format(cfg.push_format, "StepConfig.push_format", PUSH_FORMATS)
    check_int(cfg.quant_block, "StepConfig.quant_block", at_least=1)
    check_frozen_config(cfg)  # quantize_frozen: a bool, and a gather_format to keep the base in
    if not isinstance(cfg.push_error_feedback, bool):
        got = type(cfg.push_error_feedback).__name__
        raise TypeError(f"StepConfig.push_error_feedback must be a bool, got {got}")
    if cfg.push_error_feedback and cfg.push_format is None:
        raise ValueError(
            "StepConfig.push_error_feedback=True needs a push_format ('bf16' or 'int8'): "
            "there is no rounding error to carry"
        )
    if cfg.comm == "collective" and cfg.push_format not in (None, "fp32"):
        raise ValueError(
            f"StepConfig.push_format={cfg.push_format!r} needs comm='odc': a reduce-scatter sums the "
            "pieces on the wire, so they cannot stay block-quantized into an fp32 accumulator "
            "(use push_format='fp32' or None with comm='collective')"
        )
    if (cfg.gather_format or cfg.push_format) and _stale(cfg.staleness):
        key = "gather_format" if cfg.gather_format else "push_format"
        raise ValueError(
            f"StepConfig.{key} cannot be combined with staleness >= 1 yet: the version "
            "rings publish and accumulate in the compute dtype (use staleness=0)"
        )


def _stale(staleness: Any) -> bool:
    if isinstance(staleness, Mapping):
        return any(v for v in staleness.values())
    return bool(staleness)


def step_wire(cfg: Any, *, pushes: bool = True) -> Wire:
    """The ``Wire`` a pass of ``cfg`` uses; ``pushes=False`` for forward-only passes."""
    return Wire(
        cfg.gather_format,
        cfg.push_format if pushes else None,
        cfg.push_error_feedback and pushes,
        cfg.quant_block,
    )


def check_transport(transport: Any, wire: Wire) -> None:
    """A transport that does not move quantized bytes is refused naming the key (call it before
    any communication)."""
    if wire.active and not getattr(transport, "supports_wire", False):
        key, val = ("gather_format", wire.gather) if wire.gather else ("push_format", wire.push)
        raise ValueError(
            f"StepConfig.{key}={val!r}: {type(transport).__name__} does not move block-quantized "
            "shards (LocalWorld's, ShmTransport and CollectiveTransport do; the GPU transports not "
            f"yet): use {key}=None"
        )


def begin_step(
    transport: Any, layout: Layout, shards: Mapping[str, torch.Tensor], dtype: torch.dtype, wire: Wire,
    frozen: Format | None = None,
) -> None:
    """``transport.begin_step`` with ``wire`` (``check_transport`` first). A transport without
    wire formats gets the old call, so every transport keeps its signature. ``frozen``: the
    format frozen shards are held in (``frozen_quant.frozen_format``); a pass publishing in
    another format gets them decoded into ``dtype`` first."""
    check_transport(transport, wire)
    shards = for_pass(shards, layout, frozen, wire.gather_format, dtype)
    if getattr(transport, "supports_wire", False):
        transport.begin_step(layout, shards, dtype, wire=wire)  # a default wire resets a former one
    else:
        transport.begin_step(layout, shards, dtype)
