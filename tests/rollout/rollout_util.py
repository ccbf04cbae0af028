"""Tiny models and an independent full forward for the rollout engine's tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import odcfn
from odcfn.model import unit_inputs
from odcfn.models import QwenConfig, QwenMoeConfig, RopeScaling, init_params, qwen_model
from odcfn.models.layers import rms_norm
from odcfn.moe import LocalExperts
from odcfn.tree import tree_flatten_with_path, tree_unflatten

# every switch the engine must honour: qkv bias, Qwen3's qk-norm and free head_dim, Llama's o
# bias and RoPE scaling, tied embeddings, GQA; a Qwen3-MoE with a dense layer and a Qwen2-MoE
# with a shared expert
DENSE = QwenConfig(vocab_size=40, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=36)
QWEN3 = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=20, head_dim=6,
                   qk_norm=True, qkv_bias=False, tie_embeddings=True)
LLAMA = QwenConfig(vocab_size=33, d_model=20, n_layers=2, n_heads=5, n_kv_heads=5, d_ff=28, qkv_bias=True,
                   o_bias=True, rope_theta=500.0,
                   rope_scaling=RopeScaling("llama3", 8.0, 16, low_freq_factor=1.0, high_freq_factor=4.0))
MOE = QwenMoeConfig(vocab_size=36, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=20, num_experts=6,
                    num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True, mlp_only_layers=(1,),
                    qk_norm=True, qkv_bias=False)
MOE2 = QwenMoeConfig(vocab_size=30, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=20, num_experts=5,
                     num_experts_per_tok=3, moe_intermediate_size=8, shared_expert_intermediate_size=12)
CONFIGS = {"dense": DENSE, "qwen3": QWEN3, "llama": LLAMA, "moe": MOE, "moe2": MOE2}


def sharp_params(cfg: QwenConfig, seed: int = 0) -> dict:
    """Params far from init's near-uniform outputs: distinct logits (no greedy near-ties), a
    router whose choice depends on the token, norms and biases that matter."""
    g = torch.Generator().manual_seed(seed)

    def leaf(path: str, t: torch.Tensor) -> torch.Tensor:
        if path.endswith("norm.weight"):
            return 1.0 + 0.2 * torch.randn(t.shape, generator=g)
        scale = 0.6 if path.endswith("mlp.gate.weight") else 0.3
        return torch.randn(t.shape, generator=g) * scale

    names, leaves, treedef = tree_flatten_with_path(init_params(cfg))
    return tree_unflatten(treedef, [leaf(n, t) for n, t in zip(names, leaves)])


def full_logits(
    cfg: QwenConfig, params: dict, ids: list[int], model: odcfn.Model | None = None
) -> torch.Tensor:
    """fp32 logits at every position of ``ids`` from one full forward through the model's own
    units (no cache): the recomputation the KV cache must equal."""
    model = model or qwen_model(cfg)
    mb = odcfn.pack(odcfn.Batch((odcfn.Sample(torch.tensor(ids)),)), [0])
    x = None
    with torch.no_grad():
        for name in model.chain[:-1]:
            u = model.unit(name)
            p = unit_inputs(u, params[name], params)
            if u.experts:
                p = {**p, "experts": LocalExperts([params[e] for e in u.experts])}
            x = u.fwd(p, x, mb)
        h = rms_norm(x, params["head"]["norm"]["weight"], cfg.rms_eps)
        w = params["embed"]["embed_tokens"] if cfg.tie_embeddings else params["head"]["lm_head"]
        return F.linear(h, w["weight"]).float()


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


__all__ = ["CONFIGS", "DENSE", "LLAMA", "MOE", "MOE2", "QWEN3", "full_logits", "prompts", "qwen_model",
           "sharp_params"]
