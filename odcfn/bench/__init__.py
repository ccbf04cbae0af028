"""``odcfn bench``: ODC vs collective FSDP vs torch FSDP2, primitives, simulator, straggler.

Every comparison runs its contenders side by side in one job, minibatch by minibatch on the same
data, so background load on the machine falls on all of them alike. ``--json`` prints one JSON
object whose keys are documented in docs/benchmarks.md (schema ``odcfn.bench/1``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

SCHEMA = "odcfn.bench/1"
SECTIONS = (
    "end_to_end", "balanced", "fsdp2", "primitives", "simulator", "straggler", "rl", "lora", "recovery",
    "moe", "preference", "staleness", "rl-loop", "tiers",
)
STRAGGLER_SLOWDOWN = 1.5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--quick", action="store_true", help="reduced version (< 3 minutes on 2 cores)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=None, help="run these sections")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--samples-per-rank", type=int, nargs="+", default=None,
                   help="minibatch sizes for end_to_end (default 2 4 8; --quick: 4)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (minibatches) timed per policy (default 6; --quick: 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--length-scale", type=int, default=None,
                   help="divide LongAlign lengths by this (default 32; --quick: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=128, help="model width (4 heads, 2 KV heads)")
    p.add_argument("--n-layers", type=int, default=4, help="decoder layers")
    p.add_argument("--backend", choices=("auto", "process", "thread"), default="auto")
    p.add_argument("--sizes-mib", type=int, nargs="+", default=None,
                   help="primitive sizes (default 1 4 16 64; --quick: 1 16)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--memory", action="store_true",
                   help="instead of the sections: peak step memory vs tokens at V=151,936 (fused head, "
                        "unfused head, transformers' Qwen2); each point a fresh process")
    p.add_argument("--memory-tokens", type=int, nargs="+", default=None,
                   help="--memory: tokens per point (default 1K..32K; --quick: 1K 4K 16K)")
    p.add_argument("--memory-budget-gib", type=float, default=16.0,
                   help="--memory: what one step may add (each child's address-space cap)")
    p.add_argument("--memory-grpo-tokens", type=int, nargs="*", default=None,
                   help="--memory: tokens of the GRPO points (default: --memory-tokens)")
    p.add_argument("--memory-contenders", nargs="+", choices=("fused", "unfused", "transformers"),
                   default=None, help="--memory: run only these (default: all three)")
    p.add_argument("--memory-threads", type=int, default=1,
                   help="--memory: torch intra-op threads of each point's process")
    p.add_argument("--memory-d-model", type=int, default=256,
                   help="--memory: the model's width (2 layers, 4 heads, SwiGLU 2x; Qwen3-0.6B: 1024)")
    p.add_argument("--memory-tied", action="store_true",
                   help="--memory: the head reads the embedding matrix (tied, as Qwen3-0.6B)")
    p.add_argument("--memory-timeout-s", type=float, default=900.0,
                   help="--memory: seconds one point may run before it is recorded as a timeout")
    p.add_argument("--plot", type=Path, default=None, help="--memory: write the PNG plot here")
    p.add_argument("--moe-shape", choices=("full", "quick", "tiny"), default=None,
                   help="moe: the toy's size (default full; --quick: quick; tiny: the tests')")
    p.add_argument("--cost", choices=("calibrated", "default"), default="calibrated",
                   help="balancers' cost model: fitted to this machine's measured unit times "
                        "(default) or the schedule layer's FLOPs-based default")


def _log(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


def machine() -> dict:
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def main(args: argparse.Namespace) -> int:
    if args.memory:
        return memory_main(args)
    from odcfn.bench import lora_section as LS
    from odcfn.bench import moe_section as MS
    from odcfn.bench import preference_section as PS
    from odcfn.bench import recovery, summary
    from odcfn.bench import rl_loop as RLL
    from odcfn.bench import rl_section as RL
    from odcfn.bench import sections as S
    from odcfn.bench import staleness_section as SS
    from odcfn.bench import tiers as TI
    from odcfn.bench import tiers_hpz as TH
    from odcfn.bench import tiers_offload as TO
    from odcfn.bench.runner import pick_backend
    from odcfn.bench.workload import Workload, model_config

    t_start = time.perf_counter()
    sections = tuple(args.only or SECTIONS)
    backend = pick_backend(args.backend)
    spr = tuple(args.samples_per_rank or ((4,) if args.quick else (2, 4, 8)))
    steps = args.steps or (2 if args.quick else 6)
    sizes = tuple(args.sizes_mib or ((1, 16) if args.quick else (1, 4, 16, 64)))
    w = Workload(model=model_config(args.d_model, args.n_layers), world_size=args.world_size,
                 samples_per_rank=4 if 4 in spr else spr[0],
                 length_scale=args.length_scale or (64 if args.quick else 32), seed=args.seed)
    ctx = S.Context(workload=w, backend=backend, steps=steps, warmup=args.warmup,
                    progress=not args.json or sys.stderr.isatty(), log=_log)
    if args.cost == "calibrated" and ({"end_to_end", "balanced", "fsdp2", "straggler",
                                       "simulator", "rl", "preference", "staleness"} & set(sections)):
        from odcfn.bench.sim import calibrate_cost

        _log("== calibrating the cost model (forward+backward time of each unit vs length)")
        try:
            ctx.calibration = calibrate_cost(w)
        except Exception as e:  # the balancers fall back to the schedule layer's default
            _log(f"   calibration failed ({type(e).__name__}: {e}); using the default cost model")
    report: dict = {
        "schema": SCHEMA,
        "machine": machine(),
        "config": {"quick": args.quick, "backend": backend, "world_size": w.world_size,
                   "samples_per_rank": list(spr), "headline_samples_per_rank": w.samples_per_rank,
                   "steps": steps, "warmup": args.warmup, "length_scale": w.length_scale,
                   "seed": w.seed, "model": vars(w.model) | {"num_params": w.model.num_params},
                   "max_tokens_per_microbatch": w.max_tokens_per_microbatch,
                   "straggler_slowdown": STRAGGLER_SLOWDOWN, "sections": list(sections),
                   "cost_model": ctx.calibration[2] if ctx.calibration else "schedule default"},
        "ratios": {},
        "syncs_per_minibatch": {},
        "losses_match": None,
        "notes": [
            "all timings: contenders interleaved minibatch by minibatch in one job; step wall "
            "time = slowest rank, optimizer update included",
        ],
    }
    if backend == "thread":
        report["notes"].append("ranks ran as threads of one process (--backend thread): "
                               "not a multi-process measurement; both collective baselines ran "
                               "on the in-process transport")
    runners = {
        "end_to_end": lambda: S.end_to_end(ctx, spr),
        "balanced": lambda: S.balanced(ctx),
        "fsdp2": lambda: S.fsdp2(ctx),
        "primitives": lambda: S.primitives(ctx, sizes),
        "straggler": lambda: S.straggler(ctx, STRAGGLER_SLOWDOWN),
        "simulator": lambda: S.simulator(ctx, report),
        "rl": lambda: RL.section(ctx, (8,) if args.quick else (8, 64, 1024)),
        "lora": lambda: LS.section(ctx, args.quick),
        "recovery": lambda: recovery.section(ctx),
        "moe": lambda: MS.section(ctx, args.quick, args.moe_shape),
        "preference": lambda: PS.section(ctx, 2 if args.quick else 3, (8,) if args.quick else (8, 64, 1024)),
        "staleness": lambda: SS.section(ctx, args.quick),
        "rl-loop": lambda: RLL.section(ctx, args.quick),
        "tiers": lambda: TI.section(ctx, args.quick),
    }
    # the simulator replays end_to_end's plans, so it runs after it
    for name in sorted(sections, key=lambda s: s == "simulator"):
        _log(f"== {name}")
        try:
            report[name] = runners[name]()
        except Exception as e:  # one crashed section must not cost the other sections
            report[name] = {"error": f"{type(e).__name__}: {e}"}
            _log(f"   {name} failed: {type(e).__name__}: {e}")
    summary.fill_ratios(report)
    report["elapsed_s"] = time.perf_counter() - t_start
    text = json.dumps(report, indent=1, default=_jsonable)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.json:
        print(text)
    else:
        print(summary.render(report) + LS.render(report.get("lora")) + MS.render(report.get("moe"))
              + PS.render(report.get("preference")) + SS.render(report.get("staleness"))
              + RLL.render(report.get("rl-loop")) + TO.render((report.get("tiers") or {}).get("offload"))
              + TH.render((report.get("tiers") or {}).get("hpz")))
    # a section that crashed (not one skipped for want of processes) fails the command
    return 1 if any(isinstance(report.get(n), dict) and "error" in report[n] for n in sections) else 0


def memory_main(args: argparse.Namespace) -> int:
    from odcfn.bench import memory as M

    if args.memory_budget_gib <= 0:
        raise ValueError(f"--memory-budget-gib must be > 0, got {args.memory_budget_gib}")
    if args.memory_tokens and min(args.memory_tokens) < 2:
        raise ValueError(f"--memory-tokens must be >= 2, got {args.memory_tokens}")
    if args.memory_threads < 1:
        raise ValueError(f"--memory-threads must be >= 1, got {args.memory_threads}")
    if args.memory_timeout_s <= 0:
        raise ValueError(f"--memory-timeout-s must be > 0, got {args.memory_timeout_s}")
    if args.memory_d_model < 4 or args.memory_d_model % 4:  # 4 heads of equal width
        raise ValueError(f"--memory-d-model must be a multiple of 4, >= 4, got {args.memory_d_model}")
    shape = M.shape({"d_model": args.memory_d_model, "tied": args.memory_tied})
    tokens = tuple(args.memory_tokens or ((1024, 4096, 16384) if args.quick else
                                          (1024, 2048, 4096, 8192, 16384, 32768)))
    t0 = time.perf_counter()
    _log(f"== memory: tokens {list(tokens)}")
    report = {"schema": SCHEMA, "machine": machine(), "config": {"tokens": list(tokens), "shape": shape},
              "memory": M.memory_bench(
                  tokens, budget=int(args.memory_budget_gib * M.GIB), log=_log,
                  grpo_tokens=None if args.memory_grpo_tokens is None else tuple(args.memory_grpo_tokens),
                  threads=args.memory_threads, d_model=args.memory_d_model, tied=args.memory_tied,
                  point_timeout=args.memory_timeout_s,
                  contenders=tuple(args.memory_contenders or M.CONTENDERS))}
    report["elapsed_s"] = time.perf_counter() - t0
    text = json.dumps(report, indent=1, default=_jsonable)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.plot:
        M.plot(report["memory"], str(args.plot))
    print(text if args.json else M.render(report["memory"]))
    return 1 if any(p["status"] == "error" for p in report["memory"]["points"]) else 0


def _jsonable(x):
    if isinstance(x, float):
        return x
    return str(x)
