"""The torch FSDP2 side of ``odcfn bench --only moe``: transformers' own ``Qwen3MoeForCausalLM``
holding the same weights as an odcfn ``QwenMoeConfig`` model, ``fully_shard`` per decoder layer
(and the root: embedding, final norm, head), fed LB-Micro's packed microbatches.

Packing: a microbatch's samples are concatenated in one row with ``position_ids`` restarting at
each sample; transformers then builds a block-diagonal causal mask (``masking_utils``'s packed
sequence detection), so each sample attends only to itself, as in odcfn. On CPU that mask is a
dense T x T mask (SDPA's math path), which is what a transformers user gets here.

Loss: the summed token cross-entropy over the microbatch's loss tokens (the router's auxiliary
loss is off on both sides: ``output_router_logits=False``), divided by the minibatch's loss
tokens, as odcfn's head computes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["MoeFsdp2Spec", "hf_config", "hf_microbatch_loss", "hf_moe_model", "hf_state_from_params",
           "moe_fsdp2_worker"]


def hf_config(cfg, experts_implementation: str = "grouped_mm"):
    """transformers' ``Qwen3MoeConfig`` computing ``cfg`` (a Qwen3-style ``QwenMoeConfig``:
    qk-norm, no biases, untied, no shared expert)."""
    import transformers

    if cfg.shared_expert_intermediate_size or cfg.qkv_bias or not cfg.qk_norm or cfg.tie_embeddings:
        raise ValueError("the MoE bench's transformers side is Qwen3-MoE: qk_norm, no biases, no shared "
                         "expert, untied embeddings")
    conf = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        intermediate_size=cfg.d_ff, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
        output_router_logits=False, rms_norm_eps=cfg.rms_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_bias=False, use_cache=False,
    )
    conf._experts_implementation = experts_implementation  # transformers 5's experts dispatch
    conf._attn_implementation = "sdpa"
    return conf


def hf_state_from_params(cfg, params: dict) -> dict[str, torch.Tensor]:
    """odcfn params -> transformers 5's in-memory state dict (experts fused: ``gate_up_proj``
    (E, 2I, D) and ``down_proj`` (E, D, I) per layer)."""
    from odcfn.models.hf_names import hf_state_dict
    from odcfn.models.moe import expert_name, sparse_layers

    dense = {u: t for u, t in params.items() if ".experts." not in u}
    out = dict(hf_state_dict(dense))
    for i in sparse_layers(cfg):
        ex = [params[expert_name(i, e)] for e in range(cfg.num_experts)]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([p["gate_proj"]["weight"], p["up_proj"]["weight"]]) for p in ex])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([p["down_proj"]["weight"] for p in ex])
    return out


def hf_moe_model(cfg, params: dict, experts_implementation: str = "grouped_mm"):
    """``Qwen3MoeForCausalLM`` in fp32 with odcfn's ``params`` loaded (every tensor checked)."""
    import transformers

    model = transformers.Qwen3MoeForCausalLM(hf_config(cfg, experts_implementation)).float()
    state = hf_state_from_params(cfg, params)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"transformers' Qwen3-MoE and odcfn's params differ: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    return model


def hf_microbatch_loss(model, mb) -> torch.Tensor:
    """Summed cross-entropy of a packed odcfn ``Microbatch`` under transformers' model."""
    logits_TxV = model(input_ids=mb.input_ids_T[None], position_ids=mb.positions_T[None],
                       use_cache=False).logits[0]
    ce_T = F.cross_entropy(logits_TxV.float(), mb.labels_T, reduction="none")
    return (ce_T * mb.loss_mask_T).sum()


# --- the launched job ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeFsdp2Spec:
    workload: object  # bench.workload.Workload whose model is a QwenMoeConfig
    mode: str = "time"  # "time": both, alternating; "odc" / "fsdp2": that one alone, for memory
    steps: int = 3
    warmup: int = 1
    expert_group: int = 8
    experts_implementation: str = "grouped_mm"
    timeout: float = 300.0


def _fsdp2_module(cfg, params: dict, dmesh, impl: str):
    from torch.distributed.fsdp import fully_shard

    module = hf_moe_model(cfg, params, impl)
    for layer in module.model.layers:  # one FSDP unit per decoder layer (its experts inside it)
        fully_shard(layer, mesh=dmesh)
    fully_shard(module, mesh=dmesh)  # the root: embedding, final norm, head
    return module


def moe_fsdp2_worker(spec: MoeFsdp2Spec) -> list[dict]:
    """One launched rank: ODC + LB-Mini and/or FSDP2 + LB-Micro on transformers' Qwen3-MoE."""
    import gc
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import odcfn
    from odcfn.bench.fsdp2 import fsdp2_step
    from odcfn.bench.lora_section import PeakSampler, pss
    from odcfn.bench.workload import make_batch
    from odcfn.models import init_params, qwen_model
    from odcfn.schedule.balance import get_balancer
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    w = spec.workload
    mesh = odcfn.Mesh.from_env()
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01  # odcfn.optim.adamw's defaults
    impls = ("odc", "fsdp2") if spec.mode == "time" else (spec.mode,)
    cap = w.max_tokens_per_microbatch
    # both contenders' libraries imported before the baseline, whichever runs (transformers alone
    # is ~100 MB of PSS: it must not count against the job that uses it)
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    with ShmTransport(mesh, timeout=spec.timeout) as tr:  # (creates the default gloo group)
        gc.collect()
        base = pss()  # before either model exists: what each contender adds on top
        full = init_params(w.model, seed=w.seed)
        state = module = topt = None
        if "odc" in impls:
            model = qwen_model(w.model)
            state = odcfn.TrainState.create(
                params=odcfn.shard(full, model, mesh), model=model, transport=tr,
                optimizer=odcfn.adamw(w.lr, b1=b1, b2=b2, eps=eps, weight_decay=wd),
                config=odcfn.StepConfig(balance="lb_mini", max_tokens_per_microbatch=cap,
                                        options=odcfn.ScheduleOptions(expert_group=spec.expert_group)))
        if "fsdp2" in impls:
            module = _fsdp2_module(w.model, full, init_device_mesh("cpu", (mesh.world_size,)),
                                   spec.experts_implementation)
            topt = torch.optim.AdamW(module.parameters(), lr=w.lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        del full
        gc.collect()
        lb_micro = get_balancer("lb_micro")  # FSDP2 runs LB-Micro's microbatches (equal counts)
        out = []
        for step in range(spec.warmup + spec.steps):
            batch = make_batch(w, step)
            order = impls if step % 2 == 0 else impls[::-1]
            for which in order:
                dist.barrier()
                sampler = PeakSampler() if spec.mode != "time" else None
                t0 = time.perf_counter()
                rec: dict = {"impl": which, "step": step, "warmup": step < spec.warmup, "rank": mesh.rank,
                             "samples": len(batch), "tokens": sum(batch.lengths)}
                if which == "odc":
                    state, m = odcfn.train_step(state, batch)
                    rec.update(loss=m.loss, counters=m.counters.as_dict(),
                               microbatches=[list(x) for x in m.plan.microbatches],
                               expert_gathers=[(e.name, e.mb) for e in m.events
                                               if e.kind == "gather" and ".experts[" in e.name],
                               loads={k: v.tolist() for k, v in m.extra.items() if k.startswith("moe/load/")})
                else:
                    assignment = lb_micro(batch.lengths, mesh.world_size, cap)
                    n_max = max(len(a) for a in assignment)
                    rec.update(loss=fsdp2_step(module, topt, batch, assignment[mesh.rank], n_max,
                                               loss_fn=hf_microbatch_loss),
                               microbatches=[list(x) for x in assignment[mesh.rank]], n_max=n_max)
                rec["wall"] = time.perf_counter() - t0
                if sampler is not None:
                    rec["peak_pss_above_baseline"] = sampler.stop() - base
                out.append(rec)
        dist.barrier()
        return out
