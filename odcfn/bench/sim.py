"""The simulator's prediction for the plans a benchmark ran vs the step times measured there,
and its extrapolation of the same workload to more devices.

Compute cost: ``odcfn.schedule.measure.measure_unit_times`` on this machine (one thread, like a
rank), fitted to ``a*s^2 + b*s``, with per-unit shares and the forward fraction from the same
measurement. Communication: the measured primitive bandwidths when the primitives section ran
(shm for ODC plans, gloo for collective plans), else DESIGN.md's figures for this machine.
Measured step time = the runtime's trace makespan (execute: first step to the end of the sync),
the part the simulator models; balancing and the optimizer update are outside both.
"""

from __future__ import annotations

from collections.abc import Sequence

from odcfn.bench.runner import step_records
from odcfn.bench.workload import Workload, make_lengths
from odcfn.schedule.policy import SCHEDULES

__all__ = ["calibrate_cost", "compare", "extrapolate"]

# DESIGN.md, measured on these 2-core machines: shm gather ~5-6.5 GB/s, gloo all-gather
# ~0.7-1.0 GB/s at 2 ranks, reduce-scatter about half; cross-process flag round trip ~100 us.
DEFAULT_GBPS = {"odc": 5.0, "collective": 0.8}
LATENCY_S = {"odc": 100e-6, "collective": 200e-6}


def calibrate_cost(w: Workload, lengths: Sequence[int] | None = None, repeats: int = 3):
    """(QuadraticCost in seconds, simulator Workload with unit shares and bytes, calibration
    record). Default lengths: 1/8, 1/4 and 1/2 of the cap (the workload's typical range)."""
    import torch

    from odcfn.models import init_params, qwen_model
    from odcfn.schedule.cost import fit_quadratic
    from odcfn.schedule.measure import measure_unit_times
    from odcfn.schedule.simulate import Workload as SimWorkload
    from odcfn.sharding import Mesh, make_layout

    cap = w.max_tokens_per_microbatch
    lengths = tuple(lengths or (max(2, cap // 8), max(3, cap // 4), max(4, cap // 2)))
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # what each rank has
    try:
        model = qwen_model(w.model)
        times = measure_unit_times(
            model, init_params(w.model, seed=w.seed), lengths, vocab_size=w.model.vocab_size, repeats=repeats
        )
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
    calib = {
        "a": cost.a,
        "b": cost.b,
        "fwd_fraction": fwd,
        "lengths": list(lengths),
        "fwd_plus_bwd_s": totals,
    }
    return cost, sim_w, calib


def _comm_models(primitives: dict | None, world: int) -> tuple[dict, str]:
    from odcfn.schedule.simulate import CommModel

    gbps, source = dict(DEFAULT_GBPS), "DESIGN.md figures"
    if primitives and "gbps" in primitives:
        g, sizes = primitives["gbps"], primitives["sizes_mib"]
        i = sizes.index(16) if 16 in sizes else len(sizes) - 1
        gbps = {
            "odc": min(g["shm_gather"][i], g["shm_scatter_accumulate"][i]),
            "collective": min(g["gloo_all_gather"][i], g["gloo_reduce_scatter"][i]),
        }
        source = f"measured primitives at {sizes[i]} MiB"
    # CommModel moves (S-1)/S of a buffer at ``bandwidth``; our GB/s are full-buffer figures
    frac = (world - 1) / world if world > 1 else 1.0
    models = {
        c: CommModel(
            intra_bandwidth=gbps[c] * 1e9 * frac,
            inter_bandwidth=gbps[c] * 1e9 * frac,
            intra_latency=LATENCY_S[c],
            inter_latency=LATENCY_S[c],
        )
        for c in gbps
    }
    return models, f"{source}: {gbps} GB/s"


def _trace_makespan(recs: Sequence[dict]) -> float:
    return max((e[3] for r in recs for e in r["events"]), default=0.0)


def _stealing(lengths: Sequence[int], world: int, cap: int, cost=None, sim_cost=None) -> dict:
    """What the runtime's work stealing runs with: the owners' lists it builds with ``cost``
    (None: the schedule layer's default), as ``train_step(..., balance="work_stealing",
    cost=cost)`` does, and its policy's guard and tolerance. The simulator times a plan's
    samples by the plan's own costs: ``sim_cost`` (the model being checked) replaces them."""
    from odcfn.schedule.cost import DEFAULT_COST
    from odcfn.schedule.steal import StealPlan, WorkStealing, steal_plan

    ws = WorkStealing()
    sp = steal_plan(
        lengths, world, cap, cost=cost or DEFAULT_COST, split_cost=ws.split_cost, split_tail=ws.split_tail
    )
    if sim_cost is not None:
        sp = StealPlan(sp.lists, tuple(float(sim_cost(n)) for n in lengths))
    return {"plan": sp, "overhead": ws.overhead, "tolerance": ws.tolerance}


def _simulate_step(recs, policy, cost, sim_w, comm, cap, slowdown=None, run_cost=None) -> float:
    from odcfn.schedule.plan import compile_plan
    from odcfn.schedule.simulate import simulate, simulate_work_stealing

    lengths = recs[0]["lengths"]
    W = len(recs)
    if recs[0]["balancer"] == "work_stealing":
        return simulate_work_stealing(
            lengths,
            W,
            workload=sim_w,
            cost=cost,
            **_stealing(lengths, W, cap, run_cost, cost),
            comm=comm,
            slowdown=slowdown,
            record=False,
        ).makespan
    assignment = tuple(tuple(tuple(mb) for mb in r["microbatches"]) for r in recs)
    plans = [compile_plan(sim_w.units, assignment, r, SCHEDULES[policy].comm) for r in range(W)]
    return simulate(
        plans, lengths, workload=sim_w, cost=cost, comm=comm, slowdown=slowdown, record=False
    ).makespan


def _microbatch_times(rec: dict) -> list[tuple[float, float, float]]:
    """(sum of s^2, sum of s, forward+backward seconds) of each non-empty microbatch of a rank."""
    busy: dict[int, float] = {}
    for kind, _, start, end, mb in rec["events"]:
        if kind in ("forward", "backward"):
            busy[mb] = busy.get(mb, 0.0) + end - start
    out = []
    for k, ids in enumerate(rec["microbatches"]):
        if ids and k in busy:
            ls = [rec["lengths"][i] for i in ids]
            out.append((float(sum(n * n for n in ls)), float(sum(ls)), busy[k]))
    return out


def fit_from_traces(steps: Sequence[Sequence[dict]], units: Sequence[str]):
    """(QuadraticCost, unit weights, forward fraction) fitted to the runtime's own compute events
    (least squares, ``a, b >= 0``) of the given minibatches."""
    from odcfn.schedule.cost import QuadraticCost

    pts = [p for recs in steps for r in recs for p in _microbatch_times(r)]
    if len(pts) < 2:
        raise ValueError("fit_from_traces needs at least two timed microbatches")
    s22 = sum(x * x for x, _, _ in pts)
    s21 = sum(x * y for x, y, _ in pts)
    s11 = sum(y * y for _, y, _ in pts)
    t2 = sum(x * t for x, _, t in pts)
    t1 = sum(y * t for _, y, t in pts)
    det = s22 * s11 - s21 * s21
    a, b = ((t2 * s11 - t1 * s21) / det, (s22 * t1 - s21 * t2) / det) if det > 0 else (-1.0, 0.0)
    if a < 0:
        a, b = 0.0, t1 / s11
    elif b < 0:
        a, b = t2 / s22, 0.0
    per_unit = dict.fromkeys(units, 0.0)
    fwd = total = 0.0
    for recs in steps:
        for r in recs:
            for kind, name, start, end, _ in r["events"]:
                if kind in ("forward", "backward") and name in per_unit:
                    per_unit[name] += end - start
                    total += end - start
                    fwd += (end - start) if kind == "forward" else 0.0
    return QuadraticCost(a, b), tuple(per_unit[u] for u in units), fwd / total


def compare(
    per_rank,
    w: Workload,
    policies: Sequence[str],
    *,
    primitives: dict | None = None,
    slowdown: Sequence[float] | None = None,
    calibration: tuple | None = None,
    run_cost=None,
    with_extrapolation: bool = True,
) -> dict:
    """Simulated vs measured step time of every timed minibatch of every policy, two ways:

    - ``in_situ`` (the headline): the cost model is fitted to the runtime's own forward/backward
      events of all the *other* minibatches of the run, warm-ups included but not the job's
      first (leave one minibatch out; the cold start below), so it sees
      the machine's speed during the run but never the minibatch it predicts;
    - ``offline``: the calibration measured before the run (``calibrate_cost``).

    ``run_cost`` is the cost model the run's balancers were bound to (``RunSpec.cost``; None:
    the schedule layer's default): the work-stealing queue is rebuilt with it.
    """
    from dataclasses import replace

    cost, sim_w, calib = calibration or calibrate_cost(w)
    comms, comm_src = _comm_models(primitives, w.world_size)
    cap = w.max_tokens_per_microbatch
    steps = {p: step_records(per_rank, p) for p in policies}
    all_steps = sorted({recs[0]["step"] for v in steps.values() for recs in v})
    # every minibatch of the run, warm-ups included, is training data for the others, except the
    # job's first (each rank's first record): it pays the processes' cold start (allocator, first
    # touch, lazy initialisation), measured at 3.5x the CPU seconds and 4x the compute time per
    # token of any later minibatch, and a least-squares fit over a --quick run's 11 minibatches
    # followed it: simulated / measured 1.31 and 1.47 with it, see docs/benchmarks.md
    cold = {(recs[0]["policy"], recs[0]["step"]) for recs in per_rank if recs}
    grouped: dict[tuple, list[dict]] = {}
    for recs in per_rank:
        for r in recs:
            if r["policy"] in steps and (r["policy"], r["step"]) not in cold:
                grouped.setdefault((r["policy"], r["step"]), []).append(r)
    fits = {}
    for k in all_steps:
        train = [recs for (_, step), recs in grouped.items() if step != k]
        c, weights, fwd = fit_from_traces(train, sim_w.units)
        fits[k] = (c, replace(sim_w, weights=weights, fwd_fraction=fwd))
    rows, per_policy = [], {}
    tot = {"in_situ": 0.0, "offline": 0.0, "measured": 0.0}
    for policy in policies:
        comm = comms[SCHEDULES[policy].comm]
        ins, off, meas = [], [], []
        for recs in steps[policy]:
            c, sw = fits[recs[0]["step"]]
            ins.append(_simulate_step(recs, policy, c, sw, comm, cap, slowdown, run_cost))
            off.append(_simulate_step(recs, policy, cost, sim_w, comm, cap, slowdown, run_cost))
            meas.append(_trace_makespan(recs))
        per_policy[policy] = {
            "simulated_s": ins,
            "simulated_offline_s": off,
            "measured_s": meas,
            "ratio": sum(ins) / sum(meas),
            "ratio_offline": sum(off) / sum(meas),
        }
        rows.append(
            [
                policy,
                sum(ins) / len(ins),
                sum(off) / len(off),
                sum(meas) / len(meas),
                sum(ins) / sum(meas),
                sum(off) / sum(meas),
            ]
        )
        tot["in_situ"] += sum(ins)
        tot["offline"] += sum(off)
        tot["measured"] += sum(meas)
    full_fit = fit_from_traces([r for v in steps.values() for r in v], sim_w.units)
    out = {
        "calibration": calib,
        "in_situ_fit": {"a": full_fit[0].a, "b": full_fit[0].b, "fwd_fraction": full_fit[2]},
        "comm_model": comm_src,
        "policies": per_policy,
        "simulated_over_measured_step_time": tot["in_situ"] / tot["measured"],
        "simulated_over_measured_step_time_offline": tot["offline"] / tot["measured"],
        "columns": [
            "policy",
            "sim s/step (in situ)",
            "sim s/step (offline)",
            "measured s/step",
            "sim/measured",
            "offline/measured",
        ],
        "rows": rows,
    }
    if with_extrapolation:
        out["extrapolation"] = extrapolate(
            w, full_fit[0], replace(sim_w, weights=full_fit[1], fwd_fraction=full_fit[2]), comms
        )
    return out


def extrapolate(
    w: Workload, cost, sim_w, comms, devices=(2, 8, 16, 32), samples_per_rank=(4,), minibatches: int = 8
) -> list[dict]:
    """Simulated samples/s of the benchmark workload at more devices, same per-device model
    (the cost model fitted to the whole run's traces, the same communication model)."""
    from odcfn.schedule.balance import get_balancer
    from odcfn.schedule.plan import compile_plan
    from odcfn.schedule.simulate import simulate, simulate_work_stealing

    out = []
    for D in devices:
        for n in samples_per_rank:
            wd = w.with_(world_size=D, samples_per_rank=n)
            row = {"devices": D, "samples_per_device": n}
            for policy in ("collective+lb-micro", "odc+lb-mini", "odc+work-stealing"):
                pol = SCHEDULES[policy]
                t = samples = 0.0
                for step in range(minibatches):
                    lengths = make_lengths(wd, 1000 + step)
                    if pol.balance == "work_stealing":
                        res = simulate_work_stealing(
                            lengths,
                            D,
                            workload=sim_w,
                            cost=cost,
                            comm=comms["odc"],
                            **_stealing(lengths, D, wd.max_tokens_per_microbatch, cost),
                            record=False,
                        )
                    else:
                        a = get_balancer(pol.balance, cost=cost)(lengths, D, wd.max_tokens_per_microbatch)
                        plans = [compile_plan(sim_w.units, a, r, pol.comm) for r in range(D)]
                        res = simulate(
                            plans, lengths, workload=sim_w, cost=cost, comm=comms[pol.comm], record=False
                        )
                    t += res.makespan
                    samples += len(lengths)
                row[policy] = {"samples_per_s": samples / t}
            base = row["collective+lb-micro"]["samples_per_s"]
            for policy in ("odc+lb-mini", "odc+work-stealing"):
                row[policy]["over_collective_lb_micro"] = row[policy]["samples_per_s"] / base
            out.append(row)
    return out
