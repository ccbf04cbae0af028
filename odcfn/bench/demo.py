"""``odcfn demo``: collective FSDP vs ODC on 2 local ranks, side by side on the same data.

Trains a small Qwen-style model on synthetic long-tail SFT minibatches (LongAlign-like lengths,
scaled down), alternating minibatches between Collective+LB-Micro, ODC+LB-Mini and
ODC+work-stealing, each policy with its own copy of the same initial parameters. Prints
throughput, the bubble rate measured from the runtime's traces, and the ratios; checks that the
three runs' losses match; writes a Chrome trace and a timeline PNG of the last minibatch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from odcfn.schedule.policy import HEADLINE

BASELINE = "collective+lb-micro"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--samples-per-rank", type=int, default=4, help="minibatch = W x this")
    p.add_argument("--steps", type=int, default=10,
                   help="optimizer steps (minibatches) timed per policy (default 10)")
    p.add_argument("--warmup", type=int, default=1, help="untimed minibatches per policy first")
    p.add_argument("--length-scale", type=int, default=32,
                   help="divide LongAlign lengths (8K-64K) by this (default 32: 256-2048 tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=128, help="model width (4 heads, 2 KV heads)")
    p.add_argument("--n-layers", type=int, default=4, help="decoder layers")
    p.add_argument("--backend", choices=("auto", "process", "thread"), default="auto",
                   help="process: odcfn.launch + shared memory; thread: in-process reference")
    p.add_argument("--out-dir", type=Path, default=Path("odcfn-out/demo"),
                   help="where the Chrome trace and timeline PNG go")
    p.add_argument("--cost", choices=("calibrated", "default"), default="calibrated",
                   help="balancers' cost model: fitted to this machine's measured unit times "
                        "(default) or the schedule layer's FLOPs-based default")
    p.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    from odcfn.bench.report import (
        losses_match,
        policy_summary,
        ratio,
        shared_cores_warning,
        table,
        write_chrome_trace,
        write_timeline_png,
    )
    from odcfn.bench.runner import RunSpec, pick_backend, run
    from odcfn.bench.workload import Workload, make_lengths, model_config

    w = Workload(model=model_config(args.d_model, args.n_layers), world_size=args.world_size,
                 samples_per_rank=args.samples_per_rank,
                 length_scale=args.length_scale, seed=args.seed)
    backend = pick_backend(args.backend)
    lengths = make_lengths(w, 0)
    print(f"odcfn demo: {w.world_size} ranks ({backend} backend), Qwen-style model "
          f"d={w.model.d_model} x {w.model.n_layers} layers "
          f"({w.model.num_params / 1e6:.2f}M params), "
          f"{w.samples_per_step} samples per minibatch ({w.samples_per_rank} per rank), "
          f"{args.warmup}+{args.steps} minibatches per policy")
    print(f"  data: LongAlign-like lengths / {w.length_scale}, e.g. minibatch 0 = {list(lengths)}; "
          f"microbatch cap {w.max_tokens_per_microbatch} tokens")
    if backend == "thread":
        print("  note: ranks are threads of one process (in-process reference transport)")
    cost = None
    if args.cost == "calibrated":
        from odcfn.bench.sim import calibrate_cost

        try:
            cost, _, calib = calibrate_cost(w)
        except Exception as e:  # an optional refinement: the balancers have their own default
            print(f"  cost-model calibration failed ({type(e).__name__}: {e}); "
                  "balancers use the schedule layer's default cost model")
        else:
            print(f"  balancers' cost model, calibrated on this machine: {cost.a:.3g} s x len^2 "
                  f"+ {cost.b:.3g} s x len (fitted at lengths {calib['lengths']})")
    spec = RunSpec(w, HEADLINE, steps=args.steps, warmup=args.warmup,
                   progress=not args.no_progress, cost=cost)
    per_rank = run(spec, backend)

    sums = [policy_summary(per_rank, p) for p in HEADLINE]
    base = sums[0]["samples_per_s"]
    rows = [
        [s["policy"], s["samples_per_s"],
         s["tokens_per_s"], s["bubble_rate"], ratio(s["samples_per_s"], base),
         "/".join(str(n) for n in s["microbatches_per_rank"][-1]), s["syncs_per_minibatch"]]
        for s in sums
    ]
    print()
    print(table(rows, ["policy", "samples/s", "tokens/s", "bubble", f"x {BASELINE}",
                       "microbatches/rank", "syncs/mb"]))
    warn = shared_cores_warning(sums)
    if warn:
        print("  " + warn)
    ok, worst = losses_match(sums)
    print(f"\nlosses match across the three runs: {'yes' if ok else 'NO'} "
          f"(max relative difference {worst:.1e}); losses: "
          + ", ".join(f"{x:.4f}" for x in sums[0]["losses"]))

    last = args.warmup + args.steps - 1
    trace = write_chrome_trace(args.out_dir / "demo_trace.json", per_rank, HEADLINE, last)
    print(f"Chrome trace of minibatch {last} (open in https://ui.perfetto.dev): {trace}")
    try:
        png = write_timeline_png(args.out_dir / "demo_timeline.png", per_rank, HEADLINE, last)
    except Exception as e:  # a broken plotting install must not cost the user the results
        png, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "matplotlib is not installed (pip install 'odcfn[plot]')"
    print(f"timeline PNG: {png}" if png else f"timeline PNG skipped: {why}")
    return 0 if ok else 1
