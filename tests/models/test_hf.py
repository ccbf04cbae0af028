"""Local Hugging Face checkpoints: round trip, name mapping, parity with transformers' models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import odcfn
from odcfn.models import QwenConfig, from_hf, init_params, qwen_model, to_hf
from odcfn.models.hf import config_from_hf, hf_name, shard_from_hf

CFG = QwenConfig(vocab_size=53, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24, rope_theta=5000.0)


def _random_params(cfg: QwenConfig, seed: int = 0) -> dict:
    # non-trivial norms and biases so a swapped or dropped tensor changes the output
    g = torch.Generator().manual_seed(seed)
    return odcfn.tree_map(lambda t: torch.randn(t.shape, generator=g) * 0.3, init_params(cfg))


def _hf_config(cfg: QwenConfig, **over) -> dict:
    base = {
        "model_type": "qwen2",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "intermediate_size": cfg.d_ff,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_eps,
    }
    return {**base, **over}


def test_round_trip_is_exact(tmp_path):
    params = _random_params(CFG)
    to_hf(tmp_path / "m", params, CFG)
    cfg2, params2 = from_hf(tmp_path / "m")
    assert cfg2 == CFG
    odcfn.tree_assert_allclose(params2, params, rtol=0, atol=0)


def test_sharded_index_round_trip_and_bf16(tmp_path):
    params = _random_params(CFG, seed=1)
    to_hf(tmp_path / "m", params, CFG, dtype=torch.bfloat16, max_shard_bytes=4000)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _, got = from_hf(tmp_path / "m")
    want = odcfn.tree_map(lambda t: t.to(torch.bfloat16).float(), params)
    odcfn.tree_assert_allclose(got, want, rtol=0, atol=0)
    assert all(t.dtype == torch.float32 for t in odcfn.tree.tree_leaves(got))


@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_shard_from_hf_equals_sharding_the_full_load(tmp_path, W):
    """Row-range reads across several files give exactly each rank's shard, padding zero."""
    params = _random_params(CFG, seed=2)
    to_hf(tmp_path / "m", params, CFG, max_shard_bytes=3000)
    model = qwen_model(CFG)
    _, full = from_hf(tmp_path / "m")
    for r in range(W):
        mesh = odcfn.Mesh(W, r)
        cfg, shards = shard_from_hf(tmp_path / "m", mesh)
        assert cfg == CFG
        odcfn.tree_assert_allclose(shards, odcfn.shard(full, model, mesh), rtol=0, atol=0)


def test_names_follow_hf_layout_written_by_hand(tmp_path):
    """A checkpoint written here with HF names (not by to_hf) loads into the right leaves."""
    D, F, K = 8, 12, 4
    hf = {
        "model.embed_tokens.weight": torch.full((11, D), 1.0),
        "model.layers.0.input_layernorm.weight": torch.full((D,), 2.0),
        "model.layers.0.self_attn.q_proj.weight": torch.full((2 * K, D), 3.0),
        "model.layers.0.self_attn.k_proj.weight": torch.full((K, D), 4.0),
        "model.layers.0.self_attn.v_proj.weight": torch.full((K, D), 5.0),
        "model.layers.0.self_attn.o_proj.weight": torch.full((D, 2 * K), 6.0),
        "model.layers.0.post_attention_layernorm.weight": torch.full((D,), 7.0),
        "model.layers.0.mlp.gate_proj.weight": torch.full((F, D), 8.0),
        "model.layers.0.mlp.up_proj.weight": torch.full((F, D), 9.0),
        "model.layers.0.mlp.down_proj.weight": torch.full((D, F), 10.0),
        "model.norm.weight": torch.full((D,), 11.0),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2),  # old checkpoints: ignored
    }
    (tmp_path / "m").mkdir()
    save_file(hf, str(tmp_path / "m" / "model.safetensors"))
    conf = {
        "model_type": "llama",
        "vocab_size": 11,
        "hidden_size": D,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "intermediate_size": F,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
    }
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    got_cfg, p = from_hf(tmp_path / "m")
    assert got_cfg == QwenConfig(
        vocab_size=11,
        d_model=D,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=F,
        rope_theta=500.0,
        qkv_bias=False,
        tie_embeddings=True,
    )
    layer = p["layers.0"]
    assert float(p["embed"]["embed_tokens"]["weight"][0, 0]) == 1.0
    assert float(layer["input_layernorm"]["weight"][0]) == 2.0
    assert float(layer["self_attn"]["v_proj"]["weight"][0, 0]) == 5.0
    assert float(layer["mlp"]["down_proj"]["weight"][0, 0]) == 10.0
    assert float(p["head"]["norm"]["weight"][0]) == 11.0
    # tied: one matrix, owned by embed; the head has none of its own
    assert "lm_head" not in p["head"] and qwen_model(got_cfg).unit("head").uses == ("embed",)
    assert hf_name("head", "lm_head.weight") == "lm_head.weight"
    assert hf_name("layers.3", "mlp.up_proj.weight") == "model.layers.3.mlp.up_proj.weight"


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": "mixtral"}, "Mixtral \\(mixture of experts\\) is unsupported"),
        ({"num_experts": 8}, "num_experts=8: mixture of experts"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, "rope_type='dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
        ({"rope_scaling": {"type": "default", "mrope_section": [2, 1, 1]}}, "mrope"),
        ({"rope_parameters": {"rope_type": "linear"}}, "lacks 'factor'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"use_sliding_window": True}, "use_sliding_window=True: sliding-window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"head_dim": 7}, "head_dim=7 must be even"),
        ({"pad_token_id": 99}, r"pad_token_id=99 is outside \[0, vocab_size=53\)"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_are_rejected_by_name(over, match):
    conf = _hf_config(CFG, **over)
    if conf.get("hidden_size") is None:
        del conf["hidden_size"]
    with pytest.raises(ValueError, match=match):
        config_from_hf(conf)


def test_bad_checkpoints_are_rejected_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        from_hf(tmp_path)
    params = _random_params(CFG)
    to_hf(tmp_path / "m", params, CFG)
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    conf["intermediate_size"] = 20
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight' has shape \(16, 24\)"):
        from_hf(tmp_path / "m")
    conf["intermediate_size"] = 24
    conf["num_hidden_layers"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="model.layers.2.input_layernorm.weight' .* is missing"):
        from_hf(tmp_path / "m")
    conf["num_hidden_layers"] = 1
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="does not use: .*model.layers.1"):
        from_hf(tmp_path / "m")
    with pytest.raises(ValueError, match="leaves"):
        to_hf(tmp_path / "x", {**params, "head": {"norm": params["head"]["norm"]}}, CFG)


# --- parity against transformers' own implementation (when installed) ----------------------


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_loss_matches_transformers(tmp_path, kind):
    import transformers

    common = dict(
        vocab_size=53,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=24,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if kind == "qwen2":
        hf_cfg = transformers.Qwen2Config(rope_theta=5000.0, **common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        hf_cfg = transformers.LlamaConfig(rope_theta=5000.0, attention_bias=False, **common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    ref = model_cls(hf_cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb so they matter
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path / "hf")  # the test writes its own tiny checkpoint: no network

    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.rope_theta == 5000.0
    model = qwen_model(cfg)
    batch = odcfn.random_batch([7, 12], cfg.vocab_size, seed=3)
    want_sum = 0.0
    with torch.no_grad():
        for s in batch.samples:
            ids = s.tokens.long()[None]
            logits = ref(input_ids=ids).logits[0].float()
            want_sum += float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum"))
    got = float(odcfn.reference_loss(model, params, batch))
    want = want_sum / batch.num_loss_tokens
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)

    # and save back: transformers loads what to_hf wrote and computes the same logits
    to_hf(tmp_path / "back", params, cfg)
    back = model_cls.from_pretrained(tmp_path / "back").eval()
    ids = batch.samples[1].tokens.long()[None]
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
