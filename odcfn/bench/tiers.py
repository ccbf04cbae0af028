"""``odcfn bench --only tiers``: memory tiers and low-precision communication, side by side.

- ``bytes``: what one step moves per rank (the transport's counters, exact), with fp8 / int8
  gathers against bf16 ones and int8 / bf16 pushes against bf16 ones, scales included; the
  same numbers from the formats' own sizes (``expected``), so a counter that drifted shows;
- ``step_time_shm``: step time of bf16, fp8 and int8 gathers over /dev/shm processes, interleaved
  step by step; reported as measured (this 2-core machine's gathers are memory copies that
  the quantize / dequantize passes cost more than they save: no speedup is claimed here);
- ``simulator``: ODC's simulated step time (the 7B cell of ``odcfn.schedule.simcells``: A100s,
  NVLink in a node, 25 GB/s InfiniBand per GPU between nodes, LongAlign lengths) with bf16 and
  with fp8 gathers, 8 to 1024 devices, through the cost model's bytes per element;
- ``training``: held-out loss after 200 steps of a small task, fp8 gathers + bf16 pushes and
  int8 pushes + error feedback against bf16 (``odcfn.bench.tiers_train``);
- ``offload``: the rows of ``odcfn/bench/tiers_offload.py`` (offloaded owner state);
- ``hpz``: the rows of ``odcfn/bench/tiers_hpz.py`` (hierarchical shards, simulated).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

import odcfn

__all__ = ["bytes_per_step", "section", "simulate_formats", "step_time_shm"]

GATHERS = (None, "fp8_e4m3", "int8")  # None: bf16, the compute dtype
PUSHES = (None, "bf16", "int8")  # None: the bf16 gradient as it is


def _model(ctx: Any) -> tuple[Any, Any]:
    from odcfn.models import init_params, qwen_model

    cfg = ctx.workload.model
    return qwen_model(cfg), init_params(cfg, seed=0)


def bytes_per_step(ctx: Any) -> dict:
    """Counters of one bf16 grad step per (gather, push) format on 2 in-process ranks, and the
    bytes the formats' sizes predict for the plan that ran."""
    from odcfn.bench.workload import make_batch
    from odcfn.kernels.quant import get_format
    from odcfn.schedule.plan import Gather, ScatterAccumulate
    from odcfn.sharding import make_layout

    model, full = _model(ctx)
    batch = make_batch(ctx.workload, 0)
    world = 2
    size = {u.name: u.shard_size for u in make_layout(model, odcfn.Mesh(world)).units}
    rows = []
    for gather, push in [(g, None) for g in GATHERS] + [(None, p) for p in PUSHES[1:]]:

        def fn(rank: int, tr: Any, g=gather, p=push) -> Any:
            state = odcfn.TrainState.create(
                params=full,
                model=model,
                optimizer=odcfn.sgd(0.0),
                transport=tr,
                config=odcfn.StepConfig(compute_dtype=torch.bfloat16, gather_format=g, push_format=p),
            )
            return odcfn.grad_step(state, batch)[1]

        m = odcfn.run_local(fn, world, timeout=300)[0]
        gf, pf = get_format(gather or "bf16"), get_format(push or "bf16")
        steps = m.plan.steps
        rows.append(
            {
                "gather_format": gather or "bf16",
                "push_format": push or "bf16",
                "gather_bytes": m.counters.gather_bytes,
                "scatter_bytes": m.counters.scatter_bytes,
                "expected_gather_bytes": sum(
                    (world - 1) * gf.nbytes(size[s.unit]) for s in steps if isinstance(s, Gather)
                ),
                "expected_scatter_bytes": sum(
                    (world - 1) * pf.nbytes(size[s.unit]) for s in steps if isinstance(s, ScatterAccumulate)
                ),
            }
        )
    base = rows[0]
    for r in rows:
        r["gather_vs_bf16"] = r["gather_bytes"] / base["gather_bytes"]
        r["push_vs_bf16"] = r["scatter_bytes"] / base["scatter_bytes"]
    return {"world_size": world, "rows": rows}


def _shm_worker(workload: Any, steps: int) -> list[list[float]]:
    from odcfn.bench.workload import make_batch
    from odcfn.models import init_params, qwen_model
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    model, full = qwen_model(workload.model), init_params(workload.model, seed=0)
    mesh = odcfn.Mesh.from_env()
    times: list[list[float]] = [[] for _ in GATHERS]
    with ShmTransport(mesh, timeout=300) as tr:
        states = [
            odcfn.TrainState.create(
                params=full,
                model=model,
                optimizer=odcfn.adamw(1e-3),
                transport=tr,
                config=odcfn.StepConfig(compute_dtype=torch.bfloat16, gather_format=g),
            )
            for g in GATHERS
        ]
        for step in range(steps + 1):  # step 0 warms up (segments mapped per format)
            batch = make_batch(workload, step)
            for i in range(len(GATHERS)):  # interleaved: machine noise falls on all alike
                tr.collectives.barrier()
                t0 = time.perf_counter()
                states[i], _ = odcfn.train_step(states[i], batch)
                tr.collectives.barrier()
                if step:
                    times[i].append(time.perf_counter() - t0)
    return times


def step_time_shm(ctx: Any, steps: int) -> dict:
    """Median and range of the step time per gather format, 2 processes over /dev/shm."""
    out = odcfn.launch(_shm_worker, 2, args=(ctx.workload, steps), timeout=600)[0]
    rows = {}
    for g, ts in zip(GATHERS, out):
        rows[g or "bf16"] = {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}
    base = rows["bf16"]["median_s"]
    for r in rows.values():
        r["vs_bf16"] = r["median_s"] / base
    return {
        "steps": steps,
        "rows": rows,
        "note": "2 processes on a shared 2-core machine; no speedup claimed",
    }


def simulate_formats(
    devices: tuple[int, ...] = (8, 64, 1024),
    minibatches: int = 3,
    samples_per_device: tuple[int, ...] = (1, 4),
) -> list[dict]:
    """ODC (LB-Mini) step time in the simulator with bf16 against fp8 gathers (pushes bf16)."""
    from odcfn.schedule.balance import lb_mini
    from odcfn.schedule.simcells import cell_setup
    from odcfn.schedule.simmodel import A100_COMM, element_bytes
    from odcfn.schedule.simulate import compile_plans, simulate

    rows = []
    for d, spd in [(d, s) for s in samples_per_device for d in devices]:
        row: dict[str, Any] = {"devices": d, "samples_per_device": spd}
        for fmt in (None, "fp8_e4m3"):
            ds, cost, cap, mesh, work = cell_setup(
                "longalign", d, 28, None, None, gather_bytes=element_bytes(fmt)
            )
            total = 0.0
            for k in range(minibatches):
                lengths = ds.sample(d * spd, seed=k)
                plans = compile_plans(work.units, lb_mini(lengths, d, cap, cost=cost), "odc")
                total += simulate(
                    plans, lengths, workload=work, cost=cost, comm=A100_COMM, mesh=mesh, record=False
                ).makespan
            row[f"step_s_{fmt or 'bf16'}"] = total / minibatches
        row["fp8_vs_bf16"] = row["step_s_fp8_e4m3"] / row["step_s_bf16"]
        rows.append(row)
    return rows


def _offload(ctx: Any, quick: bool) -> dict:
    """The offload rows (``odcfn.bench.tiers_offload``: peak memory and step time of offloaded
    owner state against in-memory)."""
    from odcfn.bench.tiers_offload import section as offload_section

    return offload_section(ctx, quick)


def _hpz(quick: bool) -> list[dict]:
    """The hierarchical-shard rows (``odcfn.bench.tiers_hpz``: simulated step time and cross-node
    bytes with ``reshard_after_forward`` = the node size, against the default)."""
    from odcfn.bench.tiers_hpz import simulate_hpz

    return simulate_hpz((8, 64) if quick else (8, 64, 256, 1024))


def section(ctx: Any, quick: bool = False) -> dict:
    from odcfn.bench.tiers_train import training_curves

    parts = {
        "bytes": lambda: bytes_per_step(ctx),
        "step_time_shm": lambda: step_time_shm(ctx, 2 if quick else 6),
        "simulator": lambda: simulate_formats((8, 64) if quick else (8, 64, 1024)),
        "training": lambda: training_curves(40 if quick else 200),
        "offload": lambda: _offload(ctx, quick),
        "hpz": lambda: _hpz(quick),
    }
    out: dict[str, Any] = {}
    for name, run in parts.items():
        ctx.log(f"   tiers: {name}")
        try:
            out[name] = run()
        except Exception as e:  # one failed part must not cost the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out
