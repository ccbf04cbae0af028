"""The hierarchical-shard (hpZ) rows of ``odcfn bench --only tiers``: the simulator's ODC step
time with ``ScheduleOptions(reshard_after_forward=8)`` (the backward re-gathers inside the
8-device node) against the default (re-gathered from every owner, across nodes).

The paper's cluster (``A100_COMM``: NVLink 200 GB/s inside a node, 25 GB/s InfiniBand per GPU
across nodes), a 7B model in 8 units, bf16 gathers, LongAlign lengths, LB-Mini, ODC. Besides
the step times, each row reports the bytes one rank pulls across nodes per step, counted from
the plans: a gather from the owners moves ``(W - 8) / W`` of a unit across nodes, a gather from
the group none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["render", "simulate_hpz"]


def simulate_hpz(
    devices: Sequence[int] = (8, 64, 256, 1024),
    samples_per_device: int = 4,
    minibatches: int = 2,
    dataset: str = "longalign",
) -> list[dict[str, Any]]:
    """One row per device count: mean step time (s) without and with hpZ, their ratio, and the
    mean cross-node bytes a rank pulls per step in each."""
    from odcfn.schedule.balance import lb_mini
    from odcfn.schedule.plan import Gather, ScheduleOptions
    from odcfn.schedule.simcells import RANKS_PER_NODE, cell_setup
    from odcfn.schedule.simulate import A100_COMM, compile_plans, simulate

    node = RANKS_PER_NODE
    variants = {"reshard": ScheduleOptions(), "hpz": ScheduleOptions(reshard_after_forward=node)}
    rows = []
    for d in devices:
        ds, cost, cap, mesh, work = cell_setup(dataset, d, 8, None, None)
        unit_bytes = 2 * 7.6e9 / len(work.units)
        step = {v: 0.0 for v in variants}
        cross = {v: 0.0 for v in variants}
        for k in range(minibatches):
            lengths = ds.sample(d * samples_per_device, seed=k)
            assignment = lb_mini(lengths, d, cap, cost=cost)
            for v, opts in variants.items():
                plans = compile_plans(work.units, assignment, "odc", opts if d % node == 0 else None)
                res = simulate(
                    plans, lengths, workload=work, cost=cost, comm=A100_COMM, mesh=mesh, record=False
                )
                step[v] += res.makespan / minibatches
                outside = max(d - node, 0) / d
                n = sum(isinstance(s, Gather) and not s.group for p in plans for s in p.steps)
                cross[v] += n * unit_bytes * outside / d / minibatches
        rows.append(
            {
                "devices": d,
                "dataset": dataset,
                "step_s": step["reshard"],
                "step_s_hpz": step["hpz"],
                "hpz_speedup": step["reshard"] / step["hpz"] if step["hpz"] > 0 else float("nan"),
                "cross_node_gib_per_rank": cross["reshard"] / 2**30,
                "cross_node_gib_per_rank_hpz": cross["hpz"] / 2**30,
            }
        )
    return rows


def render(rows: list[dict[str, Any]] | None) -> str:
    if not rows:
        return ""
    lines = [
        "",
        f"hpZ (simulator; A100 cluster, 8 per node, 7B, {rows[0]['dataset']}, ODC + LB-Mini):",
        f"  {'devices':>7}  {'step s':>8}  {'hpZ s':>8}  {'speedup':>7}  {'xnode GiB/rank':>14}  {'hpZ':>6}",
    ]
    for r in rows:
        lines.append(
            f"  {r['devices']:>7}  {r['step_s']:>8.3f}  {r['step_s_hpz']:>8.3f}  {r['hpz_speedup']:>6.3f}x"
            f"  {r['cross_node_gib_per_rank']:>14.2f}  {r['cross_node_gib_per_rank_hpz']:>6.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(simulate_hpz()))
