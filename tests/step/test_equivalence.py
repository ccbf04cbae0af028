"""The central property: for any world size, sharding, assignment and schedule, ODC and
collective gradient shards equal the single-process gradient of the minibatch loss."""

from __future__ import annotations

import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.schedule import ScheduleOptions
from tests.util import TINY, fixed_balancer, make_state, ref_shards, run_grad_step, tiny

RTOL, ATOL = 2e-4, 2e-6  # fp32, different summation orders


@st.composite
def configs(draw):
    d, h, kv = draw(st.sampled_from([(8, 2, 1), (12, 2, 2), (16, 4, 2), (12, 3, 1)]))
    return QwenConfig(
        vocab_size=draw(st.integers(5, 41)),
        d_model=d,
        n_layers=draw(st.integers(1, 2)),
        n_heads=h,
        n_kv_heads=kv,
        d_ff=draw(st.integers(3, 20)),
        qkv_bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        o_bias=draw(st.booleans()),
        tie_embeddings=draw(st.booleans()),  # head uses embed's matrix: an extra gather, one push
    )


@st.composite
def meshes(draw):
    world = draw(st.integers(1, 5))
    divisors = [d for d in range(1, world + 1) if world % d == 0 and d < world]
    if divisors and draw(st.booleans()):
        return world, draw(st.sampled_from(divisors)), "hybrid"
    return world, None, "full"


@st.composite
def assignments(draw, n_samples: int, world: int):
    """Any split of the samples over ranks (empty ranks, unequal microbatch counts) and into
    microbatches in any order."""
    owner = draw(st.lists(st.integers(0, world - 1), min_size=n_samples, max_size=n_samples))
    out = []
    for r in range(world):
        mine = draw(st.permutations([i for i in range(n_samples) if owner[i] == r]))
        mbs, cur = [], []
        for i in mine:
            cur.append(i)
            if draw(st.booleans()):
                mbs.append(tuple(cur))
                cur = []
        if cur:
            mbs.append(tuple(cur))
        out.append(tuple(mbs))
    return tuple(out)


@st.composite
def cases(draw):
    cfg = draw(configs())
    world, rpn, sharding = draw(meshes())
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=7))
    lengths[0] = max(lengths[0], 2)  # a minibatch needs a loss token; one-token samples have none
    assignment = draw(assignments(len(lengths), world))
    options = ScheduleOptions(
        prefetch=draw(st.integers(0, 2)),
        reshard_after_forward=draw(st.booleans()),
        remat=draw(st.sets(st.sampled_from(qwen_model(cfg).unit_names))),
    )
    return cfg, world, rpn, sharding, lengths, assignment, options, draw(st.integers(0, 2**16))


@settings(max_examples=int(os.environ.get("ODCFN_EXAMPLES", 25)))
@given(cases())
def test_odc_and_collective_equal_single_process_reference(case):
    cfg, world, rpn, sharding, lengths, assignment, options, seed = case
    model, full = qwen_model(cfg), init_params(cfg, seed=seed)
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=seed)
    loss_ref, grads_ref = odcfn.reference_value_and_grad(model, full, batch)
    want = ref_shards(grads_ref, model, world, rpn, sharding)
    for comm in ("odc", "collective"):
        out = run_grad_step(
            full, batch, model, world, ranks_per_node=rpn, sharding=sharding, comm=comm,
            balance=fixed_balancer(assignment), options=options,
        )
        for rank, (grads, metrics) in enumerate(out):
            odcfn.tree_assert_allclose(grads, want[rank], rtol=RTOL, atol=ATOL, what=f"{comm} rank {rank}")
            assert abs(metrics.loss - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
            assert metrics.counters.syncs == 1
            if comm == "odc" and sharding == "full":
                assert metrics.counters.collectives == 0


def test_grad_norm_is_global_norm_of_reference():
    cfg, model, full = tiny()
    batch = odcfn.random_batch([5, 9, 3, 7], cfg.vocab_size, seed=3)
    _, grads_ref = odcfn.reference_value_and_grad(model, full, batch)
    norm = torch.sqrt(sum(g.double().square().sum() for g in odcfn.tree.tree_leaves(grads_ref)))
    for rpn, sharding in [(None, "full"), (2, "hybrid")]:
        out = run_grad_step(full, batch, model, 4, ranks_per_node=rpn, sharding=sharding)
        for _, m in out:
            assert abs(m.grad_norm - float(norm)) < 1e-5 * float(norm)


def test_params_after_adamw_steps_match_torch_adamw():
    cfg, model, full = tiny(TINY)
    batches = [odcfn.random_batch([4, 11, 2, 6, 7], cfg.vocab_size, seed=s) for s in range(3)]
    lr = 1e-2
    # torch AdamW over three *different* minibatches, state carried across them
    params = odcfn.tree_map(lambda x: x.clone().requires_grad_(), full)
    leaves = odcfn.tree.tree_leaves(params)
    opt = torch.optim.AdamW(leaves, lr=lr, weight_decay=0.1)
    for b in batches:
        opt.zero_grad()
        odcfn.reference_loss(model, params, b).backward()
        torch.nn.utils.clip_grad_norm_(leaves, 0.5)
        opt.step()
    want = odcfn.tree_map(lambda x: x.detach(), params)

    world = 3
    for comm in ("odc", "collective"):

        def fn(rank, tr, comm=comm):
            state = make_state(
                full, model, tr, odcfn.adamw(lr, weight_decay=0.1),
                comm=comm, max_tokens_per_microbatch=12, max_grad_norm=0.5,
            )
            for b in batches:
                state, _ = odcfn.train_step(state, b)
            return state.params

        shards = odcfn.run_local(fn, world)
        got = odcfn.unshard(shards, model, odcfn.Mesh(world))
        odcfn.tree_assert_allclose(got, want, rtol=1e-4, atol=1e-6, what=comm)
