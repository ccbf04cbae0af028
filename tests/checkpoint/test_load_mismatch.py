"""A checkpoint loaded into another model names the parameter, both shapes and the config
fields that decide that shape, not only the unit."""

from __future__ import annotations

import pytest

import odcfn
from odcfn.checkpoint.sharded import read_shards, write_shards
from odcfn.models import QwenConfig, init_params, qwen_model

SAVED = QwenConfig(vocab_size=19, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=12)


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        ({"d_ff": 16}, r"parameter layers\.0\.mlp\.\w+_proj\.weight has shape \(\d+, \d+\) in the "
                       r"checkpoint, \(\d+, \d+\) in the model: .* in d_model, d_ff"),
        ({"vocab_size": 23}, r"parameter embed\.embed_tokens\.weight has shape \(19, 8\) in the checkpoint, "
                             r"\(23, 8\) in the model: .* in vocab_size, d_model"),
    ],
)
def test_a_shape_mismatch_names_parameter_shapes_and_config_field(tmp_path, change, expect):
    from dataclasses import replace

    mesh = odcfn.Mesh(1)
    model = qwen_model(SAVED)
    write_shards(tmp_path / "ck", odcfn.shard(init_params(SAVED, seed=0), model, mesh), None, 1,
                 model=model, mesh=mesh)
    other = qwen_model(replace(SAVED, **change))
    with pytest.raises(ValueError, match=expect):
        read_shards(tmp_path / "ck", model=other, mesh=mesh)
