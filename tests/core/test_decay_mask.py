"""``weight_decay_mask``: per-leaf decay applied through the flat layout's shard ranges equals
``torch.optim.AdamW``/``SGD`` with a ``weight_decay=0`` group for the masked-out leaves."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.optim import DECAY_MASKS, decay_ranges
from odcfn.sharding import make_layout
from odcfn.tree import tree_named_leaves

CFG = QwenConfig(vocab_size=19, d_model=12, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=10,
                 head_dim=4, qk_norm=True, qkv_bias=True, o_bias=True)  # fmt: skip


def _named(tree: dict) -> dict[str, torch.Tensor]:
    return {f"{u}.{n}": t for u, sub in tree.items() for n, t in tree_named_leaves(sub)}


def _fill(sub, prefix, named):
    if isinstance(sub, dict):
        return {k: _fill(v, f"{prefix}.{k}", named) for k, v in sub.items()}
    return named[prefix]


def _sharded_run(make_opt, params, grads_per_step, model, W, sharding="full", rpn=None):
    meshes = [odcfn.Mesh(W, r, rpn, sharding) for r in range(W)]
    out = []
    for mesh in meshes:
        opt = make_opt().for_layout(make_layout(model, mesh))
        p = odcfn.shard(params, model, mesh)
        state = opt.init(p)
        for g in grads_per_step:
            p, state = opt.update(odcfn.shard(g, model, mesh), state, p, grad_scale=0.5)
        out.append(p)
    group = meshes[0].shard_group
    return odcfn.unshard([out[r] for r in group], model, meshes[0])


def _torch_run(torch_opt, params, grads_per_step, decayed):
    named = {k: torch.nn.Parameter(v.clone()) for k, v in _named(params).items()}
    groups = [
        {"params": [p for k, p in named.items() if decayed(k)]},
        {"params": [p for k, p in named.items() if not decayed(k)], "weight_decay": 0.0},
    ]
    opt = torch_opt(groups)
    for g in grads_per_step:
        gn = _named(g)
        for k, p in named.items():
            p.grad = gn[k] * 0.5
        opt.step()
    return _fill_tree(params, {k: p.detach() for k, p in named.items()})


def _fill_tree(params, named):
    return {u: _fill(sub, u, named) for u, sub in params.items()}


def _random_like(params, seed):
    g = torch.Generator().manual_seed(seed)
    return odcfn.tree_map(lambda t: torch.randn(t.shape, generator=g), params)


@pytest.mark.parametrize(("W", "sharding", "rpn"), [(1, "full", None), (2, "full", None), (3, "full", None),
                                                    (4, "hybrid", 2)])  # fmt: skip
@pytest.mark.parametrize("mask", ["no_norms_biases", "no_norms_biases_embeddings", "custom"])
def test_masked_adamw_equals_torch_param_groups(W, sharding, rpn, mask):
    model = qwen_model(CFG)
    params = _random_like(init_params(CFG), 0)
    grads = [_random_like(params, s) for s in (1, 2, 3)]
    pred = (lambda n: n.startswith("layers.1.")) if mask == "custom" else DECAY_MASKS[mask]
    lr, wd = 0.05, 0.3

    def make():
        return odcfn.adamw(lr, weight_decay=wd, weight_decay_mask=pred if mask == "custom" else mask)

    got = _sharded_run(make, params, grads, model, W, sharding, rpn)
    want = _torch_run(lambda g: torch.optim.AdamW(g, lr=lr, weight_decay=wd), params, grads, pred)
    odcfn.tree_assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # the mask matters: decaying everything gives other parameters
    plain = _sharded_run(lambda: odcfn.adamw(lr, weight_decay=wd), params, grads, model, W, sharding, rpn)
    bias = [t["layers.0"]["self_attn"]["q_proj"]["bias"] for t in (plain, got)]
    assert not torch.allclose(*bias)


def test_masked_sgd_equals_torch():
    model = qwen_model(CFG)
    params = _random_like(init_params(CFG), 4)
    grads = [_random_like(params, s) for s in (5, 6, 7)]
    pred = DECAY_MASKS["no_norms_biases"]
    got = _sharded_run(
        lambda: odcfn.sgd(0.1, momentum=0.9, weight_decay=0.2, weight_decay_mask="no_norms_biases"),
        params, grads, model, 3,
    )
    want = _torch_run(
        lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, weight_decay=0.2), params, grads, pred
    )
    odcfn.tree_assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_named_masks_pick_norms_biases_and_embeddings():
    names = [f"{u}.{n}" for u, sub in init_params(CFG).items() for n, _ in tree_named_leaves(sub)]
    kept = sorted(n for n in names if not DECAY_MASKS["no_norms_biases"](n))
    assert kept == sorted(
        [f"layers.{i}.{p}" for i in range(2) for p in [
            "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
            "self_attn.v_proj.bias", "self_attn.o_proj.bias"]] + ["head.norm.weight"]
    )  # fmt: skip
    extra = {n for n in names if not DECAY_MASKS["no_norms_biases_embeddings"](n)} - set(kept)
    assert extra == {"embed.embed_tokens.weight"}


def test_ranges_cover_exactly_the_undecayed_leaves_of_each_shard():
    model = qwen_model(CFG)
    for W in (1, 3, 5):
        covered = {}
        for r in range(W):
            layout = make_layout(model, odcfn.Mesh(W, r))
            for u, ranges in decay_ranges(layout, DECAY_MASKS["no_norms_biases"]).items():
                lo = layout[u].shard_range(r)[0]
                covered.setdefault(u, set()).update(i + lo for a, b in ranges for i in range(a, b))
        layout = make_layout(model, odcfn.Mesh(W))
        for ul in layout.units:
            want, off = set(), 0
            for path, n in zip(ul.paths, ul.numels):
                if not DECAY_MASKS["no_norms_biases"](f"{ul.name}.{path}"):
                    want.update(range(off, off + n))
                off += n
            assert covered[ul.name] == want, (W, ul.name)


def test_bad_masks_are_named():
    with pytest.raises(ValueError, match="'no_bias' is not a named mask"):
        odcfn.adamw(1e-3, weight_decay_mask="no_bias")
    with pytest.raises(TypeError, match="predicate on leaf names"):
        odcfn.adamw(1e-3, weight_decay_mask=3)
    opt = odcfn.adamw(1e-3, weight_decay_mask="no_norms_biases")
    model = qwen_model(CFG)
    shards = odcfn.shard(init_params(CFG), model, odcfn.Mesh(1))
    with pytest.raises(ValueError, match="for_layout"):
        opt.update(shards, opt.init(shards), shards)
    with pytest.raises(TypeError, match="returned 'yes'"):
        odcfn.adamw(1e-3, weight_decay_mask=lambda n: "yes").for_layout(make_layout(model, odcfn.Mesh(1)))
    # no decay at all: nothing to mask, no layout needed
    plain = odcfn.adamw(1e-3, weight_decay=0.0, weight_decay_mask="no_norms_biases")
    plain.update(shards, plain.init(shards), shards)
