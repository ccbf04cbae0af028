"""The decoder's forward over a key/value cache: a packed prefill of new prompts, then one token
per live sequence per step.

The math is the training model's (``odcfn.models.layers``: ``rms_norm``, ``linear``,
``causal_attention``, ``swiglu``; ``odcfn.models.rope``; ``odcfn.moe.route`` and
``LocalExperts``), composed the way ``block_fwd`` / ``moe_layer_fwd`` compose it. Only the
bookkeeping differs: keys and values are written into the cache, a decode step's single query
attends over its own sequence's cached positions, and RoPE's tables are computed once per
forward rather than per layer (every layer rotates at the same positions). So the hidden states
equal a full forward of the prefix through the model's units up to floating-point summation
order (the tests check that, step by step).

The cache holds one row per live sequence, ``k_BxGxCxK`` per layer, ``C`` the largest
reservation (prompt + new tokens) among the live rows; rows are rebuilt (kept rows copied, new
rows added, finished rows dropped) only when the batch's membership changes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from odcfn.models.layers import causal_attention, linear, rms_norm, swiglu
from odcfn.models.moe import expert_name, sparse_layers
from odcfn.models.qwen import QwenConfig, QwenMoeConfig
from odcfn.models.rope import rope_tables, rotate
from odcfn.moe import LocalExperts, route

__all__ = ["KVCache", "Weights", "decode", "logits", "make_weights", "prefill"]


@dataclass(frozen=True)
class Weights:
    """What the engine samples with. ``params``: the base model's full params (unit name ->
    tree) on one device in one dtype; ``experts``: sparse layer index -> its experts' trees (the
    expert units, in expert order); ``moe_index``: sparse layer index -> its column of the
    routing record; ``router_bias_LxE``: aux-loss-free balancing's bias (``TrainState
    .router_bias``), which shifts the top-k choice as in training, or None."""

    cfg: QwenConfig
    params: Mapping[str, dict]
    experts: Mapping[int, list[dict]]
    moe_index: Mapping[int, int]
    router_bias_LxE: torch.Tensor | None

    @property
    def head_VxD(self) -> torch.Tensor:
        if self.cfg.tie_embeddings:  # the head reads the embedding's matrix, as head_fwd does
            return self.params["embed"]["embed_tokens"]["weight"]
        return self.params["head"]["lm_head"]["weight"]


def make_weights(cfg: QwenConfig, params: Mapping[str, dict], router_bias: torch.Tensor | None) -> Weights:
    sparse = sparse_layers(cfg) if isinstance(cfg, QwenMoeConfig) else ()
    experts = {i: [params[expert_name(i, e)] for e in range(cfg.num_experts)] for i in sparse}
    return Weights(cfg, params, experts, {i: j for j, i in enumerate(sparse)}, router_bias)


class KVCache:
    """Per layer, the keys and values of the live sequences: ``k[l]``, ``v[l]`` of shape
    ``(B, G, C, K)``; row ``b`` is live sequence ``b``. Positions past a row's length hold zeros
    (masked out of attention; zeros rather than ``empty`` so that a masked weight of 0 never
    meets a NaN)."""

    def __init__(self, cfg: QwenConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.shape_GK = (cfg.n_kv_heads, cfg.head_dim)
        self.dtype, self.device = dtype, device
        G, K = self.shape_GK
        empty = torch.zeros(0, G, 0, K, dtype=dtype, device=device)
        self.k = [empty] * cfg.n_layers
        self.v = [empty] * cfg.n_layers

    @property
    def rows(self) -> int:
        return self.k[0].shape[0] if self.k else 0

    def rebuild(self, keep: Sequence[int], used: int, add: int, capacity: int) -> None:
        """Keep rows ``keep`` (in that order; their first ``used`` positions are copied), then
        ``add`` fresh rows, all of ``capacity`` positions."""
        G, K = self.shape_GK
        idx = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        n = min(used, capacity)
        for cache in (self.k, self.v):
            for layer, old in enumerate(cache):
                new = torch.zeros(len(keep) + add, G, capacity, K, dtype=self.dtype, device=self.device)
                if len(keep) and n:
                    new[: len(keep), :, :n] = old.index_select(0, idx)[:, :, :n]
                cache[layer] = new


def _qkv(
    a: dict, n_TxD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cfg: QwenConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries ``TxHxK``, keys and values ``TxGxK`` as ``odcfn.models.layers.attention`` makes
    them (RoPE tables ``cos``/``sin`` of shape ``TxK``)."""
    T, K = n_TxD.shape[0], cfg.head_dim
    q_TxHxK = linear(n_TxD, a["q_proj"]).view(T, -1, K)
    k_TxGxK = linear(n_TxD, a["k_proj"]).view(T, -1, K)
    v_TxGxK = linear(n_TxD, a["v_proj"]).view(T, -1, K)
    if cfg.qk_norm:
        q_TxHxK = rms_norm(q_TxHxK, a["q_norm"]["weight"], cfg.rms_eps)
        k_TxGxK = rms_norm(k_TxGxK, a["k_norm"]["weight"], cfg.rms_eps)
    cos, sin = cos[:, None], sin[:, None]  # one angle per row (position), every head alike
    return rotate(q_TxHxK, cos, sin), rotate(k_TxGxK, cos, sin), v_TxGxK


def _mlp(w: Weights, i: int, h_TxD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layer ``i``'s residual MLP half (dense, or routed like ``moe_layer_fwd``); returns the
    layer's output and, for a sparse layer, the experts each row was routed to."""
    cfg, p = w.cfg, w.params[f"layers.{i}"]
    n_TxD = rms_norm(h_TxD, p["post_attention_layernorm"]["weight"], cfg.rms_eps)
    if i not in w.experts:
        return h_TxD + swiglu(p["mlp"], n_TxD), None
    m, j = p["mlp"], w.moe_index[i]
    bias_E = None if w.router_bias_LxE is None else w.router_bias_LxE[j]
    idx_TxK, w_TxK = route(F.linear(n_TxD, m["gate"]["weight"]), cfg.num_experts_per_tok,
                           norm_topk_prob=cfg.norm_topk_prob, layer=j, log=None, bias_E=bias_E)
    y_TxD = LocalExperts(w.experts[i]).apply(n_TxD, idx_TxK, w_TxK)
    if "shared_expert" in m:  # Qwen2-MoE
        gate_Tx1 = torch.sigmoid(F.linear(n_TxD, m["shared_expert_gate"]["weight"]))
        y_TxD = y_TxD + gate_Tx1 * swiglu(m["shared_expert"], n_TxD)
    return h_TxD + y_TxD, idx_TxK


def _routed(idx: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.stack(idx, dim=1) if idx else None  # (T, MoE layers, top-k)


def _tables(w: Weights, positions_T: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos/sin for these positions, once per forward (every layer rotates at the same ones)."""
    cfg = w.cfg
    return rope_tables(positions_T, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, like.dtype)


@torch.no_grad()
def prefill(
    w: Weights, cache: KVCache, rows: Sequence[int], ids_T: torch.Tensor, seqlens: Sequence[int],
    *, every_position: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run new prompts, packed end to end in ``ids_T``, into cache rows ``rows`` (one per
    prompt). Returns the final-normed hidden state of each prompt's last position (``SxD``; of
    every position, ``TxD``, with ``every_position``) and the routing record of every prompt
    position (``TxLxK``, None for a dense model)."""
    cfg, seqlens = w.cfg, [int(s) for s in seqlens]
    positions_T = torch.cat([torch.arange(s, device=ids_T.device) for s in seqlens])
    x_TxD = F.embedding(ids_T, w.params["embed"]["embed_tokens"]["weight"])
    cos, sin = _tables(w, positions_T, x_TxD)
    routed = []
    for i in range(cfg.n_layers):
        p = w.params[f"layers.{i}"]
        a = p["self_attn"]
        q_TxHxK, k_TxGxK, v_TxGxK = _qkv(a, rms_norm(x_TxD, p["input_layernorm"]["weight"], cfg.rms_eps),
                                         cos, sin, cfg)
        q_HxTxK, k_GxTxK, v_GxTxK = q_TxHxK.transpose(0, 1), k_TxGxK.transpose(0, 1), v_TxGxK.transpose(0, 1)
        ks, vs = k_GxTxK.split(seqlens, dim=1), v_GxTxK.split(seqlens, dim=1)
        for r, s, k, v in zip(rows, seqlens, ks, vs):
            cache.k[i][r, :, :s] = k
            cache.v[i][r, :, :s] = v
        # per prompt, causal inside it: training's own attention kernel
        qs = q_HxTxK.split(seqlens, dim=1)
        o_HxTxK = torch.cat([causal_attention(q, k, v) for q, k, v in zip(qs, ks, vs)], dim=1)
        h_TxD = x_TxD + linear(o_HxTxK.transpose(0, 1).reshape(x_TxD.shape[0], -1), a["o_proj"])
        x_TxD, idx = _mlp(w, i, h_TxD)
        if idx is not None:
            routed.append(idx)
    if not every_position:
        x_TxD = x_TxD[torch.tensor(seqlens, device=ids_T.device).cumsum(0) - 1]
    return rms_norm(x_TxD, w.params["head"]["norm"]["weight"], cfg.rms_eps), _routed(routed)


@torch.no_grad()
def decode(
    w: Weights, cache: KVCache, ids_B: torch.Tensor, positions_B: torch.Tensor, length: int, *,
    masked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per cache row: token ``ids_B[b]`` at position ``positions_B[b]`` (its row's
    cached length) is written into the cache and attends over its row's positions
    ``<= positions_B[b]``. ``length``: ``max(positions_B) + 1`` (passed in so that the step needs
    no device-to-host read). ``masked=False``: the caller knows every row is at position
    ``length - 1``, so each attends over all ``length`` positions and the attention needs no mask
    (its kernel is faster without one). Returns the final-normed hidden states (``BxD``) and the
    routing record of the fed tokens (``BxLxK`` or None)."""
    cfg = w.cfg
    B = ids_B.shape[0]
    rows_B = torch.arange(B, device=ids_B.device)
    mask_Bx1x1xL = None
    if masked:
        upto_BxL = torch.arange(length, device=ids_B.device)[None] <= positions_B[:, None]
        mask_Bx1x1xL = upto_BxL[:, None, None]
    gqa = cfg.n_heads != cfg.n_kv_heads
    x_BxD = F.embedding(ids_B, w.params["embed"]["embed_tokens"]["weight"])
    cos, sin = _tables(w, positions_B, x_BxD)
    routed = []
    for i in range(cfg.n_layers):
        p = w.params[f"layers.{i}"]
        a = p["self_attn"]
        # the B tokens are a "sequence" of B rows to the projections: each row has its own position
        q_BxHxK, k_BxGxK, v_BxGxK = _qkv(a, rms_norm(x_BxD, p["input_layernorm"]["weight"], cfg.rms_eps),
                                         cos, sin, cfg)
        cache.k[i][rows_B, :, positions_B] = k_BxGxK
        cache.v[i][rows_B, :, positions_B] = v_BxGxK
        o_BxHx1xK = F.scaled_dot_product_attention(
            q_BxHxK[:, :, None], cache.k[i][:, :, :length], cache.v[i][:, :, :length], attn_mask=mask_Bx1x1xL,
            enable_gqa=gqa,
        )
        h_BxD = x_BxD + linear(o_BxHx1xK.reshape(B, -1), a["o_proj"])
        x_BxD, idx = _mlp(w, i, h_BxD)
        if idx is not None:
            routed.append(idx)
    return rms_norm(x_BxD, w.params["head"]["norm"]["weight"], cfg.rms_eps), _routed(routed)


def logits(w: Weights, h_NxD: torch.Tensor) -> torch.Tensor:
    """fp32 logits, computed as the training head computes them (``F.linear`` in the compute
    dtype, then fp32: ``odcfn.kernels.fused_head.unfused_head``)."""
    return F.linear(h_NxD, w.head_VxD).float()
