"""``odcfn plan``: sample a minibatch, balance it, and print every rank's plan.

Per rank: its microbatches (sample ids, tokens, cost), its load relative to the mean, and with
``--show-steps`` the full step list; then the simulated step time and bubble rate (zero-cost
communication unless ``--network a100``). Work stealing has no static plan: what is printed is the
plan each rank ends up running in the simulation.
"""

from __future__ import annotations

import argparse
import sys

from odcfn.schedule.balance import WORK_STEALING, get_balancer
from odcfn.schedule.cost import DEFAULT_COST, TokenCost
from odcfn.schedule.lengths import DATASETS, get_dataset
from odcfn.schedule.plan import ScheduleOptions
from odcfn.schedule.policy import POLICIES, resolve_policy
from odcfn.schedule.simulate import (
    A100_COMM,
    ZERO_COMM,
    Workload,
    compile_plans,
    lower_bound_makespan,
    simulate,
    simulate_work_stealing,
)
from odcfn.sharding import Mesh

__all__ = ["add_arguments", "main", "render"]

COSTS = {"flops": DEFAULT_COST, "tokens": TokenCost()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", choices=sorted(DATASETS), default="longalign")
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--samples-per-device", type=int, default=4)
    p.add_argument("--balance", choices=sorted(POLICIES), default="lb_mini")
    p.add_argument("--comm", choices=("odc", "collective"), default="odc", help="plan mode")
    p.add_argument("--network", choices=("zero", "a100"), default="zero", help="simulated comm costs")
    p.add_argument("--units", type=int, default=4, help="FSDP units of the simulated model")
    p.add_argument("--cost", choices=sorted(COSTS), default="flops", help="balancing cost model")
    p.add_argument("--max-tokens", type=int, default=None, help="microbatch cap (default: dataset max)")
    p.add_argument("--straggler", type=float, default=1.0, help="slow the last device by this factor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show-steps", action="store_true", help="print every plan's full step list")


def render(args: argparse.Namespace) -> str:
    """The report as text (``main`` prints it)."""
    if args.devices < 1 or args.samples_per_device < 1 or args.units < 1:
        raise ValueError("--devices, --samples-per-device and --units must be >= 1")
    resolve_policy(args.balance, args.comm)  # e.g. work stealing cannot serve --comm collective
    if args.straggler < 1.0:
        raise ValueError(f"--straggler must be >= 1.0, got {args.straggler}")
    ds = get_dataset(args.dataset)
    cost = COSTS[args.cost]
    cap = args.max_tokens or ds.max_tokens
    world = args.devices
    lengths = ds.sample(world * args.samples_per_device, seed=args.seed)
    work = Workload.uniform(args.units, model_bytes=2 * 7.6e9)
    slow = [1.0] * world
    slow[-1] = args.straggler
    mesh = Mesh(world, 0, 8 if world % 8 == 0 else None)
    net = A100_COMM if args.network == "a100" else ZERO_COMM
    kw = dict(workload=work, cost=cost, comm=net, mesh=mesh, slowdown=slow)
    if args.balance == WORK_STEALING:
        res = simulate_work_stealing(lengths, world, max_tokens=cap, options=ScheduleOptions(), **kw)
    else:
        assignment = get_balancer(args.balance, cost=cost)(lengths, world, cap)
        res = simulate(compile_plans(work.units, assignment, args.comm), lengths, **kw)
    total = sum(cost(n) for n in lengths)
    lines = [
        f"{args.dataset}: {len(lengths)} samples, {sum(lengths)} tokens, {world} devices, "
        f"balance={args.balance}, comm={args.comm}, cap={cap} tokens/microbatch, cost={args.cost}",
    ]
    for plan in res.plans:
        load = sum(cost(lengths[i]) for mb in plan.microbatches for i in mb)
        mbs = "  ".join(
            "[" + " ".join(str(i) for i in mb) + f"] {sum(lengths[i] for i in mb)}t" if mb else "[] (empty)"
            for mb in plan.microbatches
        )
        n_samples = sum(len(mb) for mb in plan.microbatches)
        lines.append(
            f"rank {plan.rank:>3}: {len(plan.microbatches)} microbatches, load "
            f"{load / (total / world):5.2f}x mean, {n_samples} samples: {mbs}"
        )
        if args.show_steps:
            lines.append(str(plan))
    bound = lower_bound_makespan(lengths, world, cost, slow)
    lines.append(
        f"simulated step {res.makespan:.4g} (cost units), bubble rate {res.bubble_rate:.1%}; "
        f"lower bound {bound:.4g}, bubble {1 - total / (world * bound):.1%}"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    try:
        print(render(args))
    except ValueError as e:
        print(f"odcfn plan: {e}", file=sys.stderr)
        return 2
    return 0
