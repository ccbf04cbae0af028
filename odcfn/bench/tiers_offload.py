"""The offload rows of ``odcfn bench --only tiers``: owner state in a file tier
(``StepConfig(offload=Offload(...))``) against the in-memory step.

Each point is a fresh process (``python -m odcfn.bench.tiers_offload POINT_JSON``), one rank,
one intra-op thread, ``MALLOC_ARENA_MAX=1`` (so the update's two I/O threads reserve no malloc
arenas of their own) and a fixed 1 MiB mmap threshold (freed blocks leave the process). After
two warm-up steps the process's peak RSS is reset (``clear_refs`` 5)
and its RSS taken as the baseline, which then holds everything resident between steps (the
published copies, the gradient accumulators, the in-memory run's master and moments); the peak
RSS over the timed steps (``VmHWM``) minus that baseline is what a step adds: activations and,
for offload, the update's buffers (at most the budget, prefetch window included).

Rows: (a) a size where both fit, fp32 params + AdamW state >= 4x the budget: step-time ratio
offload / in-memory (target <= 1.3x) and the peaks; (b) a larger size under a data-segment cap
(``RLIMIT_DATA``, which counts private memory, not the file mapping) that the in-memory run
exceeds: whether each fits, and offload's step time against (a)'s in-memory time per parameter.
The file tier sits in the page cache on this machine (nothing forces it to the disk), so the
ratio measures the streaming, not a disk's bandwidth.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from odcfn.rollout.vllm_worker import peak_rss_bytes, proc_status, reset_peak_rss

__all__ = ["point", "render", "section"]

GIB = 1 << 30


def point(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this process (``spec``: mode "memory"/"offload", d_model, n_layers, vocab,
    samples, length, steps, budget_gib, prefetch, path, cap_bytes)."""
    import resource

    if spec.get("cap_bytes"):  # private memory above what the interpreter holds now
        cap = proc_status("VmData") + spec["cap_bytes"]
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    import ctypes
    import gc
    import time

    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.tree import tree_leaves

    torch.set_num_threads(1)
    cfg = QwenConfig(
        vocab_size=spec["vocab"],
        d_model=spec["d_model"],
        n_layers=spec["n_layers"],
        n_heads=4,
        n_kv_heads=2,
        d_ff=3 * spec["d_model"],
    )
    model = qwen_model(cfg)
    off = None
    if spec["mode"] == "offload":
        off = odcfn.Offload(path=spec["path"], budget_gib=spec["budget_gib"], prefetch=spec["prefetch"])
    g = torch.Generator().manual_seed(0)
    batch = odcfn.Batch(
        tuple(
            odcfn.Sample(torch.randint(0, cfg.vocab_size, (spec["length"],), generator=g))
            for _ in range(spec["samples"])
        )
    )
    try:
        full = init_params(cfg, seed=0)
        n_params = sum(v.numel() for v in tree_leaves(full))
        shards = odcfn.shard(full, model, odcfn.Mesh(1, 0))
        del full  # creation then holds the shards and what the state makes of them
        state = odcfn.TrainState.create(
            params=shards,
            model=model,
            optimizer=odcfn.adamw(1e-4),
            transport=odcfn.LocalWorld(1).transport(0),
            config=odcfn.StepConfig(balance="round_robin", offload=off, donate=off is None),
        )
        del shards
        gc.collect()
        for _ in range(2):  # warm-up: the transport's buffers exist now
            state, _ = odcfn.train_step(state, batch)
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        if not reset_peak_rss():  # VmHWM := VmRSS
            raise OSError("cannot reset the peak RSS (/proc/self/clear_refs)")
        base, _ = peak_rss_bytes()
        times = []
        for _ in range(spec["steps"]):
            t0 = time.perf_counter()
            state, _ = odcfn.train_step(state, batch)
            times.append(time.perf_counter() - t0)
        _, peak = peak_rss_bytes()
    except MemoryError as e:
        return {"fits": False, "error": f"MemoryError: {e}"[:200]}
    return {
        "fits": True,
        "n_params": n_params,
        "state_bytes": 12 * n_params,
        "step_s": times,
        "median_step_s": statistics.median(times),
        "baseline_rss": base,
        "peak_rss": peak,
        "step_adds": peak - base,
    }


def _spawn(spec: dict[str, Any], timeout: float = 900.0) -> dict[str, Any]:
    # a fixed mmap threshold: every block >= 1 MiB is its own mapping, returned when freed, so the
    # RSS and the data-segment cap see live memory, not a heap that kept freed blocks
    env = dict(os.environ, MALLOC_ARENA_MAX="1", MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-m", "odcfn.bench.tiers_offload", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        killed = r.returncode < 0 or "MemoryError" in r.stderr or "Cannot allocate" in r.stderr
        return (
            {"fits": False, "error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
            if killed
            else {"error": r.stderr[-400:]}
        )
    return json.loads(lines[-1])


def section(ctx: Any, quick: bool = False) -> dict[str, Any]:
    """The offload rows (``ctx.log`` for progress)."""
    log = getattr(ctx, "log", print)
    both = {
        "d_model": 256 if quick else 384,
        "n_layers": 4 if quick else 8,
        "vocab": 2048,
        "samples": 4,
        "length": 128,
        "steps": 2 if quick else 4,
        "prefetch": 1,
    }
    big = dict(both, d_model=512 if quick else 768)
    out: dict[str, Any] = {
        "notes": [
            "one rank, one thread, fp32; peaks: VmHWM after two warm-up steps, above the RSS between steps",
            "the file tier is in the page cache here: the ratio measures streaming, not disk bandwidth",
        ]
    }
    with tempfile.TemporaryDirectory(prefix="odcfn-tiers-") as tier:
        rows = {}
        for name, shape in (("both_fit", both), ("only_offload", big)):
            d = shape["d_model"]  # a unit's fp32 master + AdamW moments: 12 B/param; a layer ~12 d^2
            unit = 12 * max(12 * d * d + 8 * d, shape["vocab"] * d)
            budget = (1 + shape["prefetch"]) * unit * 1.05 / GIB  # one unit + the window, 5% slack
            row: dict[str, Any] = {"budget_gib": budget, "shape": shape}
            cap = None
            if name == "only_offload":  # between what offload needs and what in-memory needs
                n = rows["both_fit"]["memory"].get("n_params", 1) * (shape["d_model"] / both["d_model"]) ** 2
                # offload holds 12 B/param (published copy, the transport's copy, the gradient) plus
                # its budget; in-memory holds 20 (master, moments, the transport's copy, gradient)
                cap = int(n * 12 + budget * GIB + 160 * 2**20)
                row["cap_bytes"] = cap
            for mode in ("memory", "offload"):
                log(f"   offload {name}: {mode}")
                row[mode] = _spawn(
                    {**shape, "mode": mode, "budget_gib": budget, "path": tier, "cap_bytes": cap}
                )
            m, o = row["memory"], row["offload"]
            row["state_over_budget"] = o.get("state_bytes", 0) / (budget * GIB)
            if m.get("median_step_s") and o.get("median_step_s"):
                row["step_time_ratio"] = o["median_step_s"] / m["median_step_s"]
            if o.get("step_adds") is not None and m.get("step_adds") is not None:
                row["offload_step_adds_minus_budget_and_activations"] = (
                    o["step_adds"] - budget * GIB - m["step_adds"]
                )
            rows[name] = row
        out.update(rows)
    a, b = out["both_fit"], out["only_offload"]
    if b["offload"].get("median_step_s") and a["memory"].get("median_step_s"):
        per = a["memory"]["median_step_s"] / a["memory"]["n_params"] * b["offload"]["n_params"]
        b["ratio_vs_in_memory_scaled_by_params"] = b["offload"]["median_step_s"] / per
    return out


def render(report: dict | None) -> str:
    if not report or "both_fit" not in report:
        return ""
    lines = ["", "offload (owner state in a file tier, 1 rank, fp32):"]
    for name, row in (("both fit", report["both_fit"]), ("only offload fits", report["only_offload"])):
        m, o = row["memory"], row["offload"]
        lines.append(
            f"  {name}: state {o.get('state_bytes', 0) / 2**20:.0f} MiB = {row['state_over_budget']:.1f}x "
            f"budget {row['budget_gib'] * 1024:.0f} MiB; in-memory "
            + (
                f"{m['median_step_s']:.2f} s/step, step adds {m['step_adds'] / 2**20:.0f} MiB"
                if m.get("fits")
                else f"does not fit ({m.get('error', '')[:60]})"
            )
            + "; offload "
            + (
                f"{o['median_step_s']:.2f} s/step, step adds {o['step_adds'] / 2**20:.0f} MiB"
                if o.get("fits")
                else f"failed ({o.get('error', '')[:60]})"
            )
            + (f"; ratio {row['step_time_ratio']:.2f}x" if "step_time_ratio" in row else "")
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(json.dumps(point(json.loads(sys.argv[1]))))
