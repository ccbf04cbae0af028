"""Tiny Hugging Face Qwen3-MoE / Qwen2-MoE models and helpers shared by the MoE round-trip tests
(built from a fixed seed: nothing is downloaded)."""

from __future__ import annotations

import torch
import transformers

import odcfn
from odcfn.models import QwenMoeConfig, init_params
from odcfn.tree import tree_flatten_with_path

# 3 layers: layer 1 is dense (mlp_only_layers) or layers 0 and 2 are (decoder_sparse_step=2)
BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=16, rms_norm_eps=1e-5)  # fmt: skip
FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=12, mlp_only_layers=[1], rope_parameters={
        "rope_type": "default", "rope_theta": 5000.0})),
    "qwen2_moe": ("Qwen2Moe", dict(shared_expert_intermediate_size=24, decoder_sparse_step=2)),
}  # fmt: skip


def hf_moe_model(kind: str, *, seed: int = 0, **over):
    prefix, kw = FAMILIES[kind]
    conf = getattr(transformers, f"{prefix}Config")(**{**BASE, **kw, **over})
    torch.manual_seed(seed)
    ref = getattr(transformers, f"{prefix}ForCausalLM")(conf).float().eval()
    with torch.no_grad():  # a sharp router, so top-k depends on the token; norms and biases matter
        for n, p in ref.named_parameters():
            p.normal_(1.0 if n.endswith("norm.weight") else 0.0, 0.3 if "gate.weight" in n else 0.08)
    return ref


def hub_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors (or their grads) under the Hub's per-expert names."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("experts.gate_up_proj"):
            i_ = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :i_]
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, i_:]
        elif k.endswith("experts.down_proj"):
            out.update({k.replace("down_proj", f"{e}.down_proj.weight"): v[e] for e in range(v.shape[0])})
        else:
            out[k] = v
    return out


def hf_loss(ref, tokens: torch.Tensor) -> torch.Tensor:
    ids = tokens.long()[None]
    return ref(input_ids=ids, labels=ids).loss  # + coef * aux when output_router_logits


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def random_params(cfg: QwenMoeConfig, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def leaf(path: str, t: torch.Tensor) -> torch.Tensor:
        scale = 0.3 if path.endswith("mlp.gate.weight") else 0.08
        base = 1.0 if path.endswith("norm.weight") else 0.0
        return base + torch.randn(t.shape, generator=g) * scale

    names, leaves, treedef = tree_flatten_with_path(init_params(cfg))
    return odcfn.tree.tree_unflatten(treedef, [leaf(n, t) for n, t in zip(names, leaves)])


TO_HF = [
    QwenMoeConfig(vocab_size=50, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40, qk_norm=True,
                  qkv_bias=False, head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12,
                  norm_topk_prob=True, decoder_sparse_step=2, output_router_logits=True,
                  router_aux_loss_coef=0.5),
    QwenMoeConfig(vocab_size=50, d_model=24, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=40, qk_norm=False,
                  qkv_bias=True, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                  mlp_only_layers=(1,), shared_expert_intermediate_size=20, rope_theta=3000.0),
]  # fmt: skip


