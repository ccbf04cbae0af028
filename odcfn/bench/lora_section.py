"""``odcfn bench --only lora``: LoRA (frozen base, adapters trained) vs full fine-tuning.

Same model, same minibatches, ODC + LB-Mini on the shared-memory transport, W processes. Each
mode runs in its own launched job (so each process's memory is its own): per-rank peak
memory (PSS from /proc/self/smaps_rollup, sampled every 2 ms, above the process's baseline
taken before the TrainState exists; plus an exact count of the bytes the state and transport
hold), the transport's bytes per step, samples/s, and a checkpoint's size and save time (the
median of ``SAVES`` saves; LoRA's reference the base's files, as ``odcfn train`` does, and the
first one hashes them). A third job runs one step of LoRA with a bf16 compute dtype (frozen base
stored in bf16 only), for memory. A fourth times ODC + LB-Mini LoRA against torch FSDP2 + PEFT
LoRA with LB-Micro (``odcfn.bench.lora_fsdp2``), alternating minibatches in one job.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

__all__ = ["LoraBenchSpec", "PeakSampler", "lora_worker", "pss", "section"]

SAVES = 3
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraBenchSpec:
    workload: object  # bench.workload.Workload
    mode: str  # "full" | "lora"
    compute_dtype: str | None = None  # "bfloat16": StepConfig(compute_dtype=torch.bfloat16)
    base: str | None = None  # the base's files, which LoRA checkpoints reference
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    steps: int = 3
    warmup: int = 1
    timeout: float = 300.0


def pss() -> int:
    """This process's proportional set size in bytes (shared pages split among their users)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler:
    def __init__(self, every: float = 0.002) -> None:
        self.peak, self.every, self._stop = pss(), every, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, pss())
            time.sleep(self.every)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, pss())


def _nbytes(tree) -> int:
    from odcfn.tree import tree_leaves

    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if hasattr(t, "numel"))


def lora_worker(spec: LoraBenchSpec, ckpt_root: str) -> dict:
    """One launched rank: build the state of ``spec.mode``, train, checkpoint; its figures."""
    import gc

    import torch

    import odcfn
    from odcfn.bench.workload import make_batch
    from odcfn.models import init_params, qwen_model
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    w = spec.workload
    mesh = odcfn.Mesh.from_env()
    model, full = qwen_model(w.model), init_params(w.model, seed=w.seed)
    if spec.mode == "lora":
        model, full = odcfn.lora.apply(model, full, rank=spec.rank, alpha=spec.alpha, targets=spec.targets)
    shards = odcfn.shard(full, model, mesh)
    del full
    gc.collect()
    with ShmTransport(mesh, timeout=spec.timeout) as tr:
        base = pss()
        sampler = PeakSampler()
        dtype = getattr(torch, spec.compute_dtype) if spec.compute_dtype else None
        state = odcfn.TrainState.create(
            params=shards,
            model=model,
            optimizer=odcfn.adamw(w.lr),
            transport=tr,
            config=odcfn.StepConfig(balance="lb_mini", max_tokens_per_microbatch=w.max_tokens_per_microbatch,
                                    compute_dtype=dtype),
        )
        del shards
        steps = []
        for step in range(spec.warmup + spec.steps):
            batch = make_batch(w, step)
            tr.collectives.barrier()
            t0 = time.perf_counter()
            state, m = odcfn.train_step(state, batch)
            wall = time.perf_counter() - t0
            if step >= spec.warmup:
                c = m.counters
                steps.append(
                    {
                        "wall": wall,
                        "loss": m.loss,
                        "samples": len(batch),
                        "scatter_bytes": c.scatter_bytes,
                        "gather_bytes": c.gather_bytes,
                        "scatters": c.scatters,
                        "gathers": c.gathers,
                        "syncs": c.syncs,
                    }
                )
        peak = sampler.stop()
        layout = odcfn.make_layout(model, mesh)
        acc = sum(4 * u.shard_size for u in layout.units if not u.frozen)
        held = {
            "params": _nbytes(state.params),
            "opt_state": _nbytes(state.opt_state),
            "published": sum(u.shard_size for u in layout.units) * (dtype or torch.float32).itemsize,
            "accumulators": acc,
        }
        base_dir = spec.base if spec.mode == "lora" else None
        save_s = []
        for i in range(SAVES):
            where = Path(ckpt_root) / f"{spec.mode}-{spec.compute_dtype}-{i}"
            tr.collectives.barrier()
            t0 = time.perf_counter()
            odcfn.save(where, state, base=base_dir)
            save_s.append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in where.rglob("*") if p.is_file()) if mesh.rank == 0 else 0
        tr.collectives.barrier()
    return {
        "rank": mesh.rank,
        "mode": spec.mode,
        "peak_pss_above_baseline": peak - base,
        "baseline_pss": base,
        "held_bytes": held,
        "steps": steps,
        "save_s": save_s,
        "checkpoint_bytes": size,
        "trained_params": sum(u.numel for u in layout.units if not u.frozen),
        "total_params": sum(u.numel for u in layout.units),
    }


def _summary(per_rank: list[dict]) -> dict:
    n = len(per_rank[0]["steps"])
    saves = [max(r["save_s"][i] for r in per_rank) for i in range(len(per_rank[0]["save_s"]))]
    walls = [max(r["steps"][i]["wall"] for r in per_rank) for i in range(n)]
    r0 = per_rank[0]
    return {
        "peak_pss_above_baseline_bytes": max(r["peak_pss_above_baseline"] for r in per_rank),
        "held_bytes_per_rank": max(sum(r["held_bytes"].values()) for r in per_rank),
        "held_breakdown_rank0": r0["held_bytes"],
        "scatter_bytes_per_step": sum(r["steps"][i]["scatter_bytes"] for r in per_rank for i in range(n)) / n,
        "gather_bytes_per_step": sum(r["steps"][i]["gather_bytes"] for r in per_rank for i in range(n)) / n,
        "scatters_per_step": sum(r["steps"][i]["scatters"] for r in per_rank for i in range(n)) / n,
        "gathers_per_step": sum(r["steps"][i]["gathers"] for r in per_rank for i in range(n)) / n,
        "syncs_per_step": max(s["syncs"] for r in per_rank for s in r["steps"]),
        "samples_per_s": sum(s["samples"] for s in r0["steps"]) / sum(walls),
        "step_time_s": walls,
        "losses": [s["loss"] for s in r0["steps"]],
        "checkpoint_bytes": r0["checkpoint_bytes"],
        "save_s": sorted(saves)[len(saves) // 2],
        "save_s_each": saves,
        "trained_params": r0["trained_params"],
        "total_params": r0["total_params"],
    }


def run(
    workload,
    *,
    steps: int = 3,
    warmup: int = 1,
    rank: int = 16,
    alpha: float = 32.0,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    log=print,
) -> dict:
    from odcfn.launch import launch

    out: dict = {
        "config": {"rank": rank, "alpha": alpha, "targets": list(targets), "model": vars(workload.model)}
    }
    root = tempfile.mkdtemp(prefix="odcfn-lora-bench-", dir=os.environ.get("TMPDIR"))
    try:
        from odcfn.models import init_params, to_hf

        base = os.path.join(root, "base")  # the base's files, as a run's [model] hf_path holds them
        to_hf(base, init_params(workload.model, seed=workload.seed), workload.model)
        jobs = (("full", "full", None), ("lora", "lora", None), ("lora_bf16", "lora", "bfloat16"))
        for key, mode, dtype in jobs:
            log(f"   {key}: {workload.world_size} processes, ODC + LB-Mini, {steps} steps")
            # bf16 matmuls are slow on CPUs without bf16 units (30-40 s a step here): that job is
            # for memory, one step is enough
            n, n_warm = (1, 0) if dtype else (steps, warmup)
            spec = LoraBenchSpec(workload, mode, compute_dtype=dtype, base=base, rank=rank, alpha=alpha,
                                 targets=targets, steps=n, warmup=n_warm)
            out[key] = _summary(launch(lora_worker, workload.world_size, args=(spec, root), timeout=300.0))
        out["vs_fsdp2"] = _vs_fsdp2(workload, rank, alpha, targets, steps, warmup, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    f, lo, lb = out["full"], out["lora"], out["lora_bf16"]

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    out["ratios"] = {
        "peak_memory_lora_over_full": ratio(
            lo["peak_pss_above_baseline_bytes"], f["peak_pss_above_baseline_bytes"]
        ),
        "held_bytes_lora_over_full": ratio(lo["held_bytes_per_rank"], f["held_bytes_per_rank"]),
        "held_bytes_lora_bf16_over_full": ratio(lb["held_bytes_per_rank"], f["held_bytes_per_rank"]),
        "peak_memory_lora_bf16_over_full": ratio(
            lb["peak_pss_above_baseline_bytes"], f["peak_pss_above_baseline_bytes"]
        ),
        "scatter_bytes_full_over_lora": ratio(f["scatter_bytes_per_step"], lo["scatter_bytes_per_step"]),
        "checkpoint_bytes_full_over_lora": ratio(f["checkpoint_bytes"], lo["checkpoint_bytes"]),
        "save_time_full_over_lora": ratio(f["save_s"], lo["save_s"]),
        "samples_per_s_lora_over_full": ratio(lo["samples_per_s"], f["samples_per_s"]),
    }
    return out


def _vs_fsdp2(workload, rank, alpha, targets, steps, warmup, log) -> dict:
    """ODC + LB-Mini LoRA against torch FSDP2 + PEFT LoRA (LB-Micro) in one job."""
    import importlib.util

    from odcfn.bench.fsdp2 import summarize
    from odcfn.bench.lora_fsdp2 import LoraFsdp2Spec, lora_fsdp2_worker
    from odcfn.launch import launch

    if importlib.util.find_spec("peft") is None:
        return {"skipped": "peft is not installed (pip install odcfn[dev])"}
    log(f"   vs torch FSDP2 + PEFT LoRA: {workload.world_size} processes, alternating minibatches")
    spec = LoraFsdp2Spec(workload, rank, alpha, tuple(targets), steps, warmup)
    recs = launch(lora_fsdp2_worker, workload.world_size, args=(spec,), timeout=300.0)
    out = {impl: summarize(recs, impl) for impl in ("odc", "fsdp2")}
    out["samples_per_s_odc_over_fsdp2"] = out["odc"]["samples_per_s"] / out["fsdp2"]["samples_per_s"]
    # the same function from the same start: the losses agree (fp32, other summation orders)
    pairs = zip(out["odc"]["losses"], out["fsdp2"]["losses"])
    out["losses_match"] = all(abs(a - b) <= 1e-4 * abs(b) for a, b in pairs)
    return out


def section(ctx, quick: bool = False) -> dict:
    """The bench section: a wider model than the other sections (d=512, so the base's bytes
    dominate the process), the same LongAlign-like minibatches."""
    from odcfn.bench.workload import model_config

    w = replace(ctx.workload, model=model_config(512 if not quick else 256, 4, 4096))
    return run(w, steps=ctx.steps, warmup=ctx.warmup, log=ctx.log)


def render(sec: dict | None) -> str:
    """The human-readable lines of the section ("" when it did not run)."""
    if not sec:
        return ""
    if "ratios" not in sec:
        return f"\n\n8. LoRA vs full fine-tuning: {sec.get('error') or sec.get('skipped')}"
    f, lo, lb, r = sec["full"], sec["lora"], sec["lora_bf16"], sec["ratios"]
    mib = 1 << 20
    rows = [
        ("trained params", f"{f['trained_params']:,}", f"{lo['trained_params']:,}", ""),
        (
            "peak PSS above baseline, MiB/rank",
            f"{f['peak_pss_above_baseline_bytes'] / mib:.1f}",
            f"{lo['peak_pss_above_baseline_bytes'] / mib:.1f}",
            f"{r['peak_memory_lora_over_full']:.2f}x",
        ),
        (
            "state+transport bytes, MiB/rank",
            f"{f['held_bytes_per_rank'] / mib:.1f}",
            f"{lo['held_bytes_per_rank'] / mib:.1f}",
            f"{r['held_bytes_lora_over_full']:.2f}x",
        ),
        (
            "scatter bytes/step (all ranks)",
            f"{f['scatter_bytes_per_step']:,.0f}",
            f"{lo['scatter_bytes_per_step']:,.0f}",
            f"1/{r['scatter_bytes_full_over_lora']:.0f}",
        ),
        (
            "gather bytes/step (all ranks)",
            f"{f['gather_bytes_per_step']:,.0f}",
            f"{lo['gather_bytes_per_step']:,.0f}",
            "",
        ),
        (
            "checkpoint bytes",
            f"{f['checkpoint_bytes']:,}",
            f"{lo['checkpoint_bytes']:,}",
            f"1/{r['checkpoint_bytes_full_over_lora']:.0f}",
        ),
        (
            f"checkpoint save s (median of {len(lo['save_s_each'])})",
            f"{f['save_s']:.3f}",
            f"{lo['save_s']:.3f}",
            f"1/{r['save_time_full_over_lora']:.1f}",
        ),
        ("first save s (LoRA: hashes the base)", f"{f['save_s_each'][0]:.3f}",
         f"{lo['save_s_each'][0]:.3f}", ""),
        (
            "LoRA, bf16 compute: peak PSS MiB/rank",
            f"{f['peak_pss_above_baseline_bytes'] / mib:.1f}",
            f"{lb['peak_pss_above_baseline_bytes'] / mib:.1f}",
            f"{r['peak_memory_lora_bf16_over_full']:.2f}x",
        ),
        (
            "LoRA, bf16 compute: state+transport MiB",
            f"{f['held_bytes_per_rank'] / mib:.1f}",
            f"{lb['held_bytes_per_rank'] / mib:.1f}",
            f"{r['held_bytes_lora_bf16_over_full']:.2f}x",
        ),
        (
            "samples/s (ODC + LB-Mini)",
            f"{f['samples_per_s']:.2f}",
            f"{lo['samples_per_s']:.2f}",
            f"{r['samples_per_s_lora_over_full']:.2f}x",
        ),
    ]
    v = sec.get("vs_fsdp2") or {}
    if "odc" in v:
        rows.append(("LoRA samples/s: FSDP2+PEFT | ODC", f"{v['fsdp2']['samples_per_s']:.2f}",
                     f"{v['odc']['samples_per_s']:.2f}", f"{v['samples_per_s_odc_over_fsdp2']:.2f}x"))
        rows.append(("  (same losses step by step)", "", "", "yes" if v["losses_match"] else "NO"))
    width = max(len(x[0]) for x in rows)
    lines = [
        f"\n\n8. LoRA r={sec['config']['rank']} on {', '.join(sec['config']['targets'])} vs full fine-tuning"
    ]
    lines += [
        f"   {a:<{width}}  {b:>14}  {c:>14}  {d:>8}" for a, b, c, d in [("", "full", "lora", "ratio"), *rows]
    ]
    return "\n".join(lines)
