"""The mixture-of-experts half of the Hugging Face bridge: Qwen3-MoE (``qwen3_moe``) and Qwen2-MoE
(``qwen2_moe``) ``config.json`` fields <-> ``QwenMoeConfig``, and the fused expert layout.

Config names. The Hub's files say ``num_experts``; transformers 5 writes Qwen3-MoE's as
``num_local_experts`` (its ``attribute_map``): both are read, ``num_experts`` is written (both
transformers versions read it). Fields a file omits take transformers' class defaults for its
``model_type`` (Qwen2-MoE always has a shared expert: 5632 wide unless given). MoE fields of other
families (Mixtral's router jitter, DeepSeek's grouped routing, shared-expert counts, scaled or
biased routers, ...) change the routing and are refused by name.

Expert layout. The Hub (and transformers 5's ``save_pretrained``, through its conversion mapping)
stores one tensor per expert and projection, ``model.layers.{i}.mlp.experts.{e}.{proj}.weight``,
which is odcfn's ``hf_name`` of the expert unit ``layers.{i}.experts.{e}``. transformers 5 holds
them fused in memory, ``mlp.experts.gate_up_proj`` (E, 2I, D) = per expert cat(gate, up) and
``mlp.experts.down_proj`` (E, D, I), and a state dict saved as is has those names: ``unfuse``
presents each expert's slice under its Hub name, so the loader, its checks and ``shard_from_hf``'s
row-range reads work unchanged and read only the rows they need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from odcfn._check import is_int, is_number
from odcfn.models.moe import sparse_layers
from odcfn.models.qwen import QwenMoeConfig

__all__ = ["MOE_ARCHITECTURES", "MOE_REFUSED", "moe_fields_from_hf", "moe_fields_to_hf", "moe_model_type",
           "unfuse"]

MOE_ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

# transformers' class defaults (Qwen2MoeConfig / Qwen3MoeConfig) for the fields a file may omit
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "intermediate_size": 6144, "shared_expert_intermediate_size": 0},
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                  "intermediate_size": 5632, "shared_expert_intermediate_size": 5632},
}
_COMMON = {"decoder_sparse_step": 1, "norm_topk_prob": False, "output_router_logits": False,
           "router_aux_loss_coef": 0.001, "mlp_only_layers": []}

# MoE fields of other families, each with the value under which it changes nothing: a Qwen-MoE
# config carrying another value asks for routing or experts that QwenMoeConfig does not compute
MOE_REFUSED: dict[str, tuple[Any, str]] = {
    "router_jitter_noise": (0.0, "router jitter noise"),
    "n_shared_experts": (None, "DeepSeek-style shared experts"),
    "num_shared_experts": (None, "several shared experts"),
    "routed_scaling_factor": (1.0, "scaled routed-expert outputs"),
    "first_k_dense_replace": (0, "leading dense layers (first_k_dense_replace)"),
    "moe_layer_freq": (1, "a MoE layer frequency other than decoder_sparse_step"),
    "n_group": (None, "group-limited routing"),
    "topk_group": (None, "group-limited routing"),
    "topk_method": ("greedy", "a top-k method other than plain top-k"),
    "scoring_func": ("softmax", "router scoring other than softmax"),
    "moe_router_enable_expert_bias": (False, "a router score bias"),
    "router_bias": (False, "a router bias"),
    "expert_bias": (False, "expert biases"),
    "num_experts_per_token": (None, "a top-k field other than num_experts_per_tok"),
}


def _experts(hf: dict[str, Any], default: int) -> Any:
    """``num_experts`` under either name; both present must agree."""
    a, b = hf.get("num_experts"), hf.get("num_local_experts")
    if a is not None and b is not None and a != b:
        raise ValueError(f"config.json num_experts={a!r} and num_local_experts={b!r} disagree")
    return default if a is None and b is None else (a if a is not None else b)


def moe_fields_from_hf(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    """``QwenMoeConfig``'s MoE fields from a ``qwen3_moe``/``qwen2_moe`` config.json, checked with
    errors that name the field (before ``QwenMoeConfig`` would name its own)."""
    d = {**_COMMON, **_DEFAULTS[kind]}

    def get(k: str) -> Any:
        return d[k] if hf.get(k) is None else hf[k]

    out: dict[str, Any] = {"num_experts": _experts(hf, d["num_experts"])}
    for k in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
        out[k] = get(k)
    for k, v in out.items():
        if not is_int(v) or v < 1:
            raise ValueError(f"config.json {k}={v!r} must be an integer >= 1")
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise ValueError(f"config.json num_experts_per_tok={out['num_experts_per_tok']} exceeds "
                         f"num_experts={out['num_experts']}: a token cannot pick more experts than exist")
    # transformers' Qwen3-MoE has no shared expert and ignores the field; Qwen2-MoE always has one
    shared = get("shared_expert_intermediate_size") if kind == "qwen2_moe" else 0
    if not is_int(shared) or (kind == "qwen2_moe" and shared < 1):
        raise ValueError(f"config.json shared_expert_intermediate_size={shared!r}: Qwen2-MoE's shared "
                         "expert must be an integer >= 1 wide")
    out["shared_expert_intermediate_size"] = shared
    layers = get("mlp_only_layers")
    if not isinstance(layers, (list, tuple)) or not all(is_int(i) and i >= 0 for i in layers):
        raise ValueError(f"config.json mlp_only_layers={layers!r} must be a list of layer indices >= 0")
    out["mlp_only_layers"] = tuple(layers)
    for k in ("norm_topk_prob", "output_router_logits"):
        if not isinstance(get(k), bool):
            raise ValueError(f"config.json {k}={get(k)!r} must be true or false")
        out[k] = get(k)
    coef = get("router_aux_loss_coef")
    if not is_number(coef) or not 0 <= coef < float("inf"):
        raise ValueError(f"config.json router_aux_loss_coef={coef!r} must be a finite number >= 0")
    out["router_aux_loss_coef"] = float(coef)
    return out


def moe_model_type(cfg: QwenMoeConfig) -> str:
    """The Hugging Face MoE family that computes ``cfg``; a ``ValueError`` when none does."""
    if cfg.qk_norm:
        if cfg.shared_expert_intermediate_size:
            raise ValueError("Qwen3-MoE (qk_norm) has no shared expert: set "
                             "shared_expert_intermediate_size=0")
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("Qwen3-MoE (qk_norm) biases q/k/v and o together: set qkv_bias == o_bias")
        return "qwen3_moe"
    if not cfg.shared_expert_intermediate_size:
        raise ValueError("a MoE config without qk_norm is Qwen2-MoE, which has a shared expert: set "
                         "shared_expert_intermediate_size > 0 (or qk_norm=True for Qwen3-MoE)")
    if cfg.o_bias:
        raise ValueError("Qwen2-MoE has no o_proj bias: set o_bias=False")
    return "qwen2_moe"


def moe_fields_to_hf(cfg: QwenMoeConfig, kind: str) -> dict[str, Any]:
    """Every MoE field of ``cfg`` (and the family's bias switch) under transformers' names."""
    out: dict[str, Any] = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": cfg.output_router_logits,
        "use_sliding_window": False,
    }
    if kind == "qwen2_moe":  # Qwen2-MoE reads qkv_bias (transformers 5; 4.x always biases q/k/v)
        out["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        out["qkv_bias"] = cfg.qkv_bias
    return out


class _ExpertSlice:
    """One expert's ``(rows, cols)`` matrix inside a fused ``(E, R, cols)`` tensor, answering the
    calls the loader makes on a safetensors handle (``get_slice(name)`` for the shape and row
    ranges, ``get_tensor(name)``) by reading only that expert's rows of the fused tensor."""

    def __init__(self, handle: Any, fused: str, expert: int, lo: int, hi: int, cols: int) -> None:
        self.handle, self.fused, self.expert = handle, fused, expert
        self.lo, self.hi, self.cols = lo, hi, cols

    def get_slice(self, name: str) -> _ExpertSlice:
        return self

    def get_shape(self) -> list[int]:
        return [self.hi - self.lo, self.cols]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, step = rows.indices(self.hi - self.lo)
        if step != 1:
            raise ValueError("an expert slice reads contiguous row ranges only")
        return self.handle.get_slice(self.fused)[self.expert, self.lo + start : self.lo + stop]

    def get_tensor(self, name: str) -> torch.Tensor:
        return self[:]


def unfuse(where: dict[str, Any], cfg: QwenMoeConfig, root: Path) -> dict[str, Any]:
    """``where`` (HF name -> handle) with each sparse layer's fused ``gate_up_proj``/``down_proj``
    replaced by per-expert entries under the Hub's names; checked, so a fused tensor of the wrong
    shape is reported under its own name."""
    out = dict(where)
    E, I_, D = cfg.num_experts, cfg.moe_intermediate_size, cfg.d_model
    for i in sparse_layers(cfg):
        base = f"model.layers.{i}.mlp.experts."
        gu, dn = base + "gate_up_proj", base + "down_proj"
        if gu not in where and dn not in where:
            continue
        if gu not in where or dn not in where:
            have, lack = (gu, dn) if gu in where else (dn, gu)
            raise ValueError(f"{root}: fused expert tensor {have!r} without {lack!r}")
        for name, want in ((gu, (E, 2 * I_, D)), (dn, (E, D, I_))):
            got = tuple(where[name].get_slice(name).get_shape())
            if got != want:
                raise ValueError(f"{root}: fused expert tensor {name!r} has shape {got}, config.json implies "
                                 f"{want} (num_experts, 2*moe_intermediate_size or hidden_size, ...)")
        both = sorted(k for k in where if k.startswith(base) and k not in (gu, dn))
        if both:
            raise ValueError(f"{root}: layer {i} holds its experts both fused ({gu!r}) and per expert "
                             f"({both[0]!r})")
        del out[gu], out[dn]
        for e in range(E):
            out[f"{base}{e}.gate_proj.weight"] = _ExpertSlice(where[gu], gu, e, 0, I_, D)
            out[f"{base}{e}.up_proj.weight"] = _ExpertSlice(where[gu], gu, e, I_, 2 * I_, D)
            out[f"{base}{e}.down_proj.weight"] = _ExpertSlice(where[dn], dn, e, 0, D, I_)
    return out
