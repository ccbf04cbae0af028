"""Measuring this machine: per-unit forward/backward times of a real model, and a cost model
fitted to them. (The schedule package stays pure: it only consumes cost models.)"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from odcfn.model import unit_inputs
from odcfn.schedule.cost import QuadraticCost, fit_quadratic

__all__ = ["calibrate", "measure_unit_times"]

_MB_TENSORS = ("input_ids_T", "labels_T", "loss_mask_T", "positions_T")


def measure_unit_times(
    model: Any,
    params: Any,
    lengths: Sequence[int],
    *,
    vocab_size: int,
    repeats: int = 3,
    seed: int = 0,
) -> dict[int, dict[str, tuple[float, float]]]:
    """Time forward and backward of every unit of ``model`` on one sample of each length.

    Returns ``{length: {unit: (forward_s, backward_s)}}``, the minimum over ``repeats`` runs
    (the least disturbed one, on a machine shared with other jobs). Runs where ``params`` live;
    on a GPU it synchronises before every clock read (not yet run on GPU hardware).
    """
    import torch

    from odcfn.batch import pack, random_batch
    from odcfn.tree import tree_leaves, tree_map

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = next(iter(tree_leaves(params))).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out: dict[int, dict[str, tuple[float, float]]] = {}
    for n in lengths:
        mb = pack(random_batch([n], vocab_size, seed=seed), [0])
        if device.type != "cpu":
            mb = replace(mb, **{f: getattr(mb, f).to(device) for f in _MB_TENSORS})
        best: dict[str, tuple[float, float]] = {}
        for _ in range(repeats):
            x = None
            for unit in model.units:
                own = unit_inputs(unit, params[unit.name], params)  # tied: with what it uses
                p = tree_map(lambda t: t.detach().requires_grad_(), own)
                xin = (
                    x.detach().requires_grad_()
                    if isinstance(x, torch.Tensor) and x.is_floating_point()
                    else x
                )
                sync()
                t0 = time.perf_counter()
                y = unit.fwd(p, xin, mb)
                sync()
                t1 = time.perf_counter()
                inputs = list(tree_leaves(p))
                if isinstance(xin, torch.Tensor) and xin.requires_grad:
                    inputs.append(xin)
                torch.autograd.grad(y, inputs, torch.ones_like(y))
                sync()
                t2 = time.perf_counter()
                f, b = best.get(unit.name, (math.inf, math.inf))
                best[unit.name] = (min(f, t1 - t0), min(b, t2 - t1))
                x = y.detach()
        out[int(n)] = best
    return out


def calibrate(
    model: Any,
    params: Any,
    lengths: Sequence[int] = (64, 128, 256, 512, 1024),
    *,
    vocab_size: int,
    repeats: int = 3,
) -> tuple[QuadraticCost, float]:
    """Fit ``a, b`` (seconds) to the real model's measured forward+backward time on this
    machine; also return the forward share of that time (the simulator's ``fwd_fraction``)."""
    times = measure_unit_times(model, params, lengths, vocab_size=vocab_size, repeats=repeats)
    totals = [sum(f + b for f, b in times[n].values()) for n in lengths]
    fwd = sum(f for n in lengths for f, _ in times[n].values())
    return fit_quadratic(lengths, totals), fwd / sum(totals)
