"""``odcfn.models.hf_state_dict``: a gathered params tree under the names a Hugging Face
checkpoint (and an inference engine loading one) uses."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import odcfn
from odcfn.models import QwenConfig, hf_state_dict, init_params, to_hf


@pytest.mark.parametrize("tied", [False, True])
def test_names_and_tensors_are_those_to_hf_writes(tmp_path, tied):
    cfg = QwenConfig(vocab_size=23, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=12,
                     tie_embeddings=tied)
    params = init_params(cfg, seed=0)
    written = load_file(str(to_hf(tmp_path, params, cfg) / "model.safetensors"))
    got = hf_state_dict(params)
    assert set(got) == set(written) and "model.layers.1.mlp.down_proj.weight" in got
    assert ("lm_head.weight" in got) is not tied
    for k, v in got.items():
        assert torch.equal(v, written[k]), k


def test_lora_units_are_refused_with_the_way_out():
    cfg = QwenConfig(vocab_size=23, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=12)
    base = init_params(cfg, seed=0)
    model, params = odcfn.lora.apply(odcfn.models.qwen_model(cfg), base, rank=2, alpha=2.0)
    with pytest.raises(ValueError, match=r"LoRA adapters.*merged=True"):
        hf_state_dict(params)
    assert set(hf_state_dict(odcfn.lora.merge(model, params))) == set(hf_state_dict(init_params(cfg, seed=0)))
