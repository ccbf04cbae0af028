"""Bad MoE checkpoints and configs are refused with an error naming the field or tensor:
other families' MoE fields, top-k > num_experts, decoder_sparse_step < 1, broken fused expert
tensors, and QwenMoeConfigs no Hugging Face family computes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import odcfn
from odcfn.models import QwenMoeConfig, from_hf, init_params, shard_from_hf, to_hf
from odcfn.models.hf_config import config_from_hf
from tests.hf_moe_families import TO_HF, hf_moe_model, random_params


def _write_fused_broken(tmp_path: Path, kind: str, edit) -> Path:
    ref = hf_moe_model(kind)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    edit(sd)
    sd = {k: v.contiguous() for k, v in sd.items()}
    (tmp_path / "m").mkdir(parents=True)
    ref.config.save_pretrained(tmp_path / "m")
    save_file(sd, str(tmp_path / "m" / "model.safetensors"))
    return tmp_path / "m"


def test_fused_layout_errors_name_the_tensor(tmp_path):
    gu = "model.layers.0.mlp.experts.gate_up_proj"
    dn = "model.layers.0.mlp.experts.down_proj"
    path = _write_fused_broken(tmp_path / "a", "qwen3_moe", lambda sd: sd.pop(dn))
    with pytest.raises(ValueError, match=f"{gu}' without '{dn}"):
        from_hf(path)
    path = _write_fused_broken(tmp_path / "b", "qwen3_moe", lambda sd: sd.update({gu: sd[gu][:, :30]}))
    want = r"has shape \(8, 30, 32\), config.json implies \(8, 32, 32\)"
    with pytest.raises(ValueError, match=f"{gu}' {want}"):
        from_hf(path)
    extra = "model.layers.0.mlp.experts.3.up_proj.weight"
    path = _write_fused_broken(tmp_path / "c", "qwen3_moe", lambda sd: sd.update({extra: torch.ones(16, 32)}))
    with pytest.raises(ValueError, match=f"both fused .* and per expert \\('{extra}'"):
        from_hf(path)



def _moe_config(kind: str) -> dict:
    """A valid config.json of each family: Qwen3-MoE as transformers 5 writes it
    (num_local_experts), Qwen2-MoE with the Hub's names."""
    d = json.loads(json.dumps(hf_moe_model(kind).config.to_dict()))
    if kind == "qwen2_moe":
        assert "num_local_experts" not in d
        d.pop("layer_types", None)  # as the Hub's files (older transformers) have it
    return d


BAD = [
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ("qwen2_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 exceeds num_experts=8"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer >= 1"),
    ("qwen2_moe", {"decoder_sparse_step": -1}, "decoder_sparse_step=-1 must be"),
    ("qwen3_moe", {"num_local_experts": 0}, "num_experts=0 must be"),
    ("qwen3_moe", {"num_experts_per_tok": True}, "num_experts_per_tok=True must be"),
    ("qwen3_moe", {"moe_intermediate_size": 1.5}, "moe_intermediate_size=1.5 must be"),
    ("qwen3_moe", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1: router jitter noise"),
    ("qwen3_moe", {"n_group": 4, "topk_group": 2}, "n_group=4: group-limited routing"),
    ("qwen3_moe", {"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ("qwen2_moe", {"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ("qwen2_moe", {"n_shared_experts": 2}, "n_shared_experts=2"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=True: sliding-window"),
    ("qwen2_moe", {"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen2_moe", {"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ("qwen3_moe", {"mlp_only_layers": [1, -2]}, "mlp_only_layers=\\[1, -2\\]"),
    ("qwen3_moe", {"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be true or false"),
    ("qwen2_moe", {"router_aux_loss_coef": -0.1}, "router_aux_loss_coef=-0.1"),
    ("qwen3_moe", {"model_type": "mixtral"}, "Mixtral \\(mixture of experts\\) is unsupported"),
    ("qwen3_moe", {"model_type": "qwen3_next"}, "Qwen3-Next"),
]


@pytest.mark.parametrize(("kind", "over", "match"), BAD, ids=[f"{k}-{next(iter(o))}" for k, o, _ in BAD])
def test_bad_moe_configs_are_refused_by_name(kind, over, match):
    good = _moe_config(kind)
    assert isinstance(config_from_hf(good), QwenMoeConfig)  # only the override is wrong
    with pytest.raises(ValueError, match=match):
        config_from_hf({**good, **over})


def test_bad_checkpoint_and_unexportable_configs(tmp_path):
    hf_moe_model("qwen2_moe").save_pretrained(tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**conf, "num_experts_per_tok": 12}))
    for read in (from_hf, lambda p: shard_from_hf(p, odcfn.Mesh(2, 0))):
        with pytest.raises(ValueError, match="num_experts_per_tok=12 exceeds num_experts=8"):
            read(tmp_path / "hf")
    qwen2_with_o_bias = {"qk_norm": False, "shared_expert_intermediate_size": 8, "o_bias": True}
    for over, match in (({"shared_expert_intermediate_size": 8}, "Qwen3-MoE .* no shared expert"),
                        ({"qk_norm": False}, "shared_expert_intermediate_size > 0"),
                        (qwen2_with_o_bias, "o_bias=False")):
        bad = replace(TO_HF[0], **over)
        with pytest.raises(ValueError, match=match):
            to_hf(tmp_path / "bad", init_params(bad), bad)
        assert not (tmp_path / "bad" / "model.safetensors").exists()  # refused before writing
    to_hf(tmp_path / "good", random_params(TO_HF[0], seed=0), TO_HF[0])  # the unchanged config exports
    assert (tmp_path / "good" / "model.safetensors").is_file()
