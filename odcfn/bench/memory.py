"""``odcfn bench --memory``: peak step memory vs tokens at a real vocabulary.

One training step (one rank, one sample of T tokens, a D=256, 2-layer Qwen-shaped model, every
unit rematerialised, AdamW) per point, each point in a fresh subprocess, for:

- ``fused``: odcfn with the fused head (never a T×V tensor), ``StepConfig(donate=True)`` as
  ``odcfn train`` runs (the update writes into the state's tensors),
- ``unfused``: odcfn with the reference head (full fp32 logits, ``head="unfused"``),
- ``transformers``: ``transformers.Qwen2ForCausalLM`` of the same shape with its own loss
  (``labels=``), SDPA attention, gradient checkpointing, ``torch.optim.AdamW``: what a user of
  plain torch (or FSDP2 at one rank, which shards nothing) runs.

A point's figure is the child's peak resident memory during the step minus its resident memory
just before it: what every step of a run adds. Parameters and optimizer state are built by
then: a warm-up step of 16 tokens makes transformers' lazy AdamW state and gradients, and
odcfn's moments, accumulators and published copies, exist before the measured step. The
child's whole resident peak (``rss_peak_bytes``: the model, its state and the step) is
recorded too. The head's share is a contender's
figure at V=151,936 minus at V=4,096, same T. Each child caps its own address space
(``RLIMIT_AS``) at its size before the step plus the budget, so a point that does not fit fails
its allocation and is recorded as ``oom`` instead of taking the machine down; points above a
contender's first ``oom`` are ``skipped``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["BIG_V", "SMALL_V", "child", "memory_bench", "render", "run_point"]

BIG_V = 151_936  # Qwen2.5 / Qwen3
SMALL_V = 4_096
GIB = 1 << 30
CONTENDERS = ("fused", "unfused", "transformers")
SHAPE = {"d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 512}


def shape(spec: dict) -> dict:
    """The model of a point: ``SHAPE`` at the spec's width (``d_model``; SwiGLU 2·d_model) and
    tying (``tied``: the head reads the embedding matrix, as Qwen3-0.6B's)."""
    d = int(spec.get("d_model", SHAPE["d_model"]))
    return {**SHAPE, "d_model": d, "d_ff": 2 * d, "tie_embeddings": bool(spec.get("tied", False))}


# --- the child: one step, its peak --------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Resident-set high water mark over a block: a 2 ms sampler thread, and ``ru_maxrss`` when
    the block raised the process's all-time peak (exact then)."""

    def __enter__(self) -> PeakRSS:
        self.base, self.peak, self._stop = _rss(), _rss(), False
        self._max0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._t = threading.Thread(target=self._sample, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._t.join()
        self.peak = max(self.peak, _rss())
        max1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if max1 > self._max0:
            self.peak = max(self.peak, max1)


def _odcfn_step(spec: dict) -> tuple[Any, Any]:
    import torch

    import odcfn
    from odcfn.losses import cross_entropy, policy_gradient
    from odcfn.models import QwenConfig, init_params, qwen_model

    T, V = spec["T"], spec["V"]
    cfg = QwenConfig(vocab_size=V, **shape(spec))
    model, params = qwen_model(cfg), init_params(cfg)
    head = {"head": spec["contender"]}
    if spec["loss"] == "ce":
        loss = cross_entropy(**head)
    else:  # GRPO (odcfn.bench.rl's recipe) plus an entropy bonus; the prompt is the first 1/8
        loss = policy_gradient(kl_loss_coef=0.001, kl_loss_type="low_var_kl", entropy_coeff=0.001, **head)

    def batch_of(n: int) -> odcfn.Batch:
        g = torch.Generator().manual_seed(n)
        tokens = torch.randint(0, V, (n,), generator=g)
        if spec["loss"] == "ce":
            return odcfn.Batch((odcfn.Sample(tokens),))
        base = -torch.log(torch.tensor(float(V)))
        extras = {"advantages": torch.randn(n, generator=g).sign(),
                  "old_logprobs": base + 0.05 * torch.randn(n, generator=g),
                  "ref_logprobs": base + 0.05 * torch.randn(n, generator=g)}
        return odcfn.Batch((odcfn.Sample(tokens, loss_mask=torch.arange(n) >= n // 8, extras=extras),))

    # donate: the params and moments are updated in place, as ``odcfn train`` runs
    config = odcfn.StepConfig(balance="round_robin", remat=True, loss=loss, donate=True)
    world = odcfn.LocalWorld(1)
    state = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.adamw(1e-4),
                                    transport=world.transport(0), config=config)
    holder = {"state": state}
    batch = batch_of(T)

    def step(b: odcfn.Batch = batch) -> None:
        holder["state"], _ = odcfn.train_step(holder["state"], b)

    # as for transformers below: what persists across steps (optimizer moments, the transport's
    # accumulators and published copies) exists before the measured step
    step(batch_of(16))
    return step, holder


def _transformers_step(spec: dict) -> tuple[Any, Any]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    T, V = spec["T"], spec["V"]
    sh = shape(spec)
    cfg = Qwen2Config(vocab_size=V, hidden_size=sh["d_model"], intermediate_size=sh["d_ff"],
                      num_hidden_layers=sh["n_layers"], num_attention_heads=sh["n_heads"],
                      num_key_value_heads=sh["n_kv_heads"], max_position_embeddings=max(T, 32),
                      tie_word_embeddings=sh["tie_embeddings"], use_cache=False)
    cfg._attn_implementation = "sdpa"
    model = Qwen2ForCausalLM(cfg)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def run(n: int) -> None:
        ids = torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(n))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop

    run(16)  # AdamW's state and the gradients exist before the measured step
    return (lambda: run(T)), None


def child(spec: dict) -> dict:
    """Run one point in this process (``python -m odcfn.bench.memory '<spec json>'``)."""
    import torch

    torch.set_num_threads(spec.get("threads", 1))
    make = _transformers_step if spec["contender"] == "transformers" else _odcfn_step
    step, _keep = make(spec)
    import gc

    gc.collect()
    # the cap: this process's size now plus the budget; a step that needs more fails to allocate
    cap = _vm_size() + int(spec["budget"])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    out = {**spec, "status": "ok"}
    times = []
    try:
        for _ in range(spec.get("steps", 1)):
            with PeakRSS() as p:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            out["peak_bytes"] = max(out.get("peak_bytes", 0), p.peak - p.base)
            out["rss_peak_bytes"] = max(out.get("rss_peak_bytes", 0), p.peak)
    except (MemoryError, RuntimeError) as e:
        if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
            raise
        out["status"], out["error"] = "oom", str(e).splitlines()[0][:200]
    out["step_s"] = times[-1] if times else None
    return out


# --- the parent: points in fresh processes ------------------------------------------------------


def run_point(spec: dict, timeout: float = 900.0) -> dict:
    """One point in a fresh subprocess; its JSON line, or a record of how it failed."""
    cmd = [sys.executable, "-m", "odcfn.bench.memory", json.dumps(spec)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "timeout"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode == 0 and lines:
        return json.loads(lines[-1])
    # killed by the kernel (or an allocation failure torch did not turn into an exception)
    tail = p.stderr.strip().splitlines()[-1:] or [f"exit {p.returncode}"]
    oomish = p.returncode < 0 or "alloc" in p.stderr.lower() or "memory" in p.stderr.lower()
    return {**spec, "status": "oom" if oomish else "error", "error": tail[0][:200]}


def _available() -> int:
    with open("/proc/meminfo") as f:
        info = {ln.split(":")[0]: int(ln.split()[1]) * 1024 for ln in f}
    return info.get("MemAvailable", 0)


def memory_bench(
    tokens: tuple[int, ...],
    *,
    budget: int = 16 * GIB,
    speed_tokens: tuple[int, ...] = (2048, 8192),
    grpo_tokens: tuple[int, ...] | None = None,
    contenders: tuple[str, ...] = CONTENDERS,
    threads: int = 1,
    d_model: int = SHAPE["d_model"],
    tied: bool = False,
    point_timeout: float = 900.0,
    log: Any = print,
) -> dict:
    """The benchmark's report (JSON-able). ``budget``: bytes a step may add; never more than
    the machine's available memory less 2 GiB. ``d_model``/``tied``: the model (``shape``)."""
    budget = int(min(budget, max(1 * GIB, _available() - 2 * GIB)))
    # a second (timed) step only where there is a fused and an unfused step to compare
    if not {"fused", "unfused"} <= set(contenders):
        speed_tokens = ()
    points: list[dict] = []

    def point(contender: str, loss: str, V: int, T: int, failed: set) -> None:
        spec = {"contender": contender, "loss": loss, "V": V, "T": T, "budget": budget,
                "threads": threads, "d_model": d_model, "tied": tied,
                "steps": 2 if T in speed_tokens and V == BIG_V and loss == "ce"
                and contender != "transformers" else 1}
        if (contender, loss, V) in failed:  # a larger T of a series that already did not fit
            r = {**spec, "status": "skipped"}
        else:
            t0 = time.perf_counter()
            r = run_point(spec, timeout=point_timeout)
            r["wall_s"] = time.perf_counter() - t0
            if r["status"] != "ok":
                failed.add((contender, loss, V))
        points.append(r)
        peak = f"{r['peak_bytes'] / GIB:6.2f} GiB" if r.get("peak_bytes") is not None else r["status"]
        log(f"   {contender:12s} {loss:4s} V={V:6d} T={T:6d}: {peak}"
            + (f"  step {r['step_s']:.1f}s" if r.get("step_s") else ""))

    gt = grpo_tokens if grpo_tokens is not None else tokens
    series = [(c, "ce", V, T) for c in contenders for V in (BIG_V, SMALL_V) for T in tokens]
    series += [(c, "grpo", V, T) for c in contenders if c != "transformers"  # it has no GRPO loss
               for V in (BIG_V, SMALL_V) for T in gt]
    failed: set = set()
    for spec in sorted(series, key=lambda s: s[3]):  # small T first: the long points come last
        point(*spec, failed)
    return summarise(points, budget)


def summarise(points: list[dict], budget: int) -> dict:
    def peak(c: str, loss: str, V: int, T: int) -> float | None:
        for p in points:
            if (p["contender"], p["loss"], p["V"], p["T"]) == (c, loss, V, T) and p["status"] == "ok":
                return p["peak_bytes"]
        return None

    keys = sorted({(p["contender"], p["loss"]) for p in points})
    tokens = sorted({p["T"] for p in points})
    share = {f"{c}/{loss}": {T: (None if peak(c, loss, BIG_V, T) is None or peak(c, loss, SMALL_V, T) is None
                                 else peak(c, loss, BIG_V, T) - peak(c, loss, SMALL_V, T)) for T in tokens}
             for c, loss in keys}
    largest = {f"{c}/{loss}": max((p["T"] for p in points if (p["contender"], p["loss"], p["V"]) ==
                                   (c, loss, BIG_V) and p["status"] == "ok"), default=None)
               for c, loss in keys}
    speed = {}
    for T in tokens:
        f, u = (next((p.get("step_s") for p in points if (p["contender"], p["loss"], p["V"], p["T"]) ==
                      (c, "ce", BIG_V, T) and p["status"] == "ok" and p.get("steps", 1) > 1), None)
                for c in ("fused", "unfused"))
        if f and u:
            speed[T] = {"fused_s": f, "unfused_s": u, "fused_vs_unfused_throughput": u / f}
    return {"budget_bytes": budget, "points": points, "head_share_bytes": share,
            "largest_tokens_in_budget": largest, "speed": speed}


def render(report: dict) -> str:
    out = [f"peak step memory above the process (GiB), budget {report['budget_bytes'] / GIB:.1f} GiB"]
    rows: dict = {}
    for p in report["points"]:
        v = f"{p['peak_bytes'] / GIB:.2f}" if p["status"] == "ok" else p["status"]
        rows.setdefault((p["contender"], p["loss"], p["V"]), {})[p["T"]] = v
    tokens = sorted({p["T"] for p in report["points"]})
    out.append(f"{'contender':24s}" + "".join(f"{T:>9d}" for T in tokens))
    for (c, loss, V), r in sorted(rows.items()):
        out.append(f"{c + '/' + loss + ' V=' + str(V):24s}" + "".join(f"{r.get(T, '-'):>9s}" for T in tokens))
    out.append("head's share (V=151,936 minus V=4,096), GiB")
    for k, r in report["head_share_bytes"].items():
        cells = ("-" if r.get(T) is None else f"{r[T] / GIB:.2f}" for T in tokens)
        out.append(f"{k:24s}" + "".join(f"{c:>9s}" for c in cells))
    out.append(f"largest T in budget: {report['largest_tokens_in_budget']}")
    for T, s in report["speed"].items():
        out.append(f"T={T}: fused step {s['fused_s']:.1f}s, unfused {s['unfused_s']:.1f}s: "
                   f"fused throughput {s['fused_vs_unfused_throughput']:.2f}x unfused's")
    return "\n".join(out)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for c, loss in sorted({(p["contender"], p["loss"]) for p in report["points"]}):
        pts = [p for p in report["points"] if (p["contender"], p["loss"], p["V"]) == (c, loss, BIG_V)]
        ok = sorted((p["T"], p["peak_bytes"] / GIB) for p in pts if p["status"] == "ok")
        if ok:
            ax.plot(*zip(*ok), marker="o", label=f"{c} ({'SFT CE' if loss == 'ce' else 'GRPO + entropy'})")
    ax.axhline(report["budget_bytes"] / GIB, color="grey", ls="--", lw=1, label="budget")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the microbatch (one sample)")
    ax.set_ylabel("peak step memory above the process (GiB)")
    d = next((p.get("d_model", SHAPE["d_model"]) for p in report["points"]), SHAPE["d_model"])
    ax.set_title(f"One step, V=151,936, D={d}, 2 layers, every unit rematerialised")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # a child: one point, one JSON line
    print(json.dumps(child(json.loads(sys.argv[1]))), flush=True)
