"""A Qwen2/Qwen3/Llama-style decoder over packed variable-length sequences, as pure unit functions.

Units: ``embed`` (token embedding), ``layers.{i}`` (RMSNorm -> GQA attention with RoPE ->
RMSNorm -> SwiGLU, both residual) and ``head`` (final RMSNorm, LM head and loss, fused).
Qwen3's per-head q/k RMSNorm, Llama's o_proj bias and RoPE scalings (``models.rope``) are
config switches; see docs/models.md.
Parameter names follow Hugging Face's Qwen2 layout below the unit name, so that
``{unit}.{path}`` is also the parameter name of the ``nn.Module`` mirror ``QwenModule``.
Attention runs per sample (causal inside it, never across samples), so its cost is
``sum(s_i^2)`` as the schedule's cost model assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from odcfn._check import check_int
from odcfn.batch import Microbatch
from odcfn.losses import head_stats
from odcfn.model import Model, Unit
from odcfn.models.rope import RopeScaling, apply_rope
from odcfn.tree import PyTree, tree_flatten_with_path, tree_leaves, tree_named_leaves, tree_unflatten

__all__ = ["QwenConfig", "QwenModule", "RopeScaling", "init_params", "qwen_model", "unit_shapes"]


@dataclass(frozen=True)
class QwenConfig:
    """One decoder family: Qwen2/2.5 (``qkv_bias``), Qwen3 (``qk_norm``, free ``head_dim``) and
    Llama 3.x (``rope_scaling``; ``attention_bias`` = ``qkv_bias`` and ``o_bias``)."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    qkv_bias: bool = True  # Qwen2 has q/k/v biases; Llama does not
    # None: d_model // n_heads (Qwen3 sets its own). Resolved at construction, so
    # dataclasses.replace(cfg, d_model=...) keeps the old head_dim: pass head_dim=None to re-derive
    head_dim: int | None = None
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k before RoPE
    o_bias: bool = False  # Llama attention_bias=true also biases o_proj
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False  # the head reads embed's matrix: one parameter, owned by embed
    pad_token_id: int | None = None  # as nn.Embedding's padding_idx: its row gets no embedding grad

    def __post_init__(self) -> None:
        for name, least in (("vocab_size", 1), ("d_model", 1), ("n_layers", 0), ("n_heads", 1),
                            ("n_kv_heads", 1), ("d_ff", 1), ("head_dim", 1)):
            v = getattr(self, name)
            check_int(v, f"QwenConfig.{name}", at_least=least, none_ok=name == "head_dim")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id={self.pad_token_id} is outside [0, vocab_size={self.vocab_size})")
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            got = type(self.rope_scaling).__name__
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {got}")

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for u in unit_shapes(self).values() for s in tree_leaves(u))


def unit_shapes(cfg: QwenConfig) -> dict[str, PyTree]:
    D, V, F_, hd = cfg.d_model, cfg.vocab_size, cfg.d_ff, cfg.head_dim
    S = torch.Size

    def proj(out: int, inp: int, bias: bool) -> dict:
        return {"weight": S([out, inp]), **({"bias": S([out])} if bias else {})}

    layer = {
        "input_layernorm": {"weight": S([D])},
        "self_attn": {
            "q_proj": proj(cfg.n_heads * hd, D, cfg.qkv_bias),
            "k_proj": proj(cfg.n_kv_heads * hd, D, cfg.qkv_bias),
            "v_proj": proj(cfg.n_kv_heads * hd, D, cfg.qkv_bias),
            "o_proj": proj(D, cfg.n_heads * hd, cfg.o_bias),
            **({"q_norm": {"weight": S([hd])}, "k_norm": {"weight": S([hd])}} if cfg.qk_norm else {}),
        },
        "post_attention_layernorm": {"weight": S([D])},
        "mlp": {
            "gate_proj": proj(F_, D, False),
            "up_proj": proj(F_, D, False),
            "down_proj": proj(D, F_, False),
        },
    }
    shapes = {"embed": {"embed_tokens": {"weight": S([V, D])}}}
    for i in range(cfg.n_layers):
        shapes[f"layers.{i}"] = layer
    shapes["head"] = {"norm": {"weight": S([D])}}
    if not cfg.tie_embeddings:
        shapes["head"]["lm_head"] = {"weight": S([V, D])}
    return shapes


def init_params(cfg: QwenConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Deterministic init: normal(0, 0.02) matrices, ones for norms, zeros for biases."""
    g = torch.Generator().manual_seed(seed)

    def init(path: str, shape: torch.Size) -> torch.Tensor:
        if path.endswith("layernorm.weight") or path.endswith("norm.weight"):
            return torch.ones(shape, dtype=dtype)
        if path.endswith("bias"):
            return torch.zeros(shape, dtype=dtype)
        return (torch.randn(shape, generator=g) * 0.02).to(dtype)

    out = {}
    for unit, shapes in unit_shapes(cfg).items():
        names, leaves, treedef = tree_flatten_with_path(shapes)
        out[unit] = tree_unflatten(treedef, [init(n, s) for n, s in zip(names, leaves)])
    return out


# --- the math -----------------------------------------------------------------------------


def rms_norm(x_TxD: torch.Tensor, w_D: torch.Tensor, eps: float) -> torch.Tensor:
    var_T1 = x_TxD.float().pow(2).mean(-1, keepdim=True)
    return (x_TxD.float() * torch.rsqrt(var_T1 + eps)).to(x_TxD.dtype) * w_D


def linear(x: torch.Tensor, p: dict) -> torch.Tensor:
    y = F.linear(x, p["weight"], p.get("bias"))
    if "lora_A" in p:  # a LoRA-adapted projection (odcfn.lora): PEFT's W x + b + scale * B (A x)
        x_a = x
        if "lora_drop" in p:  # LoRA dropout (training): on the A path's input only, as PEFT's
            x_a = x.masked_fill(p["lora_drop"], 0) * p["lora_keep_scale"]
        y = y + F.linear(F.linear(x_a, p["lora_A"]), p["lora_B"]) * p["lora_scale"]
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


def attention(p: dict, x_TxD: torch.Tensor, mb: Microbatch, cfg: QwenConfig) -> torch.Tensor:
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
    return F.embedding(mb.input_ids_T, p["embed_tokens"]["weight"], padding_idx=pad)


def block_fwd(p: dict, x_TxD: torch.Tensor, mb: Microbatch, *, cfg: QwenConfig) -> torch.Tensor:
    h_TxD = x_TxD + attention(
        p["self_attn"], rms_norm(x_TxD, p["input_layernorm"]["weight"], cfg.rms_eps), mb, cfg
    )
    m = p["mlp"]
    n_TxD = rms_norm(h_TxD, p["post_attention_layernorm"]["weight"], cfg.rms_eps)
    return h_TxD + linear(F.silu(linear(n_TxD, m["gate_proj"])) * linear(n_TxD, m["up_proj"]), m["down_proj"])


def head_fwd(p: dict, x_TxD: torch.Tensor, mb: Microbatch, *, cfg: QwenConfig) -> torch.Tensor:
    """The final norm, then the loss seam (``odcfn.losses.head_stats``: the fused head, never a
    T×V tensor). Tied: the LM head is the embedding matrix (``p["embed"]``, the used unit's
    subtree)."""
    w_VxD = p["embed"]["embed_tokens"]["weight"] if cfg.tie_embeddings else p["lm_head"]["weight"]
    return head_stats(rms_norm(x_TxD, p["norm"]["weight"], cfg.rms_eps), w_VxD, mb)


def qwen_model(cfg: QwenConfig, *, dtype: torch.dtype = torch.float32) -> Model:
    shapes = unit_shapes(cfg)
    units = [Unit("embed", partial(embed_fwd, pad=cfg.pad_token_id), shapes["embed"])]
    for i in range(cfg.n_layers):
        units.append(Unit(f"layers.{i}", partial(block_fwd, cfg=cfg), shapes[f"layers.{i}"]))
    uses = ("embed",) if cfg.tie_embeddings else ()
    units.append(Unit("head", partial(head_fwd, cfg=cfg), shapes["head"], uses=uses))
    return Model(tuple(units), dtype=dtype, vocab_size=cfg.vocab_size, config_key=repr(cfg))


# --- the nn.Module mirror (same names, same math) -----------------------------------------


class _UnitModule(nn.Module):
    """Holds one unit's parameters under their pytree names and calls the unit's pure fwd."""

    def __init__(self, shapes: PyTree, fwd) -> None:
        super().__init__()
        self._fwd = fwd
        self._build(self, shapes)

    @staticmethod
    def _build(mod: nn.Module, shapes: dict) -> None:
        for k, v in shapes.items():
            if isinstance(v, torch.Size):
                mod.register_parameter(k, nn.Parameter(torch.zeros(v)))
            else:
                child = nn.Module()
                _UnitModule._build(child, v)
                mod.add_module(k, child)

    def _tree(self, mod: nn.Module | None = None) -> dict:
        mod = self if mod is None else mod
        out = dict(mod.named_parameters(recurse=False))
        for k, child in mod.named_children():
            out[k] = self._tree(child)
        return out

    def forward(self, x, mb: Microbatch, used: dict | None = None):
        return self._fwd({**self._tree(), **(used or {})}, x, mb)


class QwenModule(nn.Module):
    """``nn.Module`` mirror of ``qwen_model``: parameter ``{unit}.{path}`` <-> params[unit][path]."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        shapes = unit_shapes(cfg)
        self.embed = _UnitModule(shapes["embed"], partial(embed_fwd, pad=cfg.pad_token_id))
        self.layers = nn.ModuleList(
            _UnitModule(shapes[f"layers.{i}"], partial(block_fwd, cfg=cfg)) for i in range(cfg.n_layers)
        )
        self.head = _UnitModule(shapes["head"], partial(head_fwd, cfg=cfg))
        self.tied = cfg.tie_embeddings

    def load_params(self, params: dict) -> None:
        sd = {f"{u}.{n}": t for u, sub in params.items() for n, t in tree_named_leaves(sub)}
        self.load_state_dict(sd, strict=True)

    def forward(self, mb: Microbatch) -> torch.Tensor:
        x = self.embed(None, mb)
        for layer in self.layers:
            x = layer(x, mb)
        # tied: the head reads the embedding's own Parameter, so autograd sums both uses
        return self.head(x, mb, {"embed": self.embed._tree()} if self.tied else None)
