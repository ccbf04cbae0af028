"""Qwen3-MoE and Qwen2-MoE decoders as pure unit functions (``QwenMoeConfig``).

Units: ``embed``; per layer ``layers.{i}`` (attention, the post-attention norm and the MLP:
dense, or the router with its experts) and, for a sparse layer, one unit per expert
``layers.{i}.experts.{e}`` (``gate_proj``/``up_proj``/``down_proj``, Hugging Face's names);
``head``. An expert unit is not a step of the forward chain: its layer reads it *on demand*
(``Unit.experts``), after the router has chosen, through the expert source the runtime passes
as ``p["experts"]`` (``odcfn.moe.experts``). So each expert is sharded, gathered, pushed and
optimised like any unit, and a rank gathers only the experts its tokens route to.

Which layers are sparse follows transformers: layer i is sparse unless ``i in mlp_only_layers``,
when ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``; the others have a dense MLP
of ``d_ff`` (``intermediate_size``). Qwen2-MoE adds a shared expert of
``shared_expert_intermediate_size`` scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from odcfn.batch import Microbatch
from odcfn.models.layers import attention, rms_norm, swiglu
from odcfn.moe.router import ROUTED_EXTRA, route

__all__ = ["ROUTED_EXTRA", "expert_name", "moe_layer_fwd", "moe_layer_shapes", "sparse_layers"]


def sparse_layers(cfg) -> tuple[int, ...]:
    """Indices of the layers whose MLP is a mixture of experts (transformers' rule)."""
    return tuple(
        i for i in range(cfg.n_layers)
        if i not in cfg.mlp_only_layers and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0
    )


def expert_name(layer: int, expert: int) -> str:
    return f"layers.{layer}.experts.{expert}"


def moe_layer_shapes(cfg, dense_layer: dict) -> tuple[dict, dict]:
    """``(layer unit shapes, one expert's shapes)`` of a sparse layer, from the dense layer's."""
    D, E, I_ = cfg.d_model, cfg.num_experts, cfg.moe_intermediate_size
    S = torch.Size
    mlp: dict = {"gate": {"weight": S([E, D])}}
    if cfg.shared_expert_intermediate_size:
        J = cfg.shared_expert_intermediate_size
        mlp["shared_expert"] = {"gate_proj": {"weight": S([J, D])}, "up_proj": {"weight": S([J, D])},
                                "down_proj": {"weight": S([D, J])}}
        mlp["shared_expert_gate"] = {"weight": S([1, D])}
    expert = {"gate_proj": {"weight": S([I_, D])}, "up_proj": {"weight": S([I_, D])},
              "down_proj": {"weight": S([D, I_])}}
    return {**dense_layer, "mlp": mlp}, expert


def moe_layer_fwd(p: dict, x_TxD: torch.Tensor, mb: Microbatch, *, cfg, moe_index: int) -> torch.Tensor:
    """A sparse decoder layer. ``p["experts"]``: the expert source; ``moe_index``: this layer's
    position among the sparse layers (its column of ``extras["routed_experts"]``)."""
    h_TxD = x_TxD + attention(
        p["self_attn"], rms_norm(x_TxD, p["input_layernorm"]["weight"], cfg.rms_eps), mb, cfg
    )
    n_TxD = rms_norm(h_TxD, p["post_attention_layernorm"]["weight"], cfg.rms_eps)
    m, source = p["mlp"], p["experts"]
    logits_TxE = F.linear(n_TxD, m["gate"]["weight"])
    replay = mb.extras.get(ROUTED_EXTRA)
    idx_TxK, w_TxK = route(
        logits_TxE, cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob, layer=moe_index,
        log=source.log, replay_TxK=None if replay is None else replay[:, moe_index],
        bias_E=None if source.log is None or source.log.bias is None else source.log.bias[moe_index],
    )
    y_TxD = source.apply(n_TxD, idx_TxK, w_TxK)
    if "shared_expert" in m:
        gate_Tx1 = torch.sigmoid(F.linear(n_TxD, m["shared_expert_gate"]["weight"]))
        y_TxD = y_TxD + gate_Tx1 * swiglu(m["shared_expert"], n_TxD)
    return h_TxD + y_TxD
