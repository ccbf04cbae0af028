"""``odcfn simulate --staleness τ[,τ...]``: ODC + LB-Mini at several τ on the same minibatches.

Each cell samples ``minibatches`` minibatches as ``odcfn simulate`` does (same lengths, same
straggler draws), simulates each once with ``simulate`` and chains them at every τ with
``simstale.stale_timeline``: τ = 0 is the synchronous step (one sync per minibatch), τ >= 1 lets
a device start minibatch ``j + 1`` once every device finished minibatch ``j - τ``. τ = 0 is
always run too: it is what the speed-ups are relative to.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from odcfn.schedule.balance import lb_mini
from odcfn.schedule.cost import QuadraticCost
from odcfn.schedule.simcells import cell_setup, slowdowns
from odcfn.schedule.simstale import check_staleness, simulate_staleness
from odcfn.schedule.simulate import A100_COMM, CommModel, compile_plans

__all__ = ["StaleRow", "format_stale_table", "main", "parse_staleness", "stale_cell", "stale_sweep"]

POLICY = "odc+lb-mini"  # static plans: work stealing's steals depend on who shares a minibatch


@dataclass(frozen=True)
class StaleRow:
    dataset: str
    devices: int
    samples_per_device: int
    staleness: int
    straggler: float
    slow_fraction: float
    bubble_rate: float  # 1 - compute / (devices x run time), as the synchronous rows
    wait_rate: float  # share of device time spent waiting for versions (τ = 0: at the sync)
    samples_per_s: float
    speedup: float  # samples/s over τ = 0's in the same cell
    time_to_limit: float  # run time over the largest per-device sum of minibatch times (+ publish)
    lag_mean: float  # versions behind at a minibatch's start, over devices and minibatches
    lag_max: int


def stale_cell(
    dataset: str,
    devices: int,
    samples_per_device: int,
    staleness: Sequence[int] = (1,),
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
    permute: bool = False,
) -> list[StaleRow]:
    """One row per τ (0 first, then ``staleness`` in order, each once) on one cell's draws.

    ``permute``: device ``r`` runs LB-Mini's load ``perm[r]``, a seeded permutation per minibatch
    (every rank can compute it). LB-Mini hands its heaviest loads to the lowest ranks every time,
    so without it the same devices are the critical path in every minibatch and staleness cannot
    hide the per-minibatch imbalance, only noise that moves."""
    taus = list(dict.fromkeys([0, *(check_staleness(t) for t in staleness)]))
    ds, cost, cap, mesh, work = cell_setup(dataset, devices, units, cost, max_tokens)
    plans, lengths, slow = [], [], []
    for k in range(minibatches):
        ls = ds.sample(devices * samples_per_device, seed=seed * 1000 + k)  # run_cell's draws
        lengths.append(ls)
        assignment = lb_mini(ls, devices, cap, cost=cost)
        if permute:
            perm = random.Random(f"permute/{seed}/{k}").sample(range(devices), devices)
            assignment = tuple(assignment[perm[r]] for r in range(devices))
        plans.append(compile_plans(work.units, assignment, "odc"))
        slow.append(slowdowns(devices, k, seed, straggler, slow_fraction, slow_rank))
    runs = simulate_staleness(plans, lengths, taus, workload=work, cost=cost, comm=comm, mesh=mesh,
                              slowdowns=slow)
    base = runs[0].samples_per_s
    return [
        StaleRow(dataset, devices, samples_per_device, t, straggler, slow_fraction, r.bubble_rate,
                 r.wait_rate, r.samples_per_s, r.samples_per_s / base, r.makespan / r.timeline.limit,
                 r.lag_mean, r.lag_max)
        for t, r in runs.items()
    ]


def stale_sweep(
    datasets: Sequence[str], devices: Sequence[int], samples_per_device: Sequence[int],
    staleness: Sequence[int], **kw: object,
) -> list[StaleRow]:
    return [
        row
        for ds in datasets
        for d in devices
        for s in samples_per_device
        for row in stale_cell(ds, d, s, staleness, **kw)  # type: ignore[arg-type]
    ]


def format_stale_table(rows: Sequence[StaleRow]) -> str:
    """One line per cell and τ, in ``odcfn simulate``'s layout: bubble and version-wait rates,
    samples/s and its ratio to τ = 0, run time over the no-wait limit, version lag."""
    head = (
        f"{'dataset':<10} {'D':>5} {'s/D':>4} | {'τ':>2} | {'bubble':>6} {'wait':>6} | "
        f"{'samples/s':>9} {'x τ=0':>6} | {'time/limit':>10} | {'lag mean':>8} {'max':>3}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.dataset:<10} {r.devices:>5} {r.samples_per_device:>4} | {r.staleness:>2} | "
            f"{r.bubble_rate:>6.1%} {r.wait_rate:>6.1%} | {r.samples_per_s:>9.3f} {r.speedup:>5.3f}x | "
            f"{r.time_to_limit:>10.3f} | {r.lag_mean:>8.2f} {r.lag_max:>3}"
        )
    return "\n".join(lines)


def parse_staleness(s: str) -> list[int]:
    """``--staleness``: comma-separated ints >= 0."""
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(
            f"expected τ as comma-separated ints >= 0 (e.g. 1 or 0,1,2), got {s!r}"
        )
    return out


def describe(args: argparse.Namespace, cells: int, took: float) -> str:
    """The footer line: what was run."""
    noise = "no straggler"
    if args.straggler > 1.0:
        where = "a random device" if args.slow_rank is None else f"device {args.slow_rank}"
        noise = f"{where} x{args.straggler:g} on {args.slow_fraction:.0%} of minibatches"
    policy = POLICY + (" (loads permuted over devices each minibatch)" if args.permute_ranks else "")
    return (f"({cells} cells in {took:.1f} s; {policy}, τ in {sorted({0, *args.staleness})}; {noise}; "
            f"network={args.network}, {args.units} units, {args.minibatches} minibatches per cell)")


def main(args: argparse.Namespace, comm: CommModel, t0: float) -> int:
    """``odcfn simulate --staleness``: this table instead of the policies' (as ``--quality``)."""
    try:
        rows = stale_sweep(
            args.datasets, args.devices, args.samples_per_device, args.staleness,
            straggler=args.straggler, slow_fraction=args.slow_fraction, slow_rank=args.slow_rank,
            minibatches=args.minibatches, units=args.units, comm=comm, max_tokens=args.max_tokens,
            seed=args.seed, permute=args.permute_ranks,
        )
    except ValueError as e:  # e.g. a --max-tokens below the longest sample
        print(f"odcfn simulate: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    print(format_stale_table(rows))
    cells = len({(r.dataset, r.devices, r.samples_per_device) for r in rows})
    print(describe(args, cells, time.perf_counter() - t0))
    return 0
