"""What one simulated cell is: the 7B workload on a dataset at a device count (its cost model,
microbatch cap, mesh of 8-device nodes) and the per-minibatch noise (a straggler). Shared by the
policy sweep (``sweep``) and the staleness sweep (``stalesweep``)."""

from __future__ import annotations

import random

from odcfn.schedule.cost import QWEN25_7B, QuadraticCost, flops_cost
from odcfn.schedule.lengths import Dataset, get_dataset
from odcfn.schedule.simulate import Workload
from odcfn.sharding import Mesh

__all__ = ["MFU", "cell_setup", "default_cost", "slowdowns"]

A100_BF16_FLOPS = 312e12
MFU = 0.45
RANKS_PER_NODE = 8
MODEL_PARAMS = 7.6e9  # Qwen2.5-7B


def default_cost() -> QuadraticCost:
    """Seconds per sample: the 7B model's training FLOPs at ``MFU`` of an A100's bf16 peak."""
    return flops_cost(QWEN25_7B).scaled(1.0 / (A100_BF16_FLOPS * MFU))


def cell_setup(
    dataset: str, devices: int, units: int, cost: QuadraticCost | None, max_tokens: int | None,
    gather_bytes: float = 2.0, push_bytes: float = 2.0,
) -> tuple[Dataset, QuadraticCost, int, Mesh, Workload]:
    """A cell's dataset, cost model, microbatch cap, mesh (nodes of 8) and the 7B workload;
    ``gather_bytes`` / ``push_bytes``: bytes per parameter a gather / a push moves (2: bf16;
    ``odcfn.schedule.simmodel.element_bytes`` of a wire format, scales included)."""
    ds = get_dataset(dataset)
    mesh = Mesh(devices, 0, RANKS_PER_NODE if devices % RANKS_PER_NODE == 0 else None)
    # by default bf16 parameters gathered, bf16 gradients pushed (owners accumulate in fp32)
    work = Workload.uniform(units, model_bytes=gather_bytes * MODEL_PARAMS,
                            grad_bytes=push_bytes * MODEL_PARAMS / units)
    return ds, cost or default_cost(), max_tokens or ds.max_tokens, mesh, work


def slowdowns(
    devices: int, k: int, seed: int, straggler: float, slow_fraction: float = 1.0,
    slow_rank: int | None = None,
) -> list[float]:
    """Minibatch ``k``'s per-device slowdowns: one device at ``straggler`` on a random
    ``slow_fraction`` of the minibatches (the real benchmarks' noise), the others at 1. The device
    is ``slow_rank`` if given, else a random one each minibatch: balancers sort ranks by load, so
    a fixed index would always meet the same (heaviest or lightest) share."""
    if slow_rank is not None and not (isinstance(slow_rank, int) and 0 <= slow_rank < devices):
        raise ValueError(f"slow_rank must be a device index in [0, {devices}), got {slow_rank!r}")
    if not 0.0 <= slow_fraction <= 1.0:
        raise ValueError(f"slow_fraction must be in [0, 1], got {slow_fraction!r}")
    slow = [1.0] * devices
    # separate streams: the device drawn for minibatch k does not depend on the fraction
    rank = random.Random(f"straggler/{seed}/{k}").randrange(devices) if slow_rank is None else slow_rank
    if random.Random(f"slow-fraction/{seed}/{k}").random() < slow_fraction:
        slow[rank] = straggler
    return slow
