"""Mixture of experts: Qwen3-MoE / Qwen2-MoE against transformers and the single-process
reference, experts gathered on demand, ranks that route to disjoint experts."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import odcfn
from odcfn.model import reference_loss
from odcfn.models import QwenMoeConfig, init_params, qwen_model
from odcfn.models.hf import hf_name
from odcfn.models.qwen import unit_shapes
from odcfn.tree import tree_flatten_with_path, tree_leaves, tree_map, tree_unflatten


def hf_moe(family: str, *, norm: bool, aux: bool, sparse_step: int = 1, mlp_only=(), seed: int = 0):
    """A tiny transformers MoE model (random, sharp routers) and the odcfn config for it."""
    kw = dict(
        vocab_size=61,
        hidden_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=20,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=list(mlp_only),
        norm_topk_prob=norm,
        output_router_logits=aux,
        router_aux_loss_coef=0.25,
        rms_norm_eps=1e-5,
    )
    if family == "Qwen2Moe":
        kw.update(shared_expert_intermediate_size=16)
    else:
        kw.update(head_dim=8)
    conf = getattr(transformers, f"{family}Config")(**kw)
    torch.manual_seed(seed)
    ref = getattr(transformers, f"{family}ForCausalLM")(conf).float()
    with torch.no_grad():  # HF inits routers to zero: give them sharp, token-dependent choices
        for n, p in ref.named_parameters():
            p.normal_(0, 0.4 if n.endswith("mlp.gate.weight") else 0.08)
    cfg = QwenMoeConfig(
        vocab_size=61,
        d_model=24,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_ff=20,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        decoder_sparse_step=sparse_step,
        mlp_only_layers=tuple(mlp_only),
        norm_topk_prob=norm,
        output_router_logits=aux,
        router_aux_loss_coef=0.25,
        rms_eps=1e-5,
        rope_theta=float(conf.rope_parameters["rope_theta"]),
        qkv_bias=family == "Qwen2Moe",
        qk_norm=family == "Qwen3Moe",
        head_dim=8 if family == "Qwen3Moe" else None,
        shared_expert_intermediate_size=16 if family == "Qwen2Moe" else 0,
    )
    return ref, cfg


def params_from(ref, cfg) -> dict:
    """odcfn params from a transformers model's in-memory (fused 3-D) experts."""
    flat = {}
    for k, v in ref.state_dict().items():
        if k.endswith("experts.gate_up_proj"):
            i = v.shape[1] // 2
            for e in range(v.shape[0]):
                flat[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :i]
                flat[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, i:]
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                flat[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            flat[k] = v
    out = {}
    for unit, shapes in unit_shapes(cfg).items():
        names, _, treedef = tree_flatten_with_path(shapes)
        out[unit] = tree_unflatten(treedef, [flat[hf_name(unit, n)].detach().clone() for n in names])
    return out


def leaf_grads(params: dict, batch: odcfn.Batch, model) -> tuple[float, dict]:
    p = tree_map(lambda t: t.clone().requires_grad_(), params)
    loss = reference_loss(model, p, batch)
    loss.backward()
    loss = loss.detach()
    grad = lambda t: torch.zeros_like(t) if t.grad is None else t.grad  # an unused expert: no graph
    return float(loss), {u: torch.cat([grad(t).reshape(-1) for t in tree_leaves(v)]) for u, v in p.items()}


@pytest.mark.parametrize("family", ["Qwen3Moe", "Qwen2Moe"])
@pytest.mark.parametrize(
    "norm,aux,step,mlp_only", [(True, True, 1, ()), (False, False, 2, ()), (False, True, 1, (0,))]
)
def test_reference_equals_transformers(family, norm, aux, step, mlp_only):
    """Per sequence: odcfn's reference loss (token mean + coef * aux) and every gradient equal
    transformers' model on that sequence alone."""
    ref, cfg = hf_moe(family, norm=norm, aux=aux, sparse_step=step, mlp_only=mlp_only)
    model, params = qwen_model(cfg), params_from(ref, cfg)
    ids = torch.randint(0, 61, (17,), generator=torch.Generator().manual_seed(5))
    loss, grads = leaf_grads(params, odcfn.Batch((odcfn.Sample(ids),)), model)
    out = ref(input_ids=ids[None], labels=ids[None])
    out.loss.backward()
    assert loss == pytest.approx(float(out.loss.detach()), rel=1e-5)
    if aux:  # the aux term is there and not negligible
        assert float(out.aux_loss) * 0.25 > 1e-3
    ours = params_from(ref, cfg)  # same layout, filled with transformers' gradients
    hf_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}
    flat_hf = type(ref)  # noqa: F841 (keeps the comparison readable below)
    for unit, shapes in unit_shapes(cfg).items():
        names, _, _ = tree_flatten_with_path(shapes)
        got = grads[unit]
        want = torch.cat([_hf_grad(hf_grads, hf_name(unit, n)).reshape(-1) for n in names])
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-7), unit
    del ours


def _hf_grad(grads: dict, name: str) -> torch.Tensor:
    """The gradient of a Hub-layout tensor name, read from transformers' fused experts."""
    if ".mlp.experts." in name:
        layer, rest = name.split(".mlp.experts.")
        e, proj = rest.split(".", 1)
        e = int(e)
        if proj.startswith("down_proj"):
            return grads[f"{layer}.mlp.experts.down_proj"][e]
        gu = grads[f"{layer}.mlp.experts.gate_up_proj"][e]
        half = gu.shape[0] // 2
        return gu[:half] if proj.startswith("gate_proj") else gu[half:]
    return grads[name]


def _sharp(cfg: QwenMoeConfig, seed: int) -> dict:
    params = init_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for unit in params:
        mlp = params[unit].get("mlp", {}) if unit.startswith("layers.") else {}
        if "gate" in mlp:
            mlp["gate"]["weight"] = torch.randn(mlp["gate"]["weight"].shape, generator=g) * 0.6
    return params


def _grad_step(cfg, params, batch, world, **config) -> list:
    model = qwen_model(cfg)

    def worker(rank, transport):
        state = odcfn.TrainState.create(
            params=params,
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=transport,
            config=odcfn.StepConfig(**config),
        )
        g, m = odcfn.grad_step(state, batch)
        return g, m

    return odcfn.run_local(worker, world_size=world)


def _assert_matches(out, ref_grads, ref_loss) -> None:
    for unit, want in ref_grads.items():
        got = torch.cat([g[unit] for g, _ in out])[: want.numel()]
        scale = float(want.abs().max()) + 1e-12
        assert float((got - want).abs().max()) <= 2e-5 * scale + 1e-9, unit
    for _, m in out:
        assert m.loss == pytest.approx(ref_loss, rel=1e-5)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    e=st.integers(2, 6),
    k=st.integers(1, 3),
    world=st.integers(1, 3),
    comm=st.sampled_from(["odc", "collective"]),
    balance=st.sampled_from(["lb_mini", "lb_micro", "local_sort", "work_stealing"]),
    remat=st.booleans(),
    aux=st.booleans(),
    group=st.integers(1, 4),
    lengths=st.lists(st.integers(2, 24), min_size=1, max_size=5),
    seed=st.integers(0, 99),
)
def test_sharded_moe_equals_reference(e, k, world, comm, balance, remat, aux, group, lengths, seed):
    k = min(k, e)
    if comm == "collective" and balance == "work_stealing":
        balance = "lb_micro"  # stealing is ODC's (collectives run in lockstep)
    cfg = QwenMoeConfig(
        vocab_size=31,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_ff=12,
        num_experts=e,
        num_experts_per_tok=k,
        moe_intermediate_size=8,
        output_router_logits=aux,
        router_aux_loss_coef=0.5,
        norm_topk_prob=bool(seed % 2),
        shared_expert_intermediate_size=6 if seed % 3 == 0 else 0,
    )
    params, batch = _sharp(cfg, seed), odcfn.random_batch(lengths, 31, seed=seed)
    ref_loss, ref_grads = leaf_grads(params, batch, qwen_model(cfg))
    options = odcfn.ScheduleOptions(expert_group=group)
    out = _grad_step(
        cfg,
        params,
        batch,
        world,
        comm=comm,
        balance=balance,
        remat=remat,
        max_tokens_per_microbatch=32,
        options=options,
    )
    _assert_matches(out, ref_grads, ref_loss)


def _disjoint_setup():
    """Tokens < 16 route only to experts 0-2, tokens >= 16 only to 3-5; nobody to 6-7."""
    V, E = 32, 8
    cfg = QwenMoeConfig(
        vocab_size=V,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ff=12,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    params = init_params(cfg, seed=0)
    emb = params["embed"]["embed_tokens"]["weight"]
    emb[:, 0] = torch.where(torch.arange(V) < 16, 3.0, -3.0)  # dimension 0 says which half
    params["layers.0"]["self_attn"]["o_proj"]["weight"].zero_()  # the residual keeps the sign
    gate = torch.zeros(E, 16)
    gate[:3, 0], gate[3:6, 0], gate[6:, 0] = 4.0, -4.0, 0.0
    gate[6:, 1:] = 0.0
    gate[:6, 1:] = torch.randn(6, 15, generator=torch.Generator().manual_seed(0)) * 0.05
    params["layers.0"]["mlp"]["gate"]["weight"] = gate
    g = torch.Generator().manual_seed(1)
    low = [odcfn.Sample(torch.randint(0, 16, (n,), generator=g)) for n in (9, 14)]
    high = [odcfn.Sample(torch.randint(16, 32, (n,), generator=g)) for n in (11, 7)]
    return cfg, params, odcfn.Batch(tuple(low + high))


def test_ranks_with_disjoint_experts_train_exactly():
    """Rank 0's samples route only to experts 0-2, rank 1's only to 3-5; 6-7 are used by nobody:
    the sharded gradient equals the single-process one, 6-7 get exact zeros, and no rank gathers
    an expert its tokens do not use."""
    cfg, params, batch = _disjoint_setup()
    model = qwen_model(cfg)
    ref_loss, ref_grads = leaf_grads(params, batch, model)

    def by_half(lengths, world_size, max_tokens):
        return (((0, 1),), ((2, 3),))

    out = _grad_step(cfg, params, batch, 2, comm="odc", balance=by_half, max_tokens_per_microbatch=64)
    _assert_matches(out, ref_grads, ref_loss)
    for e in (6, 7):
        assert all(bool((g[f"layers.0.experts.{e}"] == 0).all()) for g, _ in out)
    expert_bytes = sum(x.numel() for x in tree_leaves(unit_shapes(cfg)["layers.0.experts.0"])) * 4 // 2
    for rank, (_, m) in enumerate(out):
        gathered = [ev.name for ev in m.events if ev.kind == "gather" and ".experts[" in ev.name]
        want = "0,1,2" if rank == 0 else "3,4,5"
        assert gathered == [f"layers.0.experts[{want}]"] * 2, gathered  # forward, backward
        # dense units: gathered (the other half of each) once or twice; experts: 3 x 2 halves
        dense = sum(u.padded_numel for u in _layout(model).units if ".experts." not in u.name)
        assert m.counters.gather_bytes <= 2 * dense * 4 // 2 + 2 * 3 * expert_bytes + 64
        assert m.counters.gather_bytes >= 2 * 3 * expert_bytes
        assert m.extra["moe/load/layers.0"][6:].sum() == 0
    # collective FSDP moves every expert, used or not
    coll = _grad_step(cfg, params, batch, 2, comm="collective", balance=by_half, max_tokens_per_microbatch=64)
    _assert_matches(coll, ref_grads, ref_loss)
    assert coll[0][1].counters.collective_bytes > out[0][1].counters.gather_bytes


def _layout(model):
    return odcfn.sharding.make_layout(model, odcfn.Mesh(world_size=2, rank=0))


def test_expert_group_bounds_resident_experts():
    """At most ``expert_group`` experts are gathered at once (each group is one trace event)."""
    cfg, params, batch = _disjoint_setup()
    out = _grad_step(
        cfg,
        params,
        batch,
        1,
        comm="odc",
        max_tokens_per_microbatch=64,
        options=odcfn.ScheduleOptions(expert_group=2),
    )
    groups = [ev.name for ev in out[0][1].events if ".experts[" in ev.name]
    assert groups and all(len(g.split("[")[1].rstrip("]").split(",")) <= 2 for g in groups)
    assert "routed gather" in str(out[0][1].plan)


def test_moe_config_refuses_bad_values():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        QwenMoeConfig(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        QwenMoeConfig(decoder_sparse_step=0)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        QwenMoeConfig(router_aux_loss_coef=-1.0)

def test_cost_model_counts_active_parameters():
    """LB-Mini's cost of a token in a sparse model: its top-k experts, not all E."""
    from odcfn.schedule.cost import ModelShape, flops_cost

    cfg = QwenMoeConfig(d_model=32, n_layers=2, d_ff=40, num_experts=16, num_experts_per_tok=2,
                        moe_intermediate_size=24, mlp_only_layers=(1,))
    shape = ModelShape.of(cfg)
    dense_layer_mlp, sparse_layer_mlp = 3 * 32 * 40, 2 * 3 * 32 * 24 + 32 * 16
    assert shape.active_mlp_params == dense_layer_mlp + sparse_layer_mlp
    assert flops_cost(cfg).b == 6.0 * shape.matmul_params
    # 16x the experts at the same top-k: only the routers' matmuls grow (d_model x E per layer)
    few = flops_cost(QwenMoeConfig(num_experts=4, num_experts_per_tok=4)).b
    many = flops_cost(QwenMoeConfig(num_experts=64, num_experts_per_tok=4)).b
    assert math.isclose(many - few, 6.0 * 2 * 64 * (64 - 4))


def test_active_params_count_top_k_experts_only():
    cfg = QwenMoeConfig(d_model=32, n_layers=3, num_experts=10, num_experts_per_tok=3,
                        moe_intermediate_size=16, mlp_only_layers=(1,))
    expert = 3 * 32 * 16
    assert cfg.num_params - cfg.active_params == 2 * (10 - 3) * expert  # two sparse layers
