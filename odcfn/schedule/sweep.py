"""``odcfn simulate``: balancers x devices x samples per device x datasets, in the simulator.

For each cell it samples minibatches of ``devices x samples_per_device`` lengths, builds the
three schedules -- Collective + LB-Micro (the FSDP baseline), ODC + LB-Mini, ODC + work stealing
-- simulates them and reports bubble rates, the bubble lower bound ``max(max cost, total / D)``
and samples/s. Compute costs are the FLOPs of a 7B-class model at a fixed MFU on A100s; comm is
an A100 cluster (NVLink inside a node of 8, 200 Gb/s InfiniBand across nodes) unless ``--network
zero``. ``--staleness`` prints ODC + LB-Mini at several τ instead (``stalesweep``), ``--quality``
the balancers alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from odcfn.schedule.balance import collective_time, lb_micro, lb_mini
from odcfn.schedule.cost import QuadraticCost
from odcfn.schedule.lengths import DATASETS, get_dataset
from odcfn.schedule.plan import Assignment
from odcfn.schedule.policy import HEADLINE
from odcfn.schedule.simcells import cell_setup, default_cost, slowdowns
from odcfn.schedule.simulate import (
    A100_COMM,
    ZERO_COMM,
    CommModel,
    compile_plans,
    lower_bound_makespan,
    simulate,
    simulate_work_stealing,
)

__all__ = ["Row", "add_arguments", "balancer_quality", "main", "run_cell", "sweep"]

COMMS = {"a100": A100_COMM, "zero": ZERO_COMM}


@dataclass(frozen=True)
class Row:
    dataset: str
    devices: int
    samples_per_device: int
    policy: str
    straggler: float
    bubble_rate: float
    lower_bound_bubble_rate: float
    samples_per_s: float  # simulated
    speedup: float  # samples/s relative to collective+lb-micro in the same cell
    time_to_bound: float  # step time over the lower bound's (summed over the minibatches)


def run_cell(
    dataset: str,
    devices: int,
    samples_per_device: int,
    *,
    straggler: float = 1.0,
    slow_fraction: float = 1.0,
    slow_rank: int | None = None,
    minibatches: int = 4,
    units: int = 8,
    comm: CommModel = A100_COMM,
    cost: QuadraticCost | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
) -> list[Row]:
    """One cell: the three policies on the same ``minibatches`` sampled minibatches. Bubble
    rates are time-weighted over the minibatches; samples/s = all samples / all step time.
    The straggler (``slowdowns``) is slow on a ``slow_fraction`` of the minibatches."""
    ds, cost, cap, mesh, work = cell_setup(dataset, devices, units, cost, max_tokens)
    acc = {p: [0.0, 0.0, 0] for p in HEADLINE}  # busy, rank-time, samples
    lb_busy = lb_time = 0.0
    for k in range(minibatches):
        lengths = ds.sample(devices * samples_per_device, seed=seed * 1000 + k)
        slow = slowdowns(devices, k, seed, straggler, slow_fraction, slow_rank)
        kw = dict(workload=work, cost=cost, comm=comm, mesh=mesh, slowdown=slow, record=False)
        results = {
            "collective+lb-micro": simulate(
                compile_plans(work.units, lb_micro(lengths, devices, cap, cost=cost), "collective"),
                lengths,
                **kw,
            ),
            "odc+lb-mini": simulate(
                compile_plans(work.units, lb_mini(lengths, devices, cap, cost=cost), "odc"), lengths, **kw
            ),
            "odc+work-stealing": simulate_work_stealing(
                lengths, devices, max_tokens=cap, **kw
            ),
        }
        for p, res in results.items():
            acc[p][0] += sum(res.busy)
            acc[p][1] += devices * res.makespan
            acc[p][2] += res.num_samples
        total = sum(cost(n) for n in lengths)
        lb_busy += total
        lb_time += devices * lower_bound_makespan(lengths, devices, cost, slow)
    base = acc[HEADLINE[0]][2] / (acc[HEADLINE[0]][1] / devices)
    rows = []
    for p in HEADLINE:
        busy, rank_time, n = acc[p]
        sps = n / (rank_time / devices)
        rows.append(
            Row(
                dataset,
                devices,
                samples_per_device,
                p,
                straggler,
                1.0 - busy / rank_time,
                1.0 - lb_busy / lb_time,
                sps,
                sps / base,
                rank_time / lb_time,
            )
        )
    return rows


def sweep(
    datasets: Sequence[str], devices: Sequence[int], samples_per_device: Sequence[int], **kw: object
) -> list[Row]:
    return [
        row
        for ds in datasets
        for d in devices
        for s in samples_per_device
        for row in run_cell(ds, d, s, **kw)  # type: ignore[arg-type]
    ]


def balancer_quality(
    datasets: Sequence[str],
    devices: Sequence[int],
    samples_per_device: Sequence[int],
    *,
    minibatches: int = 16,
    cost: QuadraticCost | None = None,
    seed: int = 0,
    micro: Callable[..., Assignment] = lb_micro,
    mini: Callable[..., Assignment] = lb_mini,
) -> list[dict[str, object]]:
    """The balancers alone, on the sweep's minibatches (no simulator): per cell the mean over
    ``minibatches`` of LB-Micro's collective time (sum over microbatch slots of the heaviest
    rank's microbatch) and of LB-Mini's max rank load, each over the bound ``max(max cost,
    total / D)``."""
    cost = cost or default_cost()
    out = []
    for name in datasets:
        ds = get_dataset(name)
        for d in devices:
            for s in samples_per_device:
                r_micro, r_mini = [], []
                for k in range(minibatches):
                    lengths = ds.sample(d * s, seed=seed * 1000 + k)
                    costs = [cost(n) for n in lengths]
                    bound = max(max(costs), sum(costs) / d)
                    a = micro(lengths, d, ds.max_tokens, cost=cost)
                    b = mini(lengths, d, ds.max_tokens, cost=cost)
                    slots = [[sum(costs[i] for i in mb) for mb in r] for r in a]
                    r_micro.append(collective_time(slots) / bound)
                    r_mini.append(max(sum(costs[i] for mb in r for i in mb) for r in b) / bound)
                out.append(
                    dict(
                        dataset=name,
                        devices=d,
                        samples_per_device=s,
                        lb_micro=statistics.mean(r_micro),
                        lb_mini=statistics.mean(r_mini),
                    )
                )
    return out


def format_quality(cells: Sequence[dict[str, object]]) -> str:
    head = (
        f"{'dataset':<10} {'D':>5} {'s/D':>4} | {'LB-Micro coll. time/bound':>25} "
        f"{'LB-Mini max load/bound':>22}"
    )
    lines = [head, "-" * len(head)]
    for c in cells:
        lines.append(
            f"{c['dataset']:<10} {c['devices']:>5} {c['samples_per_device']:>4} | {c['lb_micro']:>25.4f} "
            f"{c['lb_mini']:>22.4f}"
        )
    return "\n".join(lines)


def format_table(rows: Sequence[Row]) -> str:
    """One line per cell: bubble rates of the three policies and the lower bound, the ODC
    policies' samples/s relative to Collective + LB-Micro, and each policy's step time over
    the lower bound's."""
    head = (
        f"{'dataset':<10} {'D':>5} {'s/D':>4} | {'bubble: coll+micro':>18} {'odc+mini':>9} "
        f"{'odc+ws':>7} {'bound':>6} | {'x mini':>6} {'x ws':>6} | {'time/bound: micro':>17} "
        f"{'mini':>5} {'ws':>5}"
    )
    lines = [head, "-" * len(head)]
    cells: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        cells.setdefault((r.dataset, r.devices, r.samples_per_device), {})[r.policy] = r
    for (ds, d, s), by in cells.items():
        c, m, w = (by[p] for p in HEADLINE)
        lines.append(
            f"{ds:<10} {d:>5} {s:>4} | {c.bubble_rate:>18.1%} {m.bubble_rate:>9.1%} "
            f"{w.bubble_rate:>7.1%} {c.lower_bound_bubble_rate:>6.1%} | {m.speedup:>5.2f}x {w.speedup:>5.2f}x"
            f" | {c.time_to_bound:>17.3f} {m.time_to_bound:>5.3f} {w.time_to_bound:>5.3f}"
        )
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints, got {s!r}")
    return out


def _names(s: str) -> list[str]:
    out = [x for x in s.split(",") if x]
    bad = [x for x in out if x not in DATASETS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown dataset(s) {bad}; known: {sorted(DATASETS)}")
    return out


def _staleness(s: str) -> list[int]:
    from odcfn.schedule.stalesweep import parse_staleness  # only with --staleness

    return parse_staleness(s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=_ints, default=[8, 16, 32, 64, 1024], help="comma-separated")
    p.add_argument("--samples-per-device", type=_ints, default=[1, 2, 4, 8], help="comma-separated")
    p.add_argument("--datasets", type=_names, default=list(DATASETS), help=f"of {sorted(DATASETS)}")
    p.add_argument("--straggler", "--slow-factor", type=float, default=1.0,
                   help="slow one device by this factor (a random one each minibatch)")
    p.add_argument("--slow-fraction", type=float, default=1.0,
                   help="the straggler is slow on this random fraction of the minibatches (default 1)")
    p.add_argument("--slow-rank", type=int, default=None,
                   help="always slow this device instead of a random one (a fixed straggler)")
    p.add_argument("--staleness", type=_staleness, default=None, metavar="TAU[,TAU...]",
                   help="bounded staleness: ODC + LB-Mini at these τ (and τ=0) on the same minibatches, "
                   "one row per τ (docs/staleness.md)")
    p.add_argument("--permute-ranks", action="store_true",
                   help="with --staleness: a seeded permutation per minibatch of which device runs which "
                   "LB-Mini load (LB-Mini gives the heaviest to the lowest ranks every time)")
    p.add_argument("--minibatches", type=int, default=4, help="sampled minibatches per cell")
    p.add_argument("--units", type=int, default=8, help="FSDP units the 7B model is cut into")
    p.add_argument("--network", choices=sorted(COMMS), default="a100",
                   help="simulated communication costs (as in odcfn plan)")
    p.add_argument("--max-tokens", type=int, default=None, help="microbatch cap (default: dataset max)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON list of rows instead")
    p.add_argument(
        "--quality",
        action="store_true",
        help="the balancers alone: LB-Micro's collective time and LB-Mini's max load over the bound",
    )


def main(args: argparse.Namespace) -> int:
    if args.straggler < 1.0:
        print(f"odcfn simulate: --straggler must be >= 1.0, got {args.straggler}", file=sys.stderr)
        return 2
    if args.minibatches < 1 or args.units < 1:
        print("odcfn simulate: --minibatches and --units must be >= 1", file=sys.stderr)
        return 2
    if not 0.0 <= args.slow_fraction <= 1.0:
        print(f"odcfn simulate: --slow-fraction must be in [0, 1], got {args.slow_fraction}", file=sys.stderr)
        return 2
    bad = [d for d in args.devices if args.slow_rank is not None and not 0 <= args.slow_rank < d]
    if bad:
        print(f"odcfn simulate: --slow-rank {args.slow_rank} is not a device of {bad[0]}", file=sys.stderr)
        return 2
    if args.quality and args.staleness is not None:
        print("odcfn simulate: --quality and --staleness print different tables: pick one", file=sys.stderr)
        return 2
    if args.permute_ranks and args.staleness is None:
        print("odcfn simulate: --permute-ranks needs --staleness (synchronous steps do not care which "
              "device runs which load)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.quality:
        cells = balancer_quality(
            args.datasets, args.devices, args.samples_per_device, minibatches=args.minibatches, seed=args.seed
        )
        print(json.dumps(cells) if args.json else format_quality(cells))
        if not args.json:
            took = time.perf_counter() - t0
            print(f"({len(cells)} cells in {took:.1f} s, {args.minibatches} minibatches per cell)")
        return 0
    if args.staleness is not None:
        from odcfn.schedule.stalesweep import main as stale_main  # only with --staleness

        return stale_main(args, COMMS[args.network], t0)
    try:
        rows = sweep(
            args.datasets,
            args.devices,
            args.samples_per_device,
            straggler=args.straggler,
            slow_fraction=args.slow_fraction,
            slow_rank=args.slow_rank,
            minibatches=args.minibatches,
            units=args.units,
            comm=COMMS[args.network],
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
    except ValueError as e:  # e.g. a --max-tokens below the longest sample
        print(f"odcfn simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        print(format_table(rows))
        print(
            f"({len(rows) // len(HEADLINE)} cells in {time.perf_counter() - t0:.1f} s; "
            f"straggler x{args.straggler:g}{_fraction(args)}, network={args.network}, {args.units} units, "
            f"{args.minibatches} minibatches per cell)"
        )
    return 0


def _fraction(args: argparse.Namespace) -> str:
    where = "" if args.slow_rank is None else f" at device {args.slow_rank}"
    return where + ("" if args.slow_fraction == 1.0 else f" on {args.slow_fraction:.0%} of minibatches")

