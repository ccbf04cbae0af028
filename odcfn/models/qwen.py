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
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from odcfn._check import check_int
from odcfn.batch import Microbatch
from odcfn.model import Model, Unit
from odcfn.models.layers import (  # noqa: F401 (re-exported: their historical home)
    attention,
    block_fwd,
    causal_attention,
    embed_fwd,
    head_fwd,
    linear,
    rms_norm,
)
from odcfn.models.moe import expert_name, moe_layer_fwd, moe_layer_shapes, sparse_layers
from odcfn.models.rope import RopeScaling
from odcfn.moe.router import RouterSpec
from odcfn.tree import PyTree, tree_flatten_with_path, tree_leaves, tree_named_leaves, tree_unflatten

__all__ = ["QwenConfig", "QwenModule", "QwenMoeConfig", "RopeScaling", "init_params", "qwen_model",
           "unit_shapes"]


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


@dataclass(frozen=True)
class QwenMoeConfig(QwenConfig):
    """Qwen3-MoE (``qwen3_moe``) and, with a shared expert, Qwen2-MoE (``qwen2_moe``): a
    ``QwenConfig`` whose sparse layers (``odcfn.models.moe.sparse_layers``) replace the dense MLP
    (``d_ff``, transformers' ``intermediate_size``) with ``num_experts`` experts of
    ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token. The field names are
    transformers'. ``router_aux_loss_coef`` counts only when ``output_router_logits`` (as in
    transformers): the loss then adds the coefficient times the mean over the minibatch's
    sequences of each sequence's load-balancing loss."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # > 0: Qwen2-MoE's sigmoid-gated shared expert
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, least in (("num_experts", 1), ("num_experts_per_tok", 1), ("moe_intermediate_size", 1),
                            ("decoder_sparse_step", 1), ("shared_expert_intermediate_size", 0)):
            check_int(getattr(self, name), f"QwenMoeConfig.{name}", at_least=least)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"QwenMoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                             f"num_experts={self.num_experts}")
        layers = tuple(self.mlp_only_layers)
        for i in layers:
            check_int(i, "QwenMoeConfig.mlp_only_layers[*]", at_least=0)
        missing = sorted({i for i in layers if i >= self.n_layers})
        if missing:  # named, not refused: transformers reads such a config.json the same way
            warnings.warn(f"QwenMoeConfig.mlp_only_layers names layer(s) {missing} that the model lacks: "
                          f"it has {self.n_layers} layers (0..{self.n_layers - 1}), so those entries keep no "
                          "layer dense (a typo, or a config meant for a deeper model?)",
                          UserWarning, stacklevel=3)
        object.__setattr__(self, "mlp_only_layers", layers)
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not (0 <= coef < math.inf):
            raise ValueError(f"QwenMoeConfig.router_aux_loss_coef must be a finite number >= 0, got {coef!r}")
        for name in ("norm_topk_prob", "output_router_logits"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"QwenMoeConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: every parameter but the experts its router did
        not choose (``num_params`` less ``num_experts - num_experts_per_tok`` experts per sparse
        layer)."""
        per_expert = 3 * self.d_model * self.moe_intermediate_size
        unused = (self.num_experts - self.num_experts_per_tok) * per_expert * len(sparse_layers(self))
        return self.num_params - unused

    @property
    def active_mlp_params(self) -> int:
        """MLP weights one token multiplies through, over all layers: the top-k experts, the
        shared expert and the router of a sparse layer, the dense MLP of the others (what the
        cost model counts: ``odcfn.schedule.cost.ModelShape``)."""
        D, sparse, J = self.d_model, sparse_layers(self), self.shared_expert_intermediate_size
        per_sparse = 3 * D * self.moe_intermediate_size * self.num_experts_per_tok + D * self.num_experts
        per_sparse += 3 * D * J + D if J else 0
        return len(sparse) * per_sparse + (self.n_layers - len(sparse)) * 3 * D * self.d_ff


def unit_shapes(cfg: QwenConfig) -> dict[str, PyTree]:
    """Each unit's parameter shapes, in model order (a sparse layer's experts before it)."""
    dense = _dense_shapes(cfg)
    if not isinstance(cfg, QwenMoeConfig):
        return dense
    out: dict[str, PyTree] = {}
    sparse = set(sparse_layers(cfg))
    for unit, shapes in dense.items():
        i = int(unit.split(".")[1]) if unit.startswith("layers.") else None
        if i in sparse:
            layer, expert = moe_layer_shapes(cfg, shapes)
            out.update({expert_name(i, e): expert for e in range(cfg.num_experts)})
            shapes = layer
        out[unit] = shapes
    return out


def _dense_shapes(cfg: QwenConfig) -> dict[str, PyTree]:
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


def qwen_model(cfg: QwenConfig, *, dtype: torch.dtype = torch.float32) -> Model:
    """The model of any config ``from_hf`` returns: dense, or a mixture of experts
    (``QwenMoeConfig``: its sparse layers read their expert units on demand)."""
    shapes = unit_shapes(cfg)
    units = [Unit("embed", partial(embed_fwd, pad=cfg.pad_token_id), shapes["embed"])]
    sparse = sparse_layers(cfg) if isinstance(cfg, QwenMoeConfig) else ()
    for i in range(cfg.n_layers):
        name = f"layers.{i}"
        if i in sparse:
            experts = tuple(expert_name(i, e) for e in range(cfg.num_experts))
            units += [Unit(e, _expert_unit, shapes[e]) for e in experts]
            fwd = partial(moe_layer_fwd, cfg=cfg, moe_index=sparse.index(i))
            units.append(Unit(name, fwd, shapes[name], experts=experts))
        else:
            units.append(Unit(name, partial(block_fwd, cfg=cfg), shapes[name]))
    uses = ("embed",) if cfg.tie_embeddings else ()
    units.append(Unit("head", partial(head_fwd, cfg=cfg), shapes["head"], uses=uses))
    router = None
    if sparse:
        coef = cfg.router_aux_loss_coef if cfg.output_router_logits else 0.0
        router = RouterSpec(len(sparse), cfg.num_experts, cfg.num_experts_per_tok, float(coef))
    return Model(tuple(units), dtype=dtype, vocab_size=cfg.vocab_size, config_key=repr(cfg), router=router)


def _expert_unit(p: dict, x: object, mb: Microbatch) -> object:
    """An expert unit is read through its layer's expert source, never run as a chain step."""
    raise RuntimeError("an expert unit is not a step of the forward chain (Unit.experts)")


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
        if isinstance(cfg, QwenMoeConfig):
            raise TypeError("QwenModule mirrors dense models only; use qwen_model(cfg) for a QwenMoeConfig")
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
