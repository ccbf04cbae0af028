"""Issue 40's mixture-of-experts findings, each with the test that would have caught it: a MoE run
in ``odcfn train`` that shows its experts (16), an export that says it drops a learned router bias
(17), a weight-sync recipe that transformers' fused experts take (19) and an ``mlp_only_layers``
naming a layer the model lacks (21). Tiny Qwen3-MoE, 2 threads ranks, seconds."""

from __future__ import annotations

from pathlib import Path

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


# --- 16: a MoE run in odcfn train shows its experts --------------------------------------------------


def _moe_run(tmp_path, *, train: str = "expert_bias_rate = 0.01\n", every: int = 0, **over) -> Path:
    from odcfn.data.records import synthetic_records, write_jsonl
    from tests.hf_moe_families import hf_moe_model

    src = tmp_path / "src"
    hf_moe_model("qwen3_moe", vocab_size=40, **over).save_pretrained(src)
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8], 40, seed=0))
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out_dir = "out"\n[model]\nhf_path = "{src}"\n'
                   '[data]\npath = "train.jsonl"\nbatch_size = 3\n'
                   f'[train]\nsteps = 2\nlr = 1e-2\nworld_size = 2\n{train}[checkpoint]\nevery = {every}\n')
    return cfg


def test_a_moe_run_logs_its_experts_and_says_what_the_model_is(tmp_path, capsys):
    """Failed before: metrics.jsonl had no expert figure, the opening line said "d_ff 48" and
    nothing of the experts, and the bias showed only in a checkpoint's manifest."""
    import json

    from odcfn import cli

    cfg = _moe_run(tmp_path, output_router_logits=True)  # the aux loss on (coef 0.001)
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert ("experts: mixture of experts, 8 experts of moe_intermediate_size 16, top-2 per token, in "
            "sparse layers [0, 2] of 3 (dense: [1], d_ff 48)") in out, out
    assert "aux loss coef 0.001" in out and "expert_bias_rate 0.01" in out, out
    recs = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        for layer in ("layers.0", "layers.2"):  # the sparse layers: max over mean of tokens per expert
            assert r[f"moe/load_max_over_mean/{layer}"] >= 1.0, r
        assert r["moe/aux_loss"] > 0 and r["moe/aux_loss"] < r["loss"], r
        assert r["moe/router_bias_min"] <= 0 <= r["moe/router_bias_max"], r
    assert recs[-1]["moe/router_bias_max"] > 0  # the bias moved: 2 updates at rate 0.01


# --- 17: odcfn export says that it drops a learned router bias ---------------------------------------


def test_export_names_the_router_bias_it_drops(tmp_path, capsys):
    """A Hugging Face Qwen3-MoE router has no bias, so the export routes otherwise than the trained
    model. Failed before: ``odcfn export`` (and ``checkpoint.export_hf``) wrote it without a word."""
    import json

    from odcfn import cli
    from odcfn.checkpoint.sharded import read_manifest

    cfg = _moe_run(tmp_path, every=1)
    cfg.write_text(cfg.read_text() + 'export_hf = "hf"\n')  # [checkpoint] is the last section
    assert cli.main(["train", "--config", str(cfg), "--quiet"]) == 0
    bias = read_manifest(tmp_path / "out" / "checkpoints" / "step-00000002")["extra"]["router_bias"]
    lo, hi = min(map(min, bias)), max(map(max, bias))
    assert hi > 0
    assert "WARNING: the trained router bias is not exported" in capsys.readouterr().err  # export_hf
    assert cli.main(["export", str(tmp_path / "out"), str(tmp_path / "exported")]) == 0
    err = capsys.readouterr().err
    for root, said in ((tmp_path / "exported", err), (tmp_path / "hf", None)):
        if said is not None:
            assert "WARNING: the trained router bias is not exported" in said, said
            assert "model.layers.0.mlp.gate, model.layers.2.mlp.gate" in said and "2 x 8" in said, said
        readme = (root / "README.md").read_text()
        assert "Router bias not exported" in readme and "layers.0, layers.2" in readme, readme
        assert f"{lo:.4g}" in readme and f"{hi:.4g}" in readme, readme
        assert json.loads((root / "config.json").read_text())["model_type"] == "qwen3_moe"


# --- 19: weight sync into transformers' in-memory MoE ------------------------------------------------


def test_the_documented_weight_sync_reaches_transformers_fused_experts(tmp_path):
    """docs/models.md's recipe for a transformers model in memory, run as written on a Qwen3-MoE
    (transformers 5 holds its experts fused): every tensor, experts included, ends equal to the
    trained params. Failed before: the recipe gave one tensor per expert, which
    ``load_state_dict(strict=False)`` skips silently (the experts stayed stale)."""
    import re

    import torch

    import odcfn
    from tests.hf_moe_families import hf_moe_model, hub_names

    doc = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    (recipe,) = re.findall(r"^hf\.load_state_dict\(.*fused_experts=True.*$", doc, re.M)
    assert "strict=False" in doc and "missing_keys" in doc  # what strict=False hides is said
    hf_moe_model("qwen3_moe").save_pretrained(tmp_path / "base")
    _, full = odcfn.models.from_hf(tmp_path / "base")
    g = torch.Generator().manual_seed(1)
    full = odcfn.tree_map(lambda v: v + 0.01 * torch.randn(v.shape, generator=g), full)  # "trained"
    hf = hf_moe_model("qwen3_moe")  # the engine's model: still the base's weights
    exec(recipe, {"hf": hf, "odcfn": odcfn, "full": full})
    want = odcfn.models.hf_state_dict(full)  # the Hub's names, one tensor per expert
    got = hub_names({k: v.detach() for k, v in hf.state_dict().items()})
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)
    # and what strict=False hides: the per-expert names match nothing, every fused tensor is missing
    res = hf.load_state_dict(odcfn.models.hf_state_dict(full), strict=False)
    assert any(k.endswith("experts.gate_up_proj") for k in res.missing_keys)
    assert any(".experts.0.gate_proj.weight" in k for k in res.unexpected_keys)
