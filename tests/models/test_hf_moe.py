"""Hugging Face round trip of Qwen3-MoE / Qwen2-MoE checkpoints: from_hf of what transformers
saves (the Hub's per-expert layout) and of transformers 5's fused in-memory layout, config names
both ways, to_hf that transformers loads with the same loss, shard_from_hf over expert units,
``odcfn train``/``odcfn export`` of a MoE checkpoint (bad input: test_hf_moe_inputs.py).
Tiny models built from a fixed seed: nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import save_file

import odcfn
from odcfn.model import reference_loss
from odcfn.models import QwenMoeConfig, from_hf, qwen_model, shard_from_hf, to_hf
from odcfn.models.hf import hf_name
from odcfn.models.hf_config import config_from_hf, config_to_hf
from odcfn.tree import tree_flatten_with_path
from tests.hf_moe_families import BASE, FAMILIES, TO_HF, hf_loss, hf_moe_model, hub_names, random_params, rel

CASES = [("qwen3_moe", False, False), ("qwen3_moe", True, True), ("qwen2_moe", False, True),
         ("qwen2_moe", True, False)]  # fmt: skip


@pytest.mark.parametrize(("kind", "aux", "norm"), CASES, ids=[f"{k}-aux{a:d}-norm{n:d}" for k, a, n in CASES])
def test_from_hf_loss_and_grads_equal_transformers(tmp_path, kind, aux, norm):
    """Per sequence: odcfn's reference loss and every gradient equal transformers' on the
    checkpoint transformers saved; with the aux loss, loss = CE + coef * aux as transformers adds."""
    ref = hf_moe_model(kind, output_router_logits=aux, router_aux_loss_coef=0.25, norm_topk_prob=norm)
    ref.save_pretrained(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert isinstance(cfg, QwenMoeConfig) and cfg.output_router_logits == aux and cfg.norm_topk_prob == norm
    model = qwen_model(cfg)
    params = odcfn.tree_map(lambda t: t.requires_grad_(), params)
    for seed, n in ((1, 13), (2, 7)):
        batch = odcfn.random_batch([n], cfg.vocab_size, seed=seed)
        loss = reference_loss(model, params, batch)
        ref.zero_grad()
        want = hf_loss(ref, batch.samples[0].tokens)
        assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
        named = {hf_name(u, n): t for u, sub in params.items()
                 for n, t in zip(*tree_flatten_with_path(sub)[:2])}  # fmt: skip
        grads = dict(zip(named, torch.autograd.grad(loss, list(named.values()), allow_unused=True)))
        want.backward()
        hf_grads = hub_names({k: p.grad for k, p in ref.named_parameters()})
        assert set(grads) == set(hf_grads)
        for name, g in hf_grads.items():
            if g is None or not g.any():  # an expert no token chose: no gradient here either
                assert grads[name] is None or not grads[name].any(), name
            else:
                assert rel(grads[name], g) < 1e-4, name
    if aux:  # the aux term is not vanishing: without it the loss differs
        plain = reference_loss(qwen_model(replace(cfg, output_router_logits=False)), params, batch)
        assert abs(float(plain.detach()) - float(loss.detach())) > 1e-3


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_fused_layout_reads_the_same(tmp_path, kind):
    """gate_up_proj (E, 2I, D) = cat(gate, up) per expert and down_proj (E, D, I), written here by
    hand from the Hub-layout file, load to the same params (and shards) as the Hub layout; the
    hand-fused tensors are the ones transformers holds in memory."""
    ref = hf_moe_model(kind)
    ref.save_pretrained(tmp_path / "hub")
    cfg, want = from_hf(tmp_path / "hub")
    from safetensors.torch import load_file

    hub = load_file(tmp_path / "hub" / "model.safetensors")
    fused = {k: v for k, v in hub.items() if ".mlp.experts." not in k}
    for i in range(cfg.n_layers):
        b = f"model.layers.{i}.mlp.experts."
        if f"{b}0.gate_proj.weight" not in hub:
            continue  # a dense layer
        E = cfg.num_experts
        fused[b + "gate_up_proj"] = torch.stack(
            [torch.cat([hub[f"{b}{e}.gate_proj.weight"], hub[f"{b}{e}.up_proj.weight"]]) for e in range(E)])
        fused[b + "down_proj"] = torch.stack([hub[f"{b}{e}.down_proj.weight"] for e in range(E)])
    memory = ref.state_dict()
    assert {k for k in fused if "experts" in k} == {k for k in memory if "experts" in k}
    for k, v in fused.items():
        assert torch.equal(v, memory[k]), k
    (tmp_path / "fused").mkdir()
    shutil.copy(tmp_path / "hub" / "config.json", tmp_path / "fused" / "config.json")
    save_file(fused, str(tmp_path / "fused" / "model.safetensors"))
    cfg2, got = from_hf(tmp_path / "fused")
    assert cfg2 == cfg
    odcfn.tree_assert_allclose(got, want, rtol=0, atol=0)
    model = qwen_model(cfg)
    for r in range(3):  # row-range reads inside the fused tensors
        mesh = odcfn.Mesh(3, r)
        odcfn.tree_assert_allclose(shard_from_hf(tmp_path / "fused", mesh)[1], odcfn.shard(want, model, mesh),
                                   rtol=0, atol=0)  # fmt: skip


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_shard_from_hf_reads_expert_units(tmp_path, kind):
    hf_moe_model(kind).save_pretrained(tmp_path / "hf")
    cfg, full = from_hf(tmp_path / "hf")
    model = qwen_model(cfg)
    assert any(".experts." in u.name for u in model.units)
    for W in (2, 5):
        for r in range(W):
            mesh = odcfn.Mesh(W, r)
            got_cfg, shards = shard_from_hf(tmp_path / "hf", mesh)
            assert got_cfg == cfg
            odcfn.tree_assert_allclose(shards, odcfn.shard(full, model, mesh), rtol=0, atol=0)


def test_config_names_both_ways(tmp_path):
    """num_experts (the Hub's files) and num_local_experts (transformers 5's Qwen3-MoE) read
    alike; what config_to_hf writes transformers reads back field for field; fields a file omits
    take transformers' class defaults."""
    ref = hf_moe_model("qwen3_moe", norm_topk_prob=True, output_router_logits=True,
                       router_aux_loss_coef=0.125)
    ref.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "num_local_experts" in written  # what the installed transformers writes
    cfg = config_from_hf(written)
    hub = {k: v for k, v in written.items() if k != "num_local_experts"}
    assert config_from_hf({**hub, "num_experts": 8}) == cfg
    with pytest.raises(ValueError, match="num_experts=8 and num_local_experts=4 disagree"):
        config_from_hf({**hub, "num_experts": 8, "num_local_experts": 4})
    for kind, over in (("qwen3_moe", {}), ("qwen2_moe", {"qkv_bias": False, "mlp_only_layers": [0]})):
        cfg = config_from_hf(json.loads(json.dumps(hf_moe_model(kind, **over).config.to_dict())))
        out = config_to_hf(cfg)
        assert config_from_hf(out) == cfg
        assert out["model_type"] == kind and out["architectures"] == [FAMILIES[kind][0] + "ForCausalLM"]
        back = transformers.AutoConfig.for_model(kind, **{k: v for k, v in out.items() if k != "model_type"})
        same = ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                "decoder_sparse_step", "output_router_logits", "router_aux_loss_coef", "head_dim"]
        for ours, theirs in [(k, k) for k in same] + [("d_ff", "intermediate_size")]:
            assert getattr(cfg, ours) == getattr(back, theirs), ours
        assert tuple(back.mlp_only_layers) == cfg.mlp_only_layers
        if kind == "qwen2_moe":
            assert back.shared_expert_intermediate_size == cfg.shared_expert_intermediate_size == 24
            assert back.qkv_bias is cfg.qkv_bias is False
    for kind, prefix in (("qwen3_moe", "Qwen3Moe"), ("qwen2_moe", "Qwen2Moe")):
        sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        minimal = {"model_type": kind, **{k: BASE[k] for k in sizes}}
        cfg, theirs = config_from_hf(minimal), getattr(transformers, f"{prefix}Config")(**minimal)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.d_ff) == (
            theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
            theirs.intermediate_size)
        assert cfg.shared_expert_intermediate_size == getattr(theirs, "shared_expert_intermediate_size", 0)
        assert cfg.head_dim == 8 and cfg.router_aux_loss_coef == theirs.router_aux_loss_coef


@pytest.mark.parametrize("cfg", TO_HF, ids=["qwen3_moe", "qwen2_moe"])
def test_to_hf_loads_in_transformers_with_the_same_loss(tmp_path, cfg):
    params = random_params(cfg, seed=3)
    to_hf(tmp_path / "out", params, cfg)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"):
        assert k in written, k
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert type(ref).__name__ == written["architectures"][0]
    model = qwen_model(cfg)
    for seed, n in ((4, 11), (5, 6)):
        batch = odcfn.random_batch([n], cfg.vocab_size, seed=seed)
        with torch.no_grad():
            want = hf_loss(ref, batch.samples[0].tokens)
            assert float(reference_loss(model, params, batch)) == pytest.approx(float(want), rel=1e-5)


def test_from_hf_train_to_hf_loads_in_transformers(tmp_path):
    """from_hf -> one ODC train_step on 2 ranks (its loss: transformers' token-mean CE over the
    minibatch + coef * the mean of each sequence's aux loss) -> to_hf -> transformers computes
    odcfn's loss on the trained weights."""
    coef = 0.1
    ref = hf_moe_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=coef)
    ref.save_pretrained(tmp_path / "hf")
    cfg, start = from_hf(tmp_path / "hf")
    model = qwen_model(cfg)
    train = odcfn.random_batch([9, 14, 5, 11], cfg.vocab_size, seed=6)
    ce_sum, aux = 0.0, []
    with torch.no_grad():
        for s in train.samples:
            ids = s.tokens.long()[None]
            out = ref(input_ids=ids, labels=ids)
            aux.append(float(out.aux_loss))
            ce_sum += (float(out.loss) - coef * aux[-1]) * (ids.shape[1] - 1)
    want_step_loss = ce_sum / train.num_loss_tokens + coef * sum(aux) / len(aux)

    def rank(r: int, transport) -> tuple[dict, float]:
        _, shards = shard_from_hf(tmp_path / "hf", transport.mesh)
        state = odcfn.TrainState.create(params=shards, model=model, optimizer=odcfn.adamw(1e-2),
                                        transport=transport, config=odcfn.StepConfig(comm="odc"))
        state, m = odcfn.train_step(state, train)
        return state.params, m.loss

    out = odcfn.run_local(rank, 2)
    assert [loss for _, loss in out] == pytest.approx([want_step_loss] * 2, rel=1e-5)
    out = [shards for shards, _ in out]
    trained = odcfn.unshard(out, model, odcfn.Mesh(2))
    moved = max(rel(trained[u]["mlp"]["gate"]["weight"], start[u]["mlp"]["gate"]["weight"])
                for u in ("layers.0", "layers.2"))
    assert moved > 1e-3  # the step changed the routers
    to_hf(tmp_path / "out", trained, cfg)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    for seed, n in ((7, 12), (8, 5)):
        batch = odcfn.random_batch([n], cfg.vocab_size, seed=seed)
        with torch.no_grad():
            want = hf_loss(ref, batch.samples[0].tokens)
            assert float(reference_loss(model, trained, batch)) == pytest.approx(float(want), rel=1e-5)


def test_odcfn_train_and_export_of_a_moe_checkpoint(tmp_path, monkeypatch):
    """``odcfn train`` with ``[model] hf_path`` of a Qwen3-MoE checkpoint, then ``odcfn export``:
    the trained weights in the Hub layout, a config transformers reads as Qwen3-MoE, its loss."""
    from odcfn import cli
    from odcfn.checkpoint.sharded import read_shards
    from odcfn.data.records import synthetic_records, write_jsonl
    from tests.data.test_chat_data import _tokenizer

    src = tmp_path / "src"
    _tokenizer(src)  # a vocabulary of 300
    ref = hf_moe_model("qwen3_moe", vocab_size=300, output_router_logits=True, router_aux_loss_coef=0.05)
    ref.save_pretrained(src)
    write_jsonl(tmp_path / "train.jsonl", synthetic_records([5, 9, 7, 12, 6, 8], 300, seed=0))
    (tmp_path / "run.toml").write_text(
        f'out_dir = "out"\n[model]\nhf_path = "{src}"\n[data]\npath = "train.jsonl"\nbatch_size = 2\n'
        '[train]\nsteps = 2\nlr = 1e-2\nworld_size = 2\n')
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--config", "run.toml", "--quiet"]) == 0
    assert cli.main(["export", "out", "hf"]) == 0
    cfg, got = from_hf(tmp_path / "hf")
    assert cfg == from_hf(src)[0]
    model, one = qwen_model(cfg), odcfn.Mesh(1)
    ck = tmp_path / "out" / "checkpoints" / "step-00000002"
    want = odcfn.unshard([read_shards(ck, model=model, mesh=one)[0]], model, one)
    odcfn.tree_assert_allclose(got, want, rtol=0, atol=0)
    start = from_hf(src)[1]["layers.0"]["mlp"]["gate"]["weight"]
    assert rel(got["layers.0"]["mlp"]["gate"]["weight"], start) > 1e-4  # trained, not the source
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    batch = odcfn.random_batch([10], 300, seed=9)
    with torch.no_grad():
        want_loss = hf_loss(hf, batch.samples[0].tokens)
        assert float(reference_loss(model, got, batch)) == pytest.approx(float(want_loss), rel=1e-5)
