"""``odcfn bench --only moe``: a Qwen3-MoE-shaped toy on long-tail data, W processes.

1. ODC + LB-Mini against torch FSDP2 (``fully_shard`` per decoder layer, gloo) on transformers'
   own ``Qwen3MoeForCausalLM`` with LB-Micro's microbatches (``odcfn.bench.moe_hf``): samples/s
   from one launched job alternating the two minibatch by minibatch (the per-minibatch ratio of
   step times: median [min-max]); peak memory per rank from one job per contender (PSS above the
   process's baseline before either model exists, per step: median [min-max]).
2. Expert bytes, from ODC's routed gather events (``layers.{i}.experts[ids]``) in that job: the
   experts gathered per step and the most experts resident in a layer at once, against the
   all-experts gather FSDP does for the same microbatches (forward and the backward's re-gather);
   and, *computed* from the shapes, the bytes per layer that fetching a layer's experts moves vs
   expert-parallel all-to-all at 4K, 16K and 64K tokens per rank.
3. The expert compute alone (one thread, forward + backward, interleaved repeats): odcfn's
   grouped path (``odcfn.moe.experts.routed_ffn``, tokens sorted by expert) and ODC's on-demand
   path (``OnDemandExperts`` over an in-memory fetcher) vs transformers' experts implementations
   on the same shapes and routing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

__all__ = ["SHAPES", "a2a_vs_fetch", "expert_compute", "moe_config", "render", "run", "section"]

# the toy (Qwen3-30B-A3B: hidden 2048, 128 experts, top-8, expert width 768, 48 layers): hidden
# 256, 64 experts, top-8; the expert width and the depth are scaled down so that both contenders
# fit a few minutes on 2 shared cores ("tiny": the tests)
SHAPES = {
    "full": dict(d_model=256, n_layers=4, num_experts=64, top_k=8, moe_intermediate_size=128),
    "quick": dict(d_model=256, n_layers=2, num_experts=64, top_k=8, moe_intermediate_size=64),
    "tiny": dict(d_model=32, n_layers=2, num_experts=8, top_k=2, moe_intermediate_size=16),
}
QWEN3_30B_A3B = dict(d_model=2048, num_experts=128, top_k=8, moe_intermediate_size=768)
A2A_TOKENS = (4096, 16384, 65536)
COMPUTE_TOKENS = {"full": 4096, "quick": 1024, "tiny": 64}  # the expert-compute comparison's tokens


def moe_config(d_model: int, n_layers: int, num_experts: int, top_k: int, moe_intermediate_size: int,
               vocab_size: int = 512):
    """A Qwen3-MoE-style config: 4 query heads, 2 KV heads, qk-norm, no biases, every layer sparse,
    top-k probabilities renormalised (Qwen3-MoE's ``norm_topk_prob``)."""
    from odcfn.models import QwenMoeConfig

    return QwenMoeConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                         head_dim=d_model // 4, d_ff=3 * d_model, num_experts=num_experts,
                         num_experts_per_tok=top_k, moe_intermediate_size=moe_intermediate_size,
                         norm_topk_prob=True, qkv_bias=False, qk_norm=True)


def _med(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# --- 1 + 2: the launched jobs ------------------------------------------------------------------


def _by_step(recs: list[list[dict]], impl: str) -> list[list[dict]]:
    steps: dict[int, list[dict]] = {}
    for rank in recs:
        for r in rank:
            if r["impl"] == impl and not r["warmup"]:
                steps.setdefault(r["step"], []).append(r)
    return [sorted(v, key=lambda r: r["rank"]) for _, v in sorted(steps.items())]


def _speed(recs: list[list[dict]]) -> dict:
    out: dict = {}
    for impl in ("odc", "fsdp2"):
        steps = _by_step(recs, impl)
        walls = [max(r["wall"] for r in s) for s in steps]
        out[impl] = {"step_time_s": walls, "samples_per_s": sum(s[0]["samples"] for s in steps) / sum(walls),
                     "tokens_per_s": sum(s[0]["tokens"] for s in steps) / sum(walls),
                     "losses": [s[0]["loss"] for s in steps],
                     "microbatches_per_rank": [[len(r["microbatches"]) for r in s] for s in steps]}
    per_step = [f / o for o, f in zip(out["odc"]["step_time_s"], out["fsdp2"]["step_time_s"], strict=True)]
    out["samples_per_s_odc_over_fsdp2"] = out["odc"]["samples_per_s"] / out["fsdp2"]["samples_per_s"]
    out["per_minibatch_speedup"] = _med(per_step)  # FSDP2's step time / ODC's, same minibatch
    pairs = zip(out["odc"]["losses"], out["fsdp2"]["losses"], strict=True)
    worst = max(abs(a - b) / abs(b) for a, b in pairs)
    out["losses_match"], out["max_loss_rel_diff"] = worst <= 1e-3, worst
    return out


def _memory(odc: list[list[dict]], fsdp2: list[list[dict]]) -> dict:
    def peaks(recs):
        return [max(r["peak_pss_above_baseline"] for r in s) for s in _by_step(recs, recs[0][0]["impl"])]

    a, b = peaks(odc), peaks(fsdp2)
    return {"definition": "per step, the largest rank's peak PSS (sampled every 2 ms) above the process's "
                          "PSS before either model was built: state, transport and the step's transients",
            "odc_bytes": _med(a), "fsdp2_bytes": _med(b),
            "odc_over_fsdp2": _med([x / y for x, y in zip(a, b, strict=True)])}


def _expert_bytes(recs: list[list[dict]], cfg, W: int) -> dict:
    """Routed gathers of ODC's timed steps against FSDP's all-experts gathers of the same
    microbatches (forward + the backward's re-gather, as FSDP2 with reshard_after_forward)."""
    from odcfn.models.moe import sparse_layers

    E, L = cfg.num_experts, len(sparse_layers(cfg))
    ebytes = 3 * cfg.moe_intermediate_size * cfg.d_model * 4  # one expert, fp32, gathered in full
    steps = _by_step(recs, "odc")
    got, every, peak, per_layer = [], [], 0, {}
    for s in steps:
        for r in s:  # per rank and step
            n = 0
            for name, _ in r["expert_gathers"]:
                k = len(name.split("[")[1].rstrip("]").split(","))
                n += k
                peak = max(peak, k)
                layer = name.split(".experts[")[0]
                per_layer[layer] = per_layer.get(layer, 0) + k
            got.append(n * ebytes)
            every.append(2 * len(r["microbatches"]) * L * E * ebytes)
    n_rs = len(got)
    fsdp2_mb = [s[0]["n_max"] for s in _by_step(recs, "fsdp2")]  # LB-Micro's count, every rank alike
    return {
        "expert_bytes_fp32": ebytes,
        "note": "bytes an expert occupies once gathered (full, fp32); the wire carries the (W-1)/W of it "
                f"other ranks own ({(W - 1) / W:.2f})",
        "odc_gathered_per_rank_step": sum(got) / n_rs,
        "all_experts_same_microbatches_per_rank_step": sum(every) / n_rs,
        "odc_over_all_experts": sum(got) / sum(every),
        "fsdp2_lb_micro_all_experts_per_rank_step": (
            statistics.mean(fsdp2_mb) * 2 * L * E * ebytes if fsdp2_mb else None),
        "odc_gathered_per_layer_rank_step": {k: v * ebytes / n_rs for k, v in sorted(per_layer.items())},
        "peak_resident_experts_per_layer": {"odc": peak, "all_experts": E},
        "peak_gathered_expert_bytes_per_layer": {"odc": peak * ebytes, "all_experts": E * ebytes},
        "expert_load_max_over_mean_last_step": _load_skew(recs),
    }


def _load_skew(recs: list[list[dict]]) -> dict:
    last = _by_step(recs, "odc")[-1][0]["loads"]
    return {k.removeprefix("moe/load/"): max(v) / (sum(v) / len(v)) for k, v in last.items() if sum(v)}


def a2a_vs_fetch(d_model: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 bytes_per_elem: int = 2, tokens: tuple[int, ...] = A2A_TOKENS) -> dict:
    """Computed, forward, per layer and rank, many ranks (the (W-1)/W factors -> 1): fetching the
    experts the tokens hit (uniform routing: E (1 - (1 - k/E)^T) of them, 3 I D elements each)
    vs expert-parallel all-to-all (each token's hidden state to its k experts and back: 2 k D)."""
    D, E, k, I_ = d_model, num_experts, top_k, moe_intermediate_size
    rows = []
    for T in tokens:
        hit = E * (1 - (1 - k / E) ** T)
        fetch, a2a = hit * 3 * I_ * D * bytes_per_elem, 2 * k * D * T * bytes_per_elem
        rows.append({"tokens_per_rank": T, "experts_hit": hit, "fetch_bytes": fetch, "all_to_all_bytes": a2a,
                     "fetch_over_all_to_all": fetch / a2a})
    return {"computed": True, "bytes_per_elem": bytes_per_elem,
            "crossover_tokens_per_rank": 3 * E * I_ / (2 * k), "rows": rows}


# --- 3: the expert compute ---------------------------------------------------------------------


class _MemFetcher:
    """``OnDemandExperts``' fetcher over experts already in memory (no transport): ODC's
    on-demand compute path alone."""

    def __init__(self, flats: list[torch.Tensor], I_: int, D: int, group: int) -> None:
        self.flats, self.I, self.D, self.group = flats, I_, D, group
        self.num_experts, self.trained = len(flats), True
        self.grads = [torch.zeros_like(f) for f in flats]

    def fetch(self, experts, grad: bool):
        out = []
        for e in experts:
            flat = self.flats[e].detach().requires_grad_(grad)
            g, u, d = flat.split(self.I * self.D)
            out.append((flat, {"gate_proj": {"weight": g.view(self.I, self.D)},
                               "up_proj": {"weight": u.view(self.I, self.D)},
                               "down_proj": {"weight": d.view(self.D, self.I)}}))
        return out

    def release(self, experts) -> None:
        pass

    def push(self, expert: int, grad_flat: torch.Tensor) -> None:
        self.grads[expert].add_(grad_flat)


def _call(m, idx: torch.Tensor):
    return lambda xx, ww: m(xx, idx, ww)


def expert_compute(D: int, E: int, k: int, I_: int, tokens: int, reps: int = 3, group: int = 8,
                   batched_mm_limit: int = 1 << 14, seed: int = 0) -> dict:
    """Forward + backward of one MoE layer's experts (same weights, routing and upstream
    gradient for every contender), one thread, contenders interleaved within each repeat."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from odcfn.bench.moe_hf import hf_config
    from odcfn.moe.experts import OnDemandExperts, routed_ffn

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    gy = torch.randn(tokens, D, generator=g)
    gu, dn = torch.randn(E, 2 * I_, D, generator=g) * 0.05, torch.randn(E, D, I_, generator=g) * 0.05
    trees = [{"gate_proj": {"weight": gu[e, :I_].clone().requires_grad_()},
              "up_proj": {"weight": gu[e, I_:].clone().requires_grad_()},
              "down_proj": {"weight": dn[e].clone().requires_grad_()}} for e in range(E)]
    fetcher = _MemFetcher([torch.cat([gu[e].reshape(-1), dn[e].reshape(-1)]) for e in range(E)], I_, D, group)
    cfg = moe_config(D, 1, E, k, I_)
    impls = ["eager", "grouped_mm"] + (["batched_mm"] if tokens * E <= batched_mm_limit else [])
    hf = {}
    for impl in impls:
        m = Qwen3MoeExperts(hf_config(cfg, impl))
        with torch.no_grad():
            m.gate_up_proj.copy_(gu)
            m.down_proj.copy_(dn)
        hf[impl] = m
    runs = {"odcfn_routed_ffn": lambda xx, ww: routed_ffn(xx, idx, ww, trees.__getitem__, E),
            "odcfn_on_demand": lambda xx, ww: OnDemandExperts(fetcher).apply(xx, idx, ww),
            **{f"transformers_{i}": _call(m, idx) for i, m in hf.items()}}
    times: dict[str, list[float]] = {n: [] for n in runs}
    outs: dict[str, torch.Tensor] = {}
    try:
        for rep in range(reps + 1):  # the first repeat warms up (allocations, first touch)
            for name, fn in runs.items():
                xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
                t0 = time.perf_counter()
                y = fn(xx, ww)
                y.backward(gy)
                if rep:
                    times[name].append(time.perf_counter() - t0)
                outs[name] = xx.grad
    finally:
        torch.set_num_threads(prev)
    ref = outs["odcfn_routed_ffn"]
    agree = all(torch.allclose(v, ref, rtol=1e-4, atol=1e-5) for v in outs.values())
    hf_names = [n for n in runs if n.startswith("transformers_")]
    fastest = min(hf_names, key=lambda n: statistics.median(times[n]))
    return {
        "shape": {"tokens": tokens, "d_model": D, "num_experts": E, "top_k": k, "moe_intermediate_size": I_},
        "threads": 1, "repeats": reps, "seconds": {n: _med(t) for n, t in times.items()},
        "skipped": {} if "batched_mm" in hf else {
            "transformers_batched_mm": f"computes every expert for every token (tokens x E = {tokens * E} "
                                       f"FFNs > {batched_mm_limit}); minutes per call here"},
        "input_grads_agree": agree,
        "fastest_transformers": fastest,
        "transformers_over_odcfn": {
            n: _med([a / b for a, b in zip(times[fastest], times[n], strict=True)])
            for n in ("odcfn_routed_ffn", "odcfn_on_demand")},
    }


# --- the section -------------------------------------------------------------------------------


def run(workload, *, steps: int = 3, warmup: int = 1, expert_group: int = 8, compute_tokens: int = 4096,
        compute_reps: int = 3, log=print) -> dict:
    from odcfn.bench.moe_hf import MoeFsdp2Spec, moe_fsdp2_worker
    from odcfn.launch import launch

    cfg, W = workload.model, workload.world_size
    sizes = {"num_params": cfg.num_params, "active_params": cfg.active_params}
    out: dict = {"config": {"model": vars(cfg) | sizes,
                            "world_size": W, "samples_per_rank": workload.samples_per_rank,
                            "length_scale": workload.length_scale, "expert_group": expert_group,
                            "steps": steps, "warmup": warmup, "experts_implementation_fsdp2": "grouped_mm"}}
    spec = MoeFsdp2Spec(workload, "time", steps, warmup, expert_group)
    log(f"   ODC + LB-Mini vs torch FSDP2 + LB-Micro (transformers' Qwen3-MoE): {W} processes, "
        "alternating")
    recs = launch(moe_fsdp2_worker, W, args=(spec,), timeout=1800.0)
    out["vs_fsdp2"] = _speed(recs)
    out["expert_bytes"] = _expert_bytes(recs, cfg, W)
    mem = {}
    for impl in ("odc", "fsdp2"):
        log(f"   peak memory: {impl} alone, {W} processes")
        mem[impl] = launch(moe_fsdp2_worker, W, args=(replace(spec, mode=impl, steps=min(steps, 2)),),
                           timeout=1800.0)
    out["memory"] = _memory(mem["odc"], mem["fsdp2"])
    sh = dict(d_model=cfg.d_model, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
              moe_intermediate_size=cfg.moe_intermediate_size)
    out["a2a_vs_fetch"] = {"toy_bf16": a2a_vs_fetch(**sh),
                           "qwen3_30b_a3b_bf16": a2a_vs_fetch(**QWEN3_30B_A3B)}
    log(f"   expert compute: {compute_tokens} tokens, {compute_reps} repeats, one thread")
    out["expert_compute"] = expert_compute(cfg.d_model, cfg.num_experts, cfg.num_experts_per_tok,
                                           cfg.moe_intermediate_size, compute_tokens, compute_reps,
                                           expert_group)
    return out


def section(ctx, quick: bool = False, shape: str | None = None) -> dict:
    """The bench section on ``ctx.workload``'s data with the MoE toy as its model."""
    if ctx.backend != "process":
        return {"skipped": "torch FSDP2 and ODC's shared memory need real processes (odcfn.launch)"}
    shape = shape or ("quick" if quick else "full")
    w = replace(ctx.workload, model=moe_config(**SHAPES[shape]))
    return run(w, steps=ctx.steps, warmup=ctx.warmup, compute_tokens=COMPUTE_TOKENS[shape],
               compute_reps=3, log=ctx.log)


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _mr(m: dict, f=lambda v: f"{v:.2f}") -> str:
    """median [min-max]"""
    return f"{f(m['median'])} [{f(m['min'])}-{f(m['max'])}]"


def render(sec: dict | None) -> str:
    """The human-readable lines of the section ("" when it did not run)."""
    if not sec:
        return ""
    if "vs_fsdp2" not in sec:
        return f"\n\n9. MoE: {sec.get('error') or sec.get('skipped')}"
    c, v, mem = sec["config"], sec["vs_fsdp2"], sec["memory"]
    eb, ec = sec["expert_bytes"], sec["expert_compute"]
    m = c["model"]
    lines = [
        f"\n\n9. MoE: Qwen3-MoE-shaped toy (hidden {m['d_model']}, {m['num_experts']} experts, top-"
        f"{m['num_experts_per_tok']}, expert width {m['moe_intermediate_size']}, {m['n_layers']} layers, "
        f"{m['num_params']:,} params, {m['active_params']:,} active), W={c['world_size']}, expert group "
        f"{c['expert_group']}",
        f"   samples/s: ODC+LB-Mini {v['odc']['samples_per_s']:.3f}, torch FSDP2+LB-Micro (transformers' "
        f"Qwen3MoeForCausalLM) {v['fsdp2']['samples_per_s']:.3f}: {v['samples_per_s_odc_over_fsdp2']:.2f}x; "
        f"per minibatch {_mr(v['per_minibatch_speedup'])}x (losses match: {v['losses_match']})",
        f"   peak memory per rank, MiB: ODC {_mr(mem['odc_bytes'], _mib)}, "
        f"FSDP2 {_mr(mem['fsdp2_bytes'], _mib)}; "
        f"ODC/FSDP2 {_mr(mem['odc_over_fsdp2'])}x",
        f"   expert bytes gathered per rank and step: ODC {_mib(eb['odc_gathered_per_rank_step'])} MiB vs "
        "all experts for the same microbatches "
        f"{_mib(eb['all_experts_same_microbatches_per_rank_step'])} MiB "
        f"({eb['odc_over_all_experts']:.2f}x)",
        f"   peak gathered expert memory per layer: ODC "
        f"{_mib(eb['peak_gathered_expert_bytes_per_layer']['odc'])}"
        f" MiB ({eb['peak_resident_experts_per_layer']['odc']} experts) vs all experts "
        f"{_mib(eb['peak_gathered_expert_bytes_per_layer']['all_experts'])} MiB",
        "   per layer, forward, bf16 (COMPUTED): fetching the experts hit vs expert-parallel all-to-all",
    ]
    for name, a in sec["a2a_vs_fetch"].items():
        rows = ", ".join(f"{r['tokens_per_rank'] // 1024}K: {r['fetch_over_all_to_all']:.2f}x"
                         for r in a["rows"])
        lines.append(f"     {name}: fetch/all-to-all {rows} "
                     f"(crossover {a['crossover_tokens_per_rank']:,.0f} tokens)")
    sh = ec["shape"]
    lines.append(f"   expert compute, {sh['tokens']} tokens, forward+backward, 1 thread, s: "
                 + ", ".join(f"{n} {_mr(t, lambda x: f'{x:.4f}')}" for n, t in ec["seconds"].items()))
    lines.append(f"   {ec['fastest_transformers']} time / odcfn time: "
                 + ", ".join(f"{n} {_mr(r)}x" for n, r in ec["transformers_over_odcfn"].items()))
    return "\n".join(lines)
