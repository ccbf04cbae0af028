"""Straggler emulation for benchmarks and tests: a model whose units compute ``factor`` x slower.

Each unit's forward sleeps ``(factor - 1)`` x the time it took; its backward does the same: a
marker on the unit's output notes when the unit's backward starts, markers on its inputs (the
activation and every parameter leaf) count the gradients leaving it, and the last one sleeps.
The sleep happens inside the runtime's Forward/Backward steps, so traces show a slow device as
longer compute (busy time), exactly as the simulator models ``slowdown``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from odcfn._check import check_number
from odcfn.model import Model, Unit
from odcfn.tree import tree_leaves, tree_map

__all__ = ["slow_model"]


class _Clock:
    def __init__(self, factor: float, inputs: int) -> None:
        self.factor, self.inputs, self.seen, self.start = factor, inputs, 0, 0.0


class _Mark(torch.autograd.Function):
    """Identity; in backward, the output's mark starts the unit's backward clock and the last
    input's mark sleeps for the unit's slowness."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, clock: _Clock, output: bool) -> torch.Tensor:
        ctx.clock, ctx.output = clock, output
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        c = ctx.clock
        if ctx.output:
            c.start, c.seen = time.perf_counter(), 0
        else:
            c.seen += 1
            if c.seen == c.inputs:
                time.sleep((c.factor - 1.0) * (time.perf_counter() - c.start))
        return g, None, None


def _slow_fwd(unit: Unit, factor: float):  # noqa: ANN202 - a UnitFn
    def fwd(params: Any, x: Any, mb: Any) -> Any:
        t0 = time.perf_counter()
        track = torch.is_grad_enabled()
        if track:
            wants = [p for p in tree_leaves(params) if p.requires_grad]
            has_x = isinstance(x, torch.Tensor) and x.requires_grad
            clock = _Clock(factor, len(wants) + has_x)
            params = tree_map(lambda p: _Mark.apply(p, clock, False) if p.requires_grad else p, params)
            if has_x:
                x = _Mark.apply(x, clock, False)
        y = unit.fwd(params, x, mb)
        if track and isinstance(y, torch.Tensor) and y.requires_grad and clock.inputs:
            y = _Mark.apply(y, clock, True)
        time.sleep((factor - 1.0) * (time.perf_counter() - t0))
        return y

    return fwd


def slow_model(model: Model, factor: float) -> Model:
    """``model`` with every unit ``factor`` x slower in forward and backward (``factor >= 1``)."""
    check_number(factor, "slow_model: factor", at_least=1.0, want="a number >= 1.0")
    if factor == 1.0:
        return model
    return replace(model, units=tuple(replace(u, fwd=_slow_fwd(u, float(factor))) for u in model.units))
