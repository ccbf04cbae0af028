"""Deterministic accumulation (``StepConfig(deterministic=True)``): each rank's local gradient
sums pushed into their owners in rank order, so every accumulator adds in the same order
whatever the timing."""

from __future__ import annotations

import time

import torch

from odcfn.kernels.base import Transport, TransportError
from odcfn.sharding import Layout

__all__ = ["push_in_rank_order"]


def push_in_rank_order(transport: Transport, layout: Layout, local: dict[str, torch.Tensor]) -> None:
    """Push each unit's local gradient sum into its owners, rank 0 first, then rank 1, ...: so
    every owner's accumulator is ``((0 + g_0) + g_1) + ...`` whatever the timing. The turn of
    unit i is a shared counter (``fetch_add``, fresh every step) counted from the top of the
    counter range (work stealing, which uses the bottom, is refused in this mode); all ranks walk
    the units in the same order, so rank r pushes unit i while rank r-1 pushes unit i+1."""
    rank, top = transport.mesh.rank, transport.max_counters - 1
    timeout = float(getattr(transport, "timeout", 60.0))
    for i, u in enumerate(layout.units):
        counter = top - i
        deadline, pause = time.monotonic() + timeout, 1e-5
        while (turn := transport.fetch_add(counter, 0)) != rank:
            if turn > rank:
                raise TransportError(f"rank {rank}: the push order of unit {u.name!r} is at rank {turn} "
                                     "(ranks disagree on StepConfig.deterministic?)")
            if time.monotonic() > deadline:
                raise TransportError(f"rank {rank}: timed out after {timeout}s waiting for rank {turn} to "
                                     f"push unit {u.name!r} (deterministic order; dead or stuck peer?)")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        g = local.get(u.name)
        if g is not None:  # no microbatch on this rank: nothing to add (x + 0 == x anyway)
            transport.scatter_accumulate(u.name, g).wait()
        transport.fetch_add(counter, 1)
