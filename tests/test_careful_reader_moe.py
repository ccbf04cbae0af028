"""Issue 40's mixture-of-experts findings, each with the test that would have caught it: a MoE run
in ``odcfn train`` that shows its experts (16), an export that says it drops a learned router bias
(17), a weight-sync recipe that transformers' fused experts take (19) and an ``mlp_only_layers``
naming a layer the model lacks (21). Tiny Qwen3-MoE, 2 threads ranks, seconds."""

from __future__ import annotations

import pytest

from odcfn.models import QwenMoeConfig

SMALL = dict(vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=8)


# --- 21: mlp_only_layers naming a missing layer -----------------------------------------------------


def test_mlp_only_layers_naming_a_missing_layer_is_named():
    """Failed before: ``mlp_only_layers=(5,)`` on 2 layers built a model in which every layer is
    sparse, without a word (a typo'd layer index, or a config meant for a deeper model)."""
    with pytest.warns(UserWarning, match=r"mlp_only_layers names layer\(s\) \[5\] .* 2 layers \(0\.\.1\)"):
        cfg = QwenMoeConfig(**SMALL, mlp_only_layers=(1, 5))
    assert cfg.mlp_only_layers == (1, 5)  # kept as given: transformers' config reads the same
