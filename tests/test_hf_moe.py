"""Hugging Face round trip of Qwen3-MoE / Qwen2-MoE checkpoints: from_hf of what transformers
saves (the Hub's per-expert layout) and of transformers 5's fused in-memory layout, config names
both ways, to_hf that transformers loads with the same loss, shard_from_hf over expert units,
and bad configs refused by name. Tiny models built here from a fixed seed: nothing is downloaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import odcfn
from odcfn.model import reference_loss
from odcfn.models import QwenMoeConfig, from_hf, init_params, qwen_model, shard_from_hf, to_hf
from odcfn.models.hf import hf_name
from odcfn.models.hf_config import config_from_hf, config_to_hf
from odcfn.tree import tree_flatten_with_path

transformers = pytest.importorskip("transformers")

# 3 layers: layer 1 is dense (mlp_only_layers) or layers 0 and 2 are (decoder_sparse_step=2)
_BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=48, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=16, rms_norm_eps=1e-5)  # fmt: skip
FAMILIES = {
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=12, mlp_only_layers=[1], rope_parameters={
        "rope_type": "default", "rope_theta": 5000.0})),
    "qwen2_moe": ("Qwen2Moe", dict(shared_expert_intermediate_size=24, decoder_sparse_step=2)),
}  # fmt: skip


def _hf_model(kind: str, *, seed: int = 0, **over):
    prefix, kw = FAMILIES[kind]
    conf = getattr(transformers, f"{prefix}Config")(**{**_BASE, **kw, **over})
    torch.manual_seed(seed)
    ref = getattr(transformers, f"{prefix}ForCausalLM")(conf).float().eval()
    with torch.no_grad():  # a sharp router, so top-k depends on the token; norms and biases matter
        for n, p in ref.named_parameters():
            p.normal_(1.0 if n.endswith("norm.weight") else 0.0, 0.3 if "gate.weight" in n else 0.08)
    return ref


def _hub_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors (or their grads) under the Hub's per-expert names."""
    out = {}
    for k, v in tensors.items():
        if k.endswith("experts.gate_up_proj"):
            i_ = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :i_]
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, i_:]
        elif k.endswith("experts.down_proj"):
            out.update({k.replace("down_proj", f"{e}.down_proj.weight"): v[e] for e in range(v.shape[0])})
        else:
            out[k] = v
    return out


def _hf_loss(ref, tokens: torch.Tensor) -> torch.Tensor:
    ids = tokens.long()[None]
    return ref(input_ids=ids, labels=ids).loss  # + coef * aux when output_router_logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


CASES = [("qwen3_moe", False, False), ("qwen3_moe", True, True), ("qwen2_moe", False, True),
         ("qwen2_moe", True, False)]  # fmt: skip


@pytest.mark.parametrize(("kind", "aux", "norm"), CASES, ids=[f"{k}-aux{a:d}-norm{n:d}" for k, a, n in CASES])
def test_from_hf_loss_and_grads_equal_transformers(tmp_path, kind, aux, norm):
    """Per sequence: odcfn's reference loss and every gradient equal transformers' on the
    checkpoint transformers saved; with the aux loss, loss = CE + coef * aux as transformers adds."""
    ref = _hf_model(kind, output_router_logits=aux, router_aux_loss_coef=0.25, norm_topk_prob=norm)
    ref.save_pretrained(tmp_path / "hf")
    cfg, params = from_hf(tmp_path / "hf")
    assert isinstance(cfg, QwenMoeConfig) and cfg.output_router_logits == aux and cfg.norm_topk_prob == norm
    model = qwen_model(cfg)
    params = odcfn.tree_map(lambda t: t.requires_grad_(), params)
    for seed, n in ((1, 13), (2, 7)):
        batch = odcfn.random_batch([n], cfg.vocab_size, seed=seed)
        loss = reference_loss(model, params, batch)
        ref.zero_grad()
        want = _hf_loss(ref, batch.samples[0].tokens)
        assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
        named = {hf_name(u, n): t for u, sub in params.items()
                 for n, t in zip(*tree_flatten_with_path(sub)[:2])}  # fmt: skip
        grads = dict(zip(named, torch.autograd.grad(loss, list(named.values()), allow_unused=True)))
        want.backward()
        hf_grads = _hub_names({k: p.grad for k, p in ref.named_parameters()})
        assert set(grads) == set(hf_grads)
        for name, g in hf_grads.items():
            if g is None or not g.any():  # an expert no token chose: no gradient here either
                assert grads[name] is None or not grads[name].any(), name
            else:
                assert _rel(grads[name], g) < 1e-4, name
    if aux:  # the aux term is not vanishing: without it the loss differs
        plain = reference_loss(qwen_model(_replace(cfg, output_router_logits=False)), params, batch)
        assert abs(float(plain.detach()) - float(loss.detach())) > 1e-3


def _replace(cfg, **kw):
    from dataclasses import replace

    return replace(cfg, **kw)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_fused_layout_reads_the_same(tmp_path, kind):
    """gate_up_proj (E, 2I, D) = cat(gate, up) per expert and down_proj (E, D, I), written here by
    hand from the Hub-layout file, load to the same params (and shards) as the Hub layout; the
    hand-fused tensors are the ones transformers holds in memory."""
    ref = _hf_model(kind)
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
    _hf_model(kind).save_pretrained(tmp_path / "hf")
    cfg, full = from_hf(tmp_path / "hf")
    model = qwen_model(cfg)
    assert any(".experts." in u.name for u in model.units)
    for W in (2, 5):
        for r in range(W):
            mesh = odcfn.Mesh(W, r)
            got_cfg, shards = shard_from_hf(tmp_path / "hf", mesh)
            assert got_cfg == cfg
            odcfn.tree_assert_allclose(shards, odcfn.shard(full, model, mesh), rtol=0, atol=0)


def _write_fused_broken(tmp_path: Path, kind: str, edit) -> Path:
    ref = _hf_model(kind)
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


def test_config_names_both_ways(tmp_path):
    """num_experts (the Hub's files) and num_local_experts (transformers 5's Qwen3-MoE) read
    alike; what config_to_hf writes transformers reads back field for field; fields a file omits
    take transformers' class defaults."""
    ref = _hf_model("qwen3_moe", norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.125)
    ref.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "num_local_experts" in written  # what the installed transformers writes
    cfg = config_from_hf(written)
    hub = {k: v for k, v in written.items() if k != "num_local_experts"}
    assert config_from_hf({**hub, "num_experts": 8}) == cfg
    with pytest.raises(ValueError, match="num_experts=8 and num_local_experts=4 disagree"):
        config_from_hf({**hub, "num_experts": 8, "num_local_experts": 4})
    for kind, over in (("qwen3_moe", {}), ("qwen2_moe", {"qkv_bias": False, "mlp_only_layers": [0]})):
        cfg = config_from_hf(json.loads(json.dumps(_hf_model(kind, **over).config.to_dict())))
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
        minimal = {"model_type": kind, **{k: _BASE[k] for k in sizes}}
        cfg, theirs = config_from_hf(minimal), getattr(transformers, f"{prefix}Config")(**minimal)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.d_ff) == (
            theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
            theirs.intermediate_size)
        assert cfg.shared_expert_intermediate_size == getattr(theirs, "shared_expert_intermediate_size", 0)
        assert cfg.head_dim == 8 and cfg.router_aux_loss_coef == theirs.router_aux_loss_coef


def _random_params(cfg: QwenMoeConfig, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def leaf(path: str, t: torch.Tensor) -> torch.Tensor:
        scale = 0.3 if path.endswith("mlp.gate.weight") else 0.08
        base = 1.0 if path.endswith("norm.weight") else 0.0
        return base + torch.randn(t.shape, generator=g) * scale

    names, leaves, treedef = tree_flatten_with_path(init_params(cfg))
    return odcfn.tree.tree_unflatten(treedef, [leaf(n, t) for n, t in zip(names, leaves)])


TO_HF = [
    QwenMoeConfig(vocab_size=50, d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=40, qk_norm=True,
                  qkv_bias=False, head_dim=8, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=12,
                  norm_topk_prob=True, decoder_sparse_step=2, output_router_logits=True,
                  router_aux_loss_coef=0.5),
    QwenMoeConfig(vocab_size=50, d_model=24, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=40, qk_norm=False,
                  qkv_bias=True, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
                  mlp_only_layers=(1,), shared_expert_intermediate_size=20, rope_theta=3000.0),
]  # fmt: skip


@pytest.mark.parametrize("cfg", TO_HF, ids=["qwen3_moe", "qwen2_moe"])
def test_to_hf_loads_in_transformers_with_the_same_loss(tmp_path, cfg):
    params = _random_params(cfg, seed=3)
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
            want = _hf_loss(ref, batch.samples[0].tokens)
            assert float(reference_loss(model, params, batch)) == pytest.approx(float(want), rel=1e-5)


def test_from_hf_train_to_hf_loads_in_transformers(tmp_path):
    """from_hf -> one ODC train_step on 2 ranks (its loss: transformers' token-mean CE over the
    minibatch + coef * the mean of each sequence's aux loss) -> to_hf -> transformers computes
    odcfn's loss on the trained weights."""
    coef = 0.1
    ref = _hf_model("qwen3_moe", output_router_logits=True, router_aux_loss_coef=coef)
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
    moved = max(_rel(trained[u]["mlp"]["gate"]["weight"], start[u]["mlp"]["gate"]["weight"])
                for u in ("layers.0", "layers.2"))
    assert moved > 1e-3  # the step changed the routers
    to_hf(tmp_path / "out", trained, cfg)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    for seed, n in ((7, 12), (8, 5)):
        batch = odcfn.random_batch([n], cfg.vocab_size, seed=seed)
        with torch.no_grad():
            want = _hf_loss(ref, batch.samples[0].tokens)
            assert float(reference_loss(model, trained, batch)) == pytest.approx(float(want), rel=1e-5)


def _moe_config(kind: str) -> dict:
    """A valid config.json of each family: Qwen3-MoE as transformers 5 writes it
    (num_local_experts), Qwen2-MoE with the Hub's names."""
    d = json.loads(json.dumps(_hf_model(kind).config.to_dict()))
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
    _hf_model("qwen2_moe").save_pretrained(tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**conf, "num_experts_per_tok": 12}))
    for read in (from_hf, lambda p: shard_from_hf(p, odcfn.Mesh(2, 0))):
        with pytest.raises(ValueError, match="num_experts_per_tok=12 exceeds num_experts=8"):
            read(tmp_path / "hf")
    params = _random_params(TO_HF[0], seed=0)
    qwen2_with_o_bias = {"qk_norm": False, "shared_expert_intermediate_size": 8, "o_bias": True}
    for over, match in (({"shared_expert_intermediate_size": 8}, "Qwen3-MoE .* no shared expert"),
                        ({"qk_norm": False}, "shared_expert_intermediate_size > 0"),
                        (qwen2_with_o_bias, "o_bias=False")):
        bad = _replace(TO_HF[0], **over)
        with pytest.raises(ValueError, match=match):
            to_hf(tmp_path / "bad", init_params(bad), bad)
    assert params  # the valid config exports
    to_hf(tmp_path / "good", params, TO_HF[0])
