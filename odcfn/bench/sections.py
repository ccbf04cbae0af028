"""The sections of ``odcfn bench``: each returns a JSON-ready dict of raw figures
(``odcfn.bench.summary`` derives the headline ratios from them and prints them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from odcfn.bench.report import losses_match, policy_summary
from odcfn.bench.runner import RunSpec, run
from odcfn.bench.workload import SAME_WIRE, Workload
from odcfn.schedule.policy import HEADLINE

__all__ = ["Context", "balanced", "end_to_end", "fsdp2", "primitives", "simulator", "straggler"]

# the headline trio plus the same-wire baseline (collectives over the shared memory ODC uses):
# ODC / same-wire is what removing per-layer barriers buys, same-wire / gloo what the wire buys.
# The simulator replays the headline trio (its wire model is gloo's for collectives).
E2E = (HEADLINE[0], SAME_WIRE, *HEADLINE[1:])
BALANCED = ("collective+lb-micro", SAME_WIRE, "odc+lb-mini")


@dataclass
class Context:
    workload: Workload
    backend: str
    steps: int
    warmup: int
    progress: bool
    log: Callable[[str], None] = print
    records: dict[int, list[list[dict]]] = field(default_factory=dict)  # spr -> per-rank records
    calibration: tuple | None = None  # sim.calibrate_cost's (cost, sim workload, record)
    straggler_records: tuple | None = None  # (per-rank records, slowdown per rank)

    @property
    def cost(self):
        return self.calibration[0] if self.calibration else None


def compare_policies(ctx: Context, w: Workload, policies: Sequence[str], slowdown=()) -> tuple[dict, list]:
    spec = RunSpec(w, tuple(policies), steps=ctx.steps, warmup=ctx.warmup, slowdown=tuple(slowdown),
                   progress=ctx.progress, cost=ctx.cost)
    per_rank = run(spec, ctx.backend)
    sums = {p: policy_summary(per_rank, p) for p in policies}
    ok, worst = losses_match(list(sums.values()))
    out = {"samples_per_rank": w.samples_per_rank, "policies": sums, "losses_match": ok,
           "max_loss_rel_diff": worst}
    return out, per_rank


def end_to_end(ctx: Context, samples_per_rank: Sequence[int]) -> dict:
    out = {}
    for n in samples_per_rank:
        ctx.log(f"   {n} samples per rank")
        res, per_rank = compare_policies(ctx, ctx.workload.with_(samples_per_rank=n), E2E)
        ctx.records[n] = per_rank
        out[str(n)] = res
    return {"by_samples_per_rank": out}


def balanced(ctx: Context) -> dict:
    res, _ = compare_policies(ctx, ctx.workload.with_(balanced=True), BALANCED)
    return res


def straggler(ctx: Context, factor: float) -> dict:
    W = ctx.workload.world_size
    slow = (1.0,) * (W - 1) + (factor,)
    ctx.log(f"   rank {W - 1} emulates a {factor}x slower device (odcfn.models.slow.slow_model): each unit's "
            f"forward and backward take {factor:g}x as long")
    res, per_rank = compare_policies(ctx, ctx.workload, E2E, slow)
    ctx.straggler_records = (per_rank, slow)
    res["slowdown_per_rank"] = list(slow)
    res["emulation"] = (f"rank {W - 1} runs odcfn.models.slow.slow_model(model, {factor:g}): "
                        "every unit's forward and backward sleeps (factor - 1) x its own time inside the "
                        "step, so the slow device's time is compute (busy), as in the simulator")
    return res


def fsdp2(ctx: Context) -> dict:
    if ctx.backend != "process":
        return {"skipped": "torch FSDP2 needs real processes (odcfn.launch)"}
    from odcfn.bench.fsdp2 import Fsdp2Spec, fsdp2_worker, summarize
    from odcfn.launch import launch

    spec = Fsdp2Spec(ctx.workload, steps=ctx.steps, warmup=ctx.warmup, cost=ctx.cost)
    per_rank = launch(fsdp2_worker, ctx.workload.world_size, args=(spec,), timeout=1200.0)
    a, b, c = (summarize(per_rank, impl) for impl in ("odcfn", "fsdp2", "odc"))
    ok, worst = losses_match([a, b, c], rtol=1e-3)
    return {"odcfn_collective": a, "torch_fsdp2": b, "odc_lb_mini": c, "losses_match": ok,
            "max_loss_rel_diff": worst, "samples_per_rank": ctx.workload.samples_per_rank}


def primitives(ctx: Context, sizes_mib: Sequence[int]) -> dict:
    if ctx.backend != "process":
        return {"skipped": "shm and gloo primitives need real processes (odcfn.launch)"}
    from odcfn.bench.primitives import PrimSpec, primitives_worker, summarize
    from odcfn.launch import launch

    spec = PrimSpec(sizes_mib=tuple(sizes_mib))
    per_rank = launch(primitives_worker, ctx.workload.world_size, args=(spec,), timeout=600.0)
    return summarize(per_rank, sizes_mib)


def simulator(ctx: Context, report: dict) -> dict:
    from odcfn.bench.sim import compare

    n = ctx.workload.samples_per_rank
    if n not in ctx.records:
        return {"skipped": f"needs the end_to_end run at {n} samples per rank"}
    prim = report.get("primitives")
    prim = prim if isinstance(prim, dict) and "gbps" in prim else None
    out = compare(ctx.records[n], ctx.workload, HEADLINE, calibration=ctx.calibration, primitives=prim,
                  run_cost=ctx.cost)
    if ctx.straggler_records is not None:  # the slowdown model, checked the same way
        per_rank, slow = ctx.straggler_records
        st = compare(per_rank, ctx.workload, HEADLINE, calibration=ctx.calibration, primitives=prim,
                     slowdown=slow, run_cost=ctx.cost, with_extrapolation=False)
        out["straggler"] = {k: st[k] for k in ("policies", "rows", "in_situ_fit",
                                                "simulated_over_measured_step_time",
                                                "simulated_over_measured_step_time_offline")}
    return out
