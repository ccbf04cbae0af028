"""Primitive bandwidths: shm gather / scatter-accumulate vs gloo all-gather / reduce-scatter vs a
plain local copy / add (the physical limit of moving those bytes through this machine's memory).

All W ranks run the same primitive at the same time, as in training. Bandwidth = bytes of the
full (unsharded) unit / time per call, for every primitive alike: a gather and an all-gather of a
16 MiB unit both deliver 16 MiB to each rank; a local copy of 16 MiB is the floor for that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["PrimSpec", "primitives_worker", "summarize"]

MiB = 1 << 20


@dataclass(frozen=True)
class PrimSpec:
    sizes_mib: tuple[int, ...] = (1, 4, 16, 64)
    min_time_s: float = 0.2  # per (primitive, size): repeat until this much time has passed
    max_reps: int = 50
    timeout: float = 120.0


def _unit_model(sizes_mib):
    """A Model with one fp32 vector unit per size: its layout is what the transport moves."""
    from odcfn.model import Model, Unit

    def fwd(p, x, mb):  # never called: only the layout matters here
        raise NotImplementedError

    return Model(tuple(
        Unit(f"u{s}", fwd, {"w": torch.Size([s * MiB // 4])}) for s in sizes_mib
    ))


def _timeit(fn, barrier, spec: PrimSpec) -> float:
    """Seconds per call: a warm-up call, then as many calls as fit in ``min_time_s``; ranks agree
    on the repetition count so collectives stay matched."""
    import torch.distributed as dist

    fn()
    barrier()
    t0 = time.perf_counter()
    fn()
    one = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    reps = int(max(1, min(spec.max_reps, spec.min_time_s / max(float(one), 1e-6))))
    barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def primitives_worker(spec: PrimSpec) -> dict[str, dict[int, float]]:
    """One launched rank: seconds per call of each primitive at each size."""
    import torch.distributed as dist

    from odcfn.sharding import Mesh, make_layout
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = Mesh.from_env()
    model = _unit_model(spec.sizes_mib)
    layout = make_layout(model, mesh)
    out: dict[str, dict[int, float]] = {k: {} for k in (
        "memcpy", "local_add", "shm_gather", "shm_scatter_accumulate", "gloo_all_gather",
        "gloo_reduce_scatter")}
    with ShmTransport(mesh, timeout=spec.timeout) as tr:
        shards = {u.name: torch.randn(u.shard_size) for u in layout.units}
        tr.begin_step(layout, shards, torch.float32)
        for s in spec.sizes_mib:
            u = layout[f"u{s}"]
            full = torch.empty(u.padded_numel)
            src = torch.randn(u.padded_numel)
            grad = torch.randn(u.padded_numel) * 1e-3
            acc = torch.zeros(u.padded_numel)
            ops = {
                "memcpy": lambda full=full, src=src: full.copy_(src),
                "local_add": lambda acc=acc, grad=grad: acc.add_(grad),
                "shm_gather": lambda n=u.name, full=full: tr.gather(n, full).wait(),
                "shm_scatter_accumulate": lambda n=u.name, g=grad: tr.scatter_accumulate(n, g).wait(),
                "gloo_all_gather": lambda n=u.name, full=full: tr.all_gather(n, full),
                "gloo_reduce_scatter": lambda n=u.name, g=grad: tr.reduce_scatter(n, g),
            }
            for name, fn in ops.items():
                with torch.no_grad():
                    out[name][s] = _timeit(fn, dist.barrier, spec)
        tr.flush()  # every push has landed before anyone tears the segments down
        dist.barrier()
    return out


def summarize(per_rank: list[dict[str, dict[int, float]]], sizes_mib) -> dict:
    """GB/s per primitive and size (slowest rank's time: all ranks ran concurrently)."""
    gbps = {}
    for name in per_rank[0]:
        gbps[name] = [s * MiB / max(r[name][s] for r in per_rank) / 1e9 for s in sizes_mib]
    return {"sizes_mib": list(sizes_mib), "gbps": gbps,
            "definition": "bytes of the full unsharded unit / seconds per call, slowest rank"}
