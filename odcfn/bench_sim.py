"""The simulator's prediction for the plans a benchmark ran vs the step times measured there,
and its extrapolation of the same workload to more devices.

Compute cost: ``odcfn.schedule.cost.measure_unit_times`` on this machine (one thread, like a
rank), fitted to ``a*s^2 + b*s``, with per-unit shares and the forward fraction from the same
measurement. Communication: the measured primitive bandwidths when the primitives section ran
(shm for ODC plans, gloo for collective plans), else DESIGN.md's figures for this machine.
Measured step time = the runtime's trace makespan (execute: first step to the end of the sync),
the part the simulator models; balancing and the optimizer update are outside both.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from odcfn.bench_runner import step_records
from odcfn.bench_workload import POLICIES, Workload, make_lengths

__all__ = ["calibrate_cost", "compare", "extrapolate"]

# DESIGN.md, measured on these 2-core machines: shm gather ~5-6.5 GB/s, gloo all-gather
# ~0.7-1.0 GB/s at 2 ranks, reduce-scatter about half; cross-process flag round trip ~100 us.
DEFAULT_GBPS = {"odc": 5.0, "collective": 0.8}
LATENCY_S = {"odc": 100e-6, "collective": 200e-6}


def calibrate_cost(w: Workload, lengths: Sequence[int] | None = None, repeats: int = 2):
    """(QuadraticCost in seconds, simulator Workload with unit shares and bytes, calibration
    record). Default lengths: 1/8, 1/4 and 1/2 of the cap (the workload's typical range)."""
    import torch

    from odcfn.models import init_params, qwen_model
    from odcfn.schedule.cost import fit_quadratic, measure_unit_times
    from odcfn.schedule.simulate import Workload as SimWorkload
    from odcfn.sharding import Mesh, make_layout

    cap = w.max_tokens_per_microbatch
    lengths = tuple(lengths or (max(2, cap // 8), max(3, cap // 4), max(4, cap // 2)))
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # what each rank has
    try:
        model = qwen_model(w.model)
        times = measure_unit_times(model, init_params(w.model, seed=w.seed), lengths,
                                   vocab_size=w.model.vocab_size, repeats=repeats)
    finally:
        torch.set_num_threads(prev)
    totals = [sum(f + b for f, b in times[n].values()) for n in lengths]
    cost = fit_quadratic(lengths, totals)
    fwd = sum(f for n in lengths for f, _ in times[n].values()) / sum(totals)
    # unit shares at the length nearest the workload's mean sample
    mean = sum(make_lengths(w, 0)) / w.samples_per_step
    ref = min(lengths, key=lambda n: abs(n - mean))
    weights = tuple(sum(times[ref][u]) for u in model.unit_names)
    layout = make_layout(model, Mesh(w.world_size))
    nbytes = {u.name: 4.0 * u.padded_numel for u in layout.units}
    sim_w = SimWorkload(model.unit_names, weights=weights, param_bytes=nbytes, fwd_fraction=fwd)
    calib = {"a": cost.a, "b": cost.b, "fwd_fraction": fwd, "lengths": list(lengths),
             "fwd_plus_bwd_s": totals}
    return cost, sim_w, calib


def _comm_models(primitives: dict | None, world: int) -> tuple[dict, str]:
    from odcfn.schedule.simulate import CommModel

    gbps, source = dict(DEFAULT_GBPS), "DESIGN.md figures"
    if primitives and "gbps" in primitives:
        g, sizes = primitives["gbps"], primitives["sizes_mib"]
        i = sizes.index(16) if 16 in sizes else len(sizes) - 1
        gbps = {"odc": min(g["shm_gather"][i], g["shm_scatter_accumulate"][i]),
                "collective": min(g["gloo_all_gather"][i], g["gloo_reduce_scatter"][i])}
        source = f"measured primitives at {sizes[i]} MiB"
    # CommModel moves (S-1)/S of a buffer at ``bandwidth``; our GB/s are full-buffer figures
    frac = (world - 1) / world if world > 1 else 1.0
    models = {c: CommModel(intra_bandwidth=gbps[c] * 1e9 * frac, inter_bandwidth=gbps[c] * 1e9 * frac,
                           intra_latency=LATENCY_S[c], inter_latency=LATENCY_S[c])
              for c in gbps}
    return models, f"{source}: {gbps} GB/s"


def _trace_makespan(recs: Sequence[dict]) -> float:
    return max((e[3] for r in recs for e in r["events"]), default=0.0)


def _simulate_step(recs, policy, cost, sim_w, comm, slowdown):
    from odcfn.schedule.plan import compile_plan
    from odcfn.schedule.simulate import simulate, simulate_work_stealing

    lengths = recs[0]["lengths"]
    W = len(recs)
    pol = POLICIES[policy]
    if recs[0]["balancer"] == "work_stealing":
        return simulate_work_stealing(lengths, W, workload=sim_w, cost=cost, comm=comm,
                                      slowdown=slowdown, record=False).makespan
    assignment = tuple(tuple(tuple(mb) for mb in r["microbatches"]) for r in recs)
    plans = [compile_plan(sim_w.units, assignment, r, pol.comm) for r in range(W)]
    return simulate(plans, lengths, workload=sim_w, cost=cost, comm=comm, slowdown=slowdown,
                    record=False).makespan


def compare(per_rank, w: Workload, policies: Sequence[str], *, primitives: dict | None = None,
            slowdown: Sequence[float] | None = None, calibration: tuple | None = None) -> dict:
    cost, sim_w, calib = calibration or calibrate_cost(w)
    comms, comm_src = _comm_models(primitives, w.world_size)
    rows, per_policy, sim_all, meas_all = [], {}, 0.0, 0.0
    for policy in policies:
        sims, meas = [], []
        for recs in step_records(per_rank, policy):
            comm = comms[POLICIES[policy].comm]
            sims.append(_simulate_step(recs, policy, cost, sim_w, comm, slowdown))
            meas.append(_trace_makespan(recs))
        per_policy[policy] = {"simulated_s": sims, "measured_s": meas,
                              "ratio": sum(sims) / sum(meas) if sum(meas) > 0 else None}
        rows.append([policy, sum(sims) / len(sims), sum(meas) / len(meas),
                     per_policy[policy]["ratio"]])
        sim_all += sum(sims)
        meas_all += sum(meas)
    return {
        "calibration": calib,
        "comm_model": comm_src,
        "policies": per_policy,
        "simulated_over_measured_step_time": sim_all / meas_all if meas_all > 0 else None,
        "columns": ["policy", "simulated s/step", "measured s/step", "simulated/measured"],
        "rows": rows,
        "extrapolation": extrapolate(w, cost, sim_w, comms),
    }


def extrapolate(w: Workload, cost, sim_w, comms, devices=(2, 8, 16, 32), samples_per_rank=(4,),
                minibatches: int = 8) -> list[dict]:
    """Simulated samples/s of the benchmark workload at more devices, same per-device model."""
    from odcfn.schedule.balance import get_balancer
    from odcfn.schedule.plan import compile_plan
    from odcfn.schedule.simulate import simulate, simulate_work_stealing

    out = []
    for D in devices:
        for n in samples_per_rank:
            wd = w.with_(world_size=D, samples_per_rank=n)
            row = {"devices": D, "samples_per_device": n}
            for policy in ("collective+lb-micro", "odc+lb-mini", "odc+work-stealing"):
                pol = POLICIES[policy]
                t = samples = 0.0
                for step in range(minibatches):
                    lengths = make_lengths(wd, 1000 + step)
                    if pol.balance == "work_stealing":
                        res = simulate_work_stealing(lengths, D, workload=sim_w, cost=cost,
                                                     comm=comms["odc"], record=False)
                    else:
                        a = partial(get_balancer(pol.balance), cost=cost)(
                            lengths, D, wd.max_tokens_per_microbatch)
                        plans = [compile_plan(sim_w.units, a, r, pol.comm) for r in range(D)]
                        res = simulate(plans, lengths, workload=sim_w, cost=cost,
                                       comm=comms[pol.comm], record=False)
                    t += res.makespan
                    samples += len(lengths)
                row[policy] = {"samples_per_s": samples / t}
            base = row["collective+lb-micro"]["samples_per_s"]
            for policy in ("odc+lb-mini", "odc+work-stealing"):
                row[policy]["over_collective_lb_micro"] = row[policy]["samples_per_s"] / base
            out.append(row)
    return out
