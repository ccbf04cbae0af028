"""Hugging Face ``config.json`` <-> ``QwenConfig`` for the Qwen2/2.5, Qwen3 (dense) and Llama 3.x
families, and ``QwenMoeConfig`` for Qwen3-MoE and Qwen2-MoE (their MoE fields: ``hf_moe``).

Every field that changes the math is either mapped or refused by name: a checkpoint this
cannot compute exactly (sliding-window layers, other mixtures of experts, multimodal RoPE, dynamic or
long RoPE, partial rotary, soft-capping, attention dropout, quantised weights, ...) raises a
``ValueError`` naming the field, instead of loading as a different model. Missing fields take
the defaults of transformers' config class for that ``model_type`` (Qwen3's ``head_dim`` is
128 unless given; Llama's ``max_position_embeddings`` is 2048).
"""

from __future__ import annotations

from typing import Any

import torch

from odcfn.models.hf_moe import (
    MOE_ARCHITECTURES,
    MOE_REFUSED,
    moe_fields_from_hf,
    moe_fields_to_hf,
    moe_model_type,
)
from odcfn.models.qwen import QwenConfig, QwenMoeConfig
from odcfn.models.rope import ROPE_KINDS, RopeScaling

__all__ = ["ARCHITECTURES", "MAX_POSITIONS", "config_from_hf", "config_to_hf"]

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# transformers' class defaults
MAX_POSITIONS = {"qwen2": 32768, "qwen3": 32768, "llama": 2048, "qwen2_moe": 32768, "qwen3_moe": 32768}
_MOE = {  # mixtures of experts odcfn does not compute
    "qwen3_next": "Qwen3-Next",
    "mixtral": "Mixtral",
    "llama4": "Llama 4",
}

# fields whose non-default value changes the computation, each with the value that does not
# (the MoE ones are refused in a dense family, mapped in a MoE one)
_MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
_REFUSED: dict[str, tuple[Any, str]] = {
    "use_sliding_window": (False, "sliding-window attention"),
    "mlp_bias": (False, "MLP biases"),
    "attention_dropout": (0.0, "attention dropout (training here is dropout-free)"),
    "num_experts": (None, "mixture of experts"),
    "num_local_experts": (None, "mixture of experts"),
    "num_experts_per_tok": (None, "mixture of experts"),
    "moe_intermediate_size": (None, "mixture of experts"),
    "partial_rotary_factor": (1.0, "partial rotary embeddings"),
    "attn_logit_softcapping": (None, "attention logit soft-capping"),
    "final_logit_softcapping": (None, "logit soft-capping"),
    "dual_chunk_attention_config": (None, "dual-chunk attention"),
    "quantization_config": (None, "quantised weights"),
    "no_rope_layers": (None, "layers without RoPE"),
}


def _rope(hf: dict[str, Any], kind: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)``, read as transformers does: ``rope_scaling`` (older configs)
    wins over ``rope_parameters`` (transformers >= 5); ``rope_theta`` inside it wins over the
    top-level one."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rp = hf.get(key) or {}
    if not isinstance(rp, dict):
        raise ValueError(f"config.json {key} must be an object, got {rp!r}")
    theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if "mrope_section" in rp or rope_type == "mrope":
        raise ValueError(f"config.json {key}.mrope_section: multimodal RoPE (mrope) is not supported")
    if rp.get("partial_rotary_factor", 1.0) != 1.0:
        factor = rp["partial_rotary_factor"]
        raise ValueError(f"config.json {key}.partial_rotary_factor={factor}: partial rotary is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_KINDS:
        raise ValueError(
            f"config.json {key}.rope_type={rope_type!r} is not supported; "
            f"supported: 'default', {', '.join(repr(k) for k in ROPE_KINDS)}"
        )
    orig = rp.get("original_max_position_embeddings")
    if orig is None and rope_type in ("llama3", "yarn"):
        orig = hf.get("max_position_embeddings", MAX_POSITIONS[kind])
    factor = rp.get("factor")
    if factor is None and rope_type == "yarn":  # transformers: the context extension ratio
        factor = hf.get("max_position_embeddings", MAX_POSITIONS[kind]) / orig
    if factor is None:
        raise ValueError(f"config.json {key} with rope_type={rope_type!r} lacks 'factor'")
    try:
        return theta, RopeScaling(
            kind=rope_type,
            factor=float(factor),
            original_max_position_embeddings=None if orig is None else int(orig),
            low_freq_factor=rp.get("low_freq_factor"),
            high_freq_factor=rp.get("high_freq_factor"),
            beta_fast=float(rp.get("beta_fast") or 32.0),
            beta_slow=float(rp.get("beta_slow") or 1.0),
            attention_factor=rp.get("attention_factor"),
            mscale=rp.get("mscale"),
            mscale_all_dim=rp.get("mscale_all_dim"),
            truncate=bool(rp.get("truncate", True)),
        )
    except ValueError as e:
        raise ValueError(f"config.json {key}: {e}") from None


def _pad(hf: dict[str, Any]) -> int | None:
    """transformers builds ``nn.Embedding(vocab, d, padding_idx=pad_token_id)``: that row gets no
    gradient from the embedding (a negative id counts from the end, as there)."""
    pad = hf.get("pad_token_id")
    if pad is None:
        return None
    pad = int(pad)
    return pad + int(hf.get("vocab_size") or 0) if pad < 0 else pad  # nn.Embedding's reading


def config_from_hf(hf: dict[str, Any]) -> QwenConfig:
    """A ``QwenConfig`` from a Hugging Face ``config.json`` dict (Qwen2/2.5, Qwen3, Llama), or a
    ``QwenMoeConfig`` (Qwen3-MoE, Qwen2-MoE)."""
    kind = hf.get("model_type")
    if kind in _MOE:
        raise ValueError(f"config.json model_type={kind!r}: {_MOE[kind]} (mixture of experts) is unsupported")
    if kind not in ARCHITECTURES and kind not in MOE_ARCHITECTURES:
        known = sorted([*ARCHITECTURES, *MOE_ARCHITECTURES])
        raise ValueError(f"config.json model_type={kind!r} is not supported; expected one of {known}")
    moe = kind in MOE_ARCHITECTURES
    refused = _REFUSED
    if moe:
        refused = {**{k: v for k, v in _REFUSED.items() if k not in _MOE_FIELDS}, **MOE_REFUSED}
    for field, (ok, what) in refused.items():
        value = hf.get(field, ok)
        if value is not None and value != ok and not (ok is None and value in (0, {}, [])):
            raise ValueError(f"config.json {field}={value!r}: {what} is not supported")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise ValueError(f"config.json layer_types={sorted(layer_types)}: only full attention is supported")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json hidden_act={act!r} is not supported (SwiGLU with silu only)")
    theta, scaling = _rope(hf, kind)
    bias = bool(hf.get("attention_bias", False))
    extra: dict[str, Any] = {}
    if moe:
        extra = moe_fields_from_hf(hf, kind)
        if hf.get("intermediate_size") is None:  # the dense layers' width: the class default
            hf = {**hf, "intermediate_size": {"qwen3_moe": 6144, "qwen2_moe": 5632}[kind]}
    # the attention's biases: Qwen2 biases q/k/v always, Qwen2-MoE per its qkv_bias (transformers
    # 5; 4.x always), neither biases o_proj; Qwen3(-MoE) and Llama bias all four per attention_bias
    qkv_bias = {"qwen2": True, "qwen2_moe": bool(hf.get("qkv_bias", True))}.get(kind, bias)
    try:
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        # Qwen3 defaults to 128; Qwen3-MoE (like the others) to hidden_size / heads
        head_dim = hf.get("head_dim") or (128 if kind == "qwen3" else None)
        return (QwenMoeConfig if moe else QwenConfig)(
            vocab_size=int(hf["vocab_size"]),
            d_model=d,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            d_ff=int(hf["intermediate_size"]),
            rope_theta=theta,
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qkv_bias=qkv_bias,
            head_dim=None if head_dim is None else int(head_dim),
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            o_bias=False if kind in ("qwen2", "qwen2_moe") else bias,
            rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            pad_token_id=_pad(hf),
            **extra,
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"config.json: {e}") from None


def model_type(cfg: QwenConfig) -> str:
    """The one Hugging Face family that computes ``cfg``; a ``ValueError`` when none does."""
    if isinstance(cfg, QwenMoeConfig):
        return moe_model_type(cfg)
    if cfg.qk_norm:
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("Qwen3 (qk_norm) biases q/k/v and o together: set qkv_bias == o_bias")
        return "qwen3"
    if cfg.qkv_bias and not cfg.o_bias:
        return "qwen2"
    if cfg.qkv_bias == cfg.o_bias:
        return "llama"
    raise ValueError("o_bias without qkv_bias has no Hugging Face equivalent")


def config_to_hf(cfg: QwenConfig, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict transformers reads back as the same computation."""
    kind = model_type(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling.to_hf(), "rope_theta": cfg.rope_theta}
    out = {
        "architectures": [{**ARCHITECTURES, **MOE_ARCHITECTURES}[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_ff,
        "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta,  # read by transformers < 5
        "rope_parameters": rope,
        "rms_norm_eps": cfg.rms_eps,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "pad_token_id": cfg.pad_token_id,
        # the family's default context, stated: inference engines read it rather than assume it
        "max_position_embeddings": MAX_POSITIONS[kind],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if isinstance(cfg, QwenMoeConfig):
        out.update(moe_fields_to_hf(cfg, kind))
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = rope  # the key transformers < 5 reads
        if cfg.rope_scaling.kind == "yarn":  # the extended context the factor stands for
            s = cfg.rope_scaling
            out["max_position_embeddings"] = round(s.factor * s.original_max_position_embeddings)
    return out
