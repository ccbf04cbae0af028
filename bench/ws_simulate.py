"""Work stealing's list granularity in the simulator: speed-up over LB-Mini with one slow rank,
and microbatches per rank, for LB-Mini, packed lists, the tail split sample by sample
(``WorkStealing(split_tail=...)``) and every list split, on the bench workload's lengths.

    python bench/ws_simulate.py [--minibatches 40] [--tails 0.2 0.3]

The simulator overlaps transfers with compute, so it shows what granularity buys against a
straggler, not what the extra microbatches cost on CPU (bench/ws_profile.py measures that).
"""

from __future__ import annotations

import argparse


def main() -> None:
    from odcfn.bench.workload import Workload, make_lengths
    from odcfn.schedule.balance import lb_mini
    from odcfn.schedule.cost import QuadraticCost
    from odcfn.schedule.simmodel import Workload as SimWorkload
    from odcfn.schedule.simulate import compile_plans, simulate, simulate_work_stealing
    from odcfn.schedule.steal import steal_plan

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minibatches", type=int, default=40)
    p.add_argument("--tails", type=float, nargs="+", default=[0.2, 0.3])
    p.add_argument("--samples-per-rank", type=int, default=4)
    a = p.parse_args()
    cost = QuadraticCost(a=1.0 / 4000, b=1.0)  # attention's share at the bench's lengths
    sim_w = SimWorkload.uniform(6)
    variants = [("split everything", 1.0), *((f"tail {t:g}", t) for t in a.tails), ("packed lists", 0.0)]
    for world in (2, 8):
        w = Workload(world_size=world, samples_per_rank=a.samples_per_rank)
        cap = w.max_tokens_per_microbatch
        for slow in (1.5, 2.0):
            sd = [1.0] * (world - 1) + [slow]
            times, mbs = {}, {}
            for name, tail in [("lb-mini", None), *variants]:
                total, count = 0.0, 0
                for step in range(a.minibatches):
                    lengths = make_lengths(w, step)
                    if tail is None:
                        plans = compile_plans(sim_w.units, lb_mini(lengths, world, cap, cost=cost))
                        r = simulate(plans, lengths, workload=sim_w, cost=cost, slowdown=sd, record=False)
                    else:
                        sp = steal_plan(lengths, world, cap, cost=cost, split_tail=tail)
                        r = simulate_work_stealing(lengths, world, workload=sim_w, cost=cost, max_tokens=cap,
                                                   plan=sp, slowdown=sd, overhead=0.0, record=False)
                    total += r.makespan
                    count += sum(len(p.microbatches) for p in r.plans)
                times[name], mbs[name] = total, count / a.minibatches / world
            print(f"W={world}, one rank {slow:g}x slower: " + "; ".join(
                f"{k} {times['lb-mini'] / v:.3f}x ({mbs[k]:.2f} mb/rank)" for k, v in times.items()))


if __name__ == "__main__":
    main()
