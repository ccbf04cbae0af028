"""Qwen2, Qwen3 and Llama 3.x checkpoints (RoPE scalings, biases, free head_dim) against
transformers' own ``*ForCausalLM``: same loss, and what ``to_hf`` writes loads back with no
missing or unexpected keys and the same logits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers

import odcfn
from odcfn.models import RopeScaling, from_hf, qwen_model, to_hf
from odcfn.models.rope import inv_freq
from tests.hf_families import FAMILIES, hf_model


def _hf_loss(ref, batch: odcfn.Batch) -> float:
    total = 0.0
    with torch.no_grad():
        for s in batch.samples:
            ids = s.tokens.long()[None]
            logits = ref(input_ids=ids).logits[0].float()
            total += float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum"))
    return total / batch.num_loss_tokens


CASES = [(n, False) for n in FAMILIES] + [("qwen2", True), ("qwen3", True), ("llama3", True)]


@pytest.mark.parametrize(("name", "tied"), CASES, ids=[f"{n}{'-tied' if t else ''}" for n, t in CASES])
def test_loss_and_export_match_transformers(tmp_path, name, tied):
    ref = hf_model(name, tied=tied)
    ref.save_pretrained(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert cfg.tie_embeddings == tied and ("lm_head" in params["head"]) == (not tied)
    batch = odcfn.random_batch([7, 23, 12], cfg.vocab_size, seed=3)  # past the original context
    want = _hf_loss(ref, batch)
    got = float(odcfn.reference_loss(qwen_model(cfg), params, batch))
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    if cfg.rope_scaling is not None:  # the scaling is exercised: plain RoPE gives another loss
        plain = float(odcfn.reference_loss(qwen_model(replace(cfg, rope_scaling=None)), params, batch))
        assert abs(plain - want) > 100 * max(abs(got - want), 1e-7 * abs(want)), (plain, got, want)

    to_hf(tmp_path / "back", params, cfg, max_shard_bytes=6000)
    assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    cls = type(ref)
    back, info = cls.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing/unexpected/mismatched keys
    ids = batch.samples[1].tokens.long()[None]
    with torch.no_grad():
        got_logits, want_logits = back.eval()(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    assert from_hf(tmp_path / "back")[0] == cfg
    written = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in written) == (not tied)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["tie_word_embeddings"] == tied


def test_family_features_are_mapped():
    cfgs = {n: None for n in FAMILIES}
    for n, (prefix, kw) in FAMILIES.items():
        conf = getattr(transformers, f"{prefix}Config")(tie_word_embeddings=False, **kw)
        from odcfn.models import config_from_hf

        cfgs[n] = config_from_hf(json.loads(conf.to_json_string()))
    q2, q3, q3b, ll = cfgs["qwen2"], cfgs["qwen3"], cfgs["qwen3-bias"], cfgs["llama3"]
    assert (q2.qkv_bias, q2.o_bias, q2.qk_norm) == (True, False, False)
    assert (q3.qkv_bias, q3.o_bias, q3.qk_norm, q3.head_dim) == (False, False, True, 10)
    assert (q3b.qkv_bias, q3b.o_bias) == (True, True)
    assert (ll.qkv_bias, ll.o_bias, ll.head_dim, ll.rope_scaling.kind) == (True, True, 6, "llama3")
    assert cfgs["llama-linear"].rope_scaling == RopeScaling("linear", 2.0)
    assert cfgs["qwen2-yarn"].rope_scaling.original_max_position_embeddings == 8


def test_qwen3_head_dim_defaults_to_128_like_transformers():
    from odcfn.models import config_from_hf

    conf = {"model_type": "qwen3", "vocab_size": 10, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 8}  # fmt: skip
    assert config_from_hf(conf).head_dim == 128
    assert config_from_hf({**conf, "model_type": "llama"}).head_dim == 8


def test_rope_scalings_against_transformers_tables():
    """inv_freq and the attention factor equal transformers' own init functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        ("llama3", 64, 5e5, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
        ("yarn", 128, 1e6, {"factor": 4.0, "original_max_position_embeddings": 32768}),
        ("yarn", 32, 1e4, {"factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 16.0,
                           "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False}),
        ("linear", 16, 1e4, {"factor": 3.0}),
    ]  # fmt: skip
    for kind, hd, theta, rp in cases:
        conf = transformers.LlamaConfig(
            hidden_size=hd * 2, num_attention_heads=2, head_dim=hd, max_position_embeddings=1 << 20,
            rope_parameters={"rope_type": kind, "rope_theta": theta, **rp},
        )
        want, want_scale = ROPE_INIT_FUNCTIONS[kind](conf, "cpu")
        from odcfn.models import config_from_hf

        cfg = config_from_hf(json.loads(conf.to_json_string()))
        got, scale = inv_freq(hd, theta, cfg.rope_scaling)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(want_scale, rel=1e-12), kind


def test_broken_sharded_index_is_named(tmp_path):
    ref = hf_model("qwen3")
    ref.save_pretrained(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    to_hf(tmp_path / "m", params, cfg, max_shard_bytes=6000)
    index = tmp_path / "m" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = sorted(set(doc["weight_map"].values()))[0]
    (tmp_path / "m" / first).rename(tmp_path / "m" / "gone.safetensors")
    with pytest.raises(FileNotFoundError, match=f"lists '{first}'"):
        from_hf(tmp_path / "m")
    (tmp_path / "m" / "gone.safetensors").rename(tmp_path / "m" / first)
    name = next(k for k, v in doc["weight_map"].items() if v == first)
    other = next(v for v in doc["weight_map"].values() if v != first)
    doc["weight_map"][name] = other
    index.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=f"'{name}' is mapped to '{other}', which lacks it"):
        from_hf(tmp_path / "m")
    index.write_text("[]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        from_hf(tmp_path / "m")


def test_tied_checkpoint_with_a_head_copy(tmp_path):
    """Tied checkpoints that store lm_head.weight too: equal -> loads tied; different -> refused."""
    from safetensors.torch import load_file, save_file

    ref = hf_model("qwen2", tied=True)
    ref.save_pretrained(tmp_path / "m", safe_serialization=True)
    cfg, params = from_hf(tmp_path / "m")
    to_hf(tmp_path / "c", params, cfg)
    tensors = load_file(tmp_path / "c" / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "c" / "model.safetensors")
    got_cfg, got = from_hf(tmp_path / "c")
    assert got_cfg.tie_embeddings and "lm_head" not in got["head"]
    tensors["lm_head.weight"] += 1
    save_file(tensors, tmp_path / "c" / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        from_hf(tmp_path / "c")
