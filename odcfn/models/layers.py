"""The decoder's building blocks as pure functions: RMSNorm, (LoRA-aware) linear, causal GQA
attention over packed samples, and the embed / dense block / head unit functions that
``odcfn.models.qwen`` and ``odcfn.models.moe`` assemble into models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from odcfn.batch import Microbatch
from odcfn.kernels.embedding import embedding
from odcfn.losses import head_stats
from odcfn.models.rope import apply_rope

__all__ = ["attention", "block_fwd", "causal_attention", "embed_fwd", "head_fwd", "linear", "rms_norm",
           "swiglu"]


def rms_norm(x_TxD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    var_T1 = x_TxD.float().pow(2).mean(-1, keepdim=True)
    return (x_TxD.float() * torch.rsqrt(var_T1 + eps)).to(x_TxD.dtype) * w_D


def linear(x: torch.Tensor, p: dict) -> torch.Tensor:
    y = F.linear(x, p["weight"], p.get("bias"))
    if "lora_A" in p:  # a LoRA-adapted projection (odcfn.lora): PEFT's W x + b + scale * B (A x)
        if "lora_drop" in p:  # LoRA dropout (training): on the A path's input only, as PEFT's;
            # the plan (odcfn.lora.dropout) draws the mask tile by tile, never whole
            h = p["lora_drop"](x, p["lora_A"])
        else:
            h = F.linear(x, p["lora_A"])
        y = y + F.linear(h, p["lora_B"]) * p["lora_scale"]
    return y


def causal_attention(q_HxTxK: torch.Tensor, k_GxTxK: torch.Tensor, v_GxTxK: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of one sample through a kernel whose memory is O(T), never the
    T x T scores. SDPA picks flash / memory-efficient kernels only for batched 4-D inputs (3-D
    ones take the math kernel, O(T^2): 3.1 GB at 8K tokens on CPU). On CPU the flash kernel
    takes grouped kv heads (``enable_gqa``) in every dtype; on CUDA GQA reaches only flash
    (fp16/bf16) and math, so other dtypes get kv heads repeated (O(T)) for the memory-efficient
    kernel."""
    q, k, v = q_HxTxK[None], k_GxTxK[None], v_GxTxK[None]
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
        rep = q.shape[1] // k.shape[1]  # query head h reads kv head h // rep, as enable_gqa does
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)[0]


def attention(p: dict, x_TxD: torch.Tensor, mb: Microbatch, cfg) -> torch.Tensor:
    hd = cfg.head_dim
    q_HxTxK = rearrange(linear(x_TxD, p["q_proj"]), "t (h k) -> h t k", k=hd)
    k_GxTxK = rearrange(linear(x_TxD, p["k_proj"]), "t (g k) -> g t k", k=hd)
    v_GxTxK = rearrange(linear(x_TxD, p["v_proj"]), "t (g k) -> g t k", k=hd)
    if cfg.qk_norm:
        q_HxTxK = rms_norm(q_HxTxK, p["q_norm"]["weight"], cfg.rms_eps)
        k_GxTxK = rms_norm(k_GxTxK, p["k_norm"]["weight"], cfg.rms_eps)
    q_HxTxK = apply_rope(q_HxTxK, mb.positions_T, cfg.rope_theta, cfg.rope_scaling)
    k_GxTxK = apply_rope(k_GxTxK, mb.positions_T, cfg.rope_theta, cfg.rope_scaling)
    # one causal attention per packed sample: nothing attends across a sample boundary
    outs = [
        causal_attention(q, k, v)
        for q, k, v in zip(
            q_HxTxK.split(mb.seqlens, dim=1),
            k_GxTxK.split(mb.seqlens, dim=1),
            v_GxTxK.split(mb.seqlens, dim=1),
        )
    ]
    o_HxTxK = torch.cat(outs, dim=1)
    return linear(rearrange(o_HxTxK, "h t k -> t (h k)"), p["o_proj"])


def embed_fwd(p: dict, x: None, mb: Microbatch, *, pad: int | None = None) -> torch.Tensor:
    """The token rows of the embedding matrix; in the step their gradient is added straight
    into the unit's flat gradient (``odcfn.kernels.embedding``: no dense V×D gradient)."""
    return embedding(mb.input_ids_T, p["embed_tokens"]["weight"], padding_idx=pad)


def block_fwd(p: dict, x_TxD: torch.Tensor, mb: Microbatch, *, cfg) -> torch.Tensor:
    h_TxD = x_TxD + attention(
        p["self_attn"], rms_norm(x_TxD, p["input_layernorm"]["weight"], cfg.rms_eps), mb, cfg
    )
    n_TxD = rms_norm(h_TxD, p["post_attention_layernorm"]["weight"], cfg.rms_eps)
    return h_TxD + swiglu(p["mlp"], n_TxD)


def swiglu(m: dict, x_TxD: torch.Tensor) -> torch.Tensor:
    """Hugging Face's gated MLP: ``down(silu(gate(x)) * up(x))`` (LoRA-aware projections)."""
    return linear(F.silu(linear(x_TxD, m["gate_proj"])) * linear(x_TxD, m["up_proj"]), m["down_proj"])


def head_fwd(p: dict, x_TxD: torch.Tensor, mb: Microbatch, *, cfg) -> torch.Tensor:
    """The final norm, then the loss seam (``odcfn.losses.head_stats``: the fused head, never a
    T×V tensor). Tied: the LM head is the embedding matrix (``p["embed"]``, the used unit's
    subtree)."""
    w_VxD = p["embed"]["embed_tokens"]["weight"] if cfg.tie_embeddings else p["lm_head"]["weight"]
    return head_stats(rms_norm(x_TxD, p["norm"]["weight"], cfg.rms_eps), w_VxD, mb)
