"""The preference section of ``odcfn bench`` (data and loss in ``odcfn.bench.preference``): DPO
updates on UltraFeedback-like pairs, ODC+LB-Mini against Collective+LB-Micro (equal pairs per
rank) side by side, repeated, and the simulator at 8-1024 devices.

A pair is one unit for the balancers (both members in one microbatch on one rank,
``odcfn.preference``), so pairs are what the baseline's equal counts count."""

from __future__ import annotations

from collections.abc import Sequence

from odcfn.bench.preference import PREFERENCE_POLICIES, preference_lengths, preference_loss

__all__ = ["render", "section", "simulate_preference"]

BASE, ODC = PREFERENCE_POLICIES


def _sps(res: dict, policy: str) -> float:
    return res["policies"][policy]["samples_per_s"]


def section(ctx, repeats: int = 3, sim_devices: Sequence[int] = (8, 64, 1024)) -> dict:
    """``repeats`` side-by-side runs (each interleaves the two contenders minibatch by
    minibatch); the ratio of samples/s per run, its median and range; the simulator at scale."""
    from odcfn.bench.repeat import spread
    from odcfn.bench.runner import step_records
    from odcfn.bench.sections import compare_policies

    # UltraFeedback's pairs are ~40x shorter than LongAlign's samples: the SFT scale / 32
    w = ctx.workload.with_(dataset="preference", length_scale=max(1, ctx.workload.length_scale // 32))
    ctx.log(f"   UltraFeedback-like pairs / {w.length_scale}, {w.samples_per_rank} pairs per rank, "
            f"{repeats} repeats, loss {preference_loss()}")
    runs = []
    for k in range(repeats):
        ctx.log(f"   repeat {k + 1}/{repeats}")
        res, per_rank = compare_policies(ctx, w, PREFERENCE_POLICIES)
        # the baseline's rule, visible: pairs each rank ran, per timed minibatch
        res["pairs_per_rank_by_step"] = {
            p: [[sum(len(mb) for mb in r["microbatches"]) // 2 for r in recs]
                for recs in step_records(per_rank, p)] for p in PREFERENCE_POLICIES
        }
        res["odc_lb_mini_over_collective_lb_micro"] = _sps(res, ODC) / _sps(res, BASE)
        runs.append(res)
    lengths = [x for s in range(ctx.warmup, ctx.warmup + ctx.steps)
               for x in preference_lengths(w.samples_per_step, w.length_scale, w.seed * 100_003 + s)]
    members = [p + a for p, c, r in lengths for a in (c, r)]
    ctx.log(f"   simulator at {list(sim_devices)} devices")
    return {
        "pairs_per_rank": w.samples_per_rank,
        "policies": runs[-1]["policies"],  # the last run's figures, as the other sections report
        "losses_match": all(r["losses_match"] for r in runs),
        "runs": runs,
        "odc_lb_mini_over_collective_lb_micro": spread([r["odc_lb_mini_over_collective_lb_micro"]
                                                        for r in runs]),
        "lengths": {"length_scale": w.length_scale, "pairs": len(lengths),
                    "prompt_mean": sum(p for p, _, _ in lengths) / len(lengths),
                    "answer_mean": sum(c + r for _, c, r in lengths) / (2 * len(lengths)),
                    "member_mean": sum(members) / len(members), "member_max": max(members),
                    "pair_max": max(p * 2 + c + r for p, c, r in lengths),
                    "max_tokens_per_microbatch": w.max_tokens_per_microbatch},
        "loss": repr(preference_loss()),
        "simulated": [r for ppd in (2, 4) for r in simulate_preference(sim_devices, ppd)],
    }


def simulate_preference(devices: Sequence[int] = (8, 64, 1024), pairs_per_device: int = 4,
                        minibatches: int = 4) -> list[dict]:
    """Both contenders at scale in the simulator (``odcfn simulate``'s model: a 7B model at 45%
    MFU of an A100, its communication model, 8 ranks per node, full UltraFeedback-like lengths):
    pairs/s of ODC+LB-Mini relative to Collective+LB-Micro. The balancers place pair units
    priced by their total length, as the runtime does (``odcfn.preference.schedule_lengths``);
    the simulated compute of a pair is its two members' cost."""
    from odcfn.bench.preference import preference_max_tokens, ultrafeedback_like
    from odcfn.schedule.balance import lb_micro, lb_mini
    from odcfn.schedule.simcells import MODEL_PARAMS, RANKS_PER_NODE, default_cost
    from odcfn.schedule.simulate import A100_COMM, compile_plans, simulate
    from odcfn.schedule.simulate import Workload as SimWorkload
    from odcfn.sharding import Mesh

    cost, cap = default_cost(), preference_max_tokens(1)
    work = SimWorkload.uniform(8, model_bytes=2 * MODEL_PARAMS)
    rows = []
    for d in devices:
        mesh = Mesh(d, 0, RANKS_PER_NODE if d % RANKS_PER_NODE == 0 else None)
        acc = {p: [0.0, 0.0] for p in PREFERENCE_POLICIES}  # pairs, step time
        for k in range(minibatches):
            pairs = ultrafeedback_like(d * pairs_per_device, seed=k)
            units = [2 * p + c + r for p, c, r in pairs]
            members = [p + a for p, c, r in pairs for a in (c, r)]
            for name, balance, comm in ((BASE, lb_micro, "collective"), (ODC, lb_mini, "odc")):
                # unit k's microbatch holds samples 2k, 2k + 1 (odcfn.preference.expand_program)
                assignment = [[tuple(i for u in mb for i in (2 * u, 2 * u + 1)) for mb in rank]
                              for rank in balance(units, d, cap, cost=cost)]
                plans = compile_plans(work.units, assignment, comm)
                res = simulate(plans, members, workload=work, cost=cost, comm=A100_COMM, mesh=mesh,
                               record=False)
                acc[name][0] += res.num_samples / 2
                acc[name][1] += res.makespan
        base = acc[BASE][0] / acc[BASE][1]
        rows.append({"devices": d, "pairs_per_device": pairs_per_device,
                     BASE: 1.0, ODC: (acc[ODC][0] / acc[ODC][1]) / base})
    return rows


def render(sec: dict | None) -> str:
    """The section for humans (empty when it did not run)."""
    from odcfn.bench.report import table

    if not sec:
        return ""
    if "runs" not in sec:
        return f"\n\n9. preference optimization (DPO pairs): {sec.get('skipped') or sec.get('error')}"
    s, ln = sec["odc_lb_mini_over_collective_lb_micro"], sec["lengths"]
    runs = ", ".join(f"{r['odc_lb_mini_over_collective_lb_micro']:.3f}" for r in sec["runs"])
    rows = [[p, sec["policies"][p]["samples_per_s"], sec["policies"][p]["tokens_per_s"],
             sec["policies"][p]["bubble_rate"]] for p in PREFERENCE_POLICIES]
    sim = [[x["devices"], x["pairs_per_device"], x[ODC]] for x in sec["simulated"]]
    return "\n".join([
        "", "", f"9. preference optimization: DPO on UltraFeedback-like pairs ({sec['pairs_per_rank']} "
        f"pairs per rank; losses match: {sec['losses_match']})",
        f"   pairs / {ln['length_scale']}: prompt mean {ln['prompt_mean']:.0f}, answer mean "
        f"{ln['answer_mean']:.0f}, longest pair {ln['pair_max']} tokens",
        table(rows, ["policy (last run)", "samples/s", "tokens/s", "bubble"]),
        f"   odc+lb-mini / collective+lb-micro: median {s['median']:.3f}x [{s['min']:.3f}-{s['max']:.3f}] "
        f"over {s['n']} runs ({runs})",
        "   simulator (7B, full lengths), pairs/s over collective+lb-micro:",
        table(sim, ["devices", "pairs/device", "odc+lb-mini x"]),
    ])
