"""Tied embeddings: one matrix owned by embed's shards, read by the head too. Its gradient is
the sum of both uses; the plan gathers embed once more for the head and pushes embed once."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig, QwenModule, init_params, qwen_model
from odcfn.schedule import ScheduleOptions
from odcfn.schedule.plan import AllGather, Gather, ReduceScatter, ScatterAccumulate, compile_plan
from tests.util import make_state, ref_shards, run_grad_step

TIED = QwenConfig(vocab_size=23, d_model=12, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=14,
                  head_dim=8, qk_norm=True, tie_embeddings=True)  # fmt: skip


def _untied_twin(full: dict) -> tuple[QwenConfig, dict]:
    """The same model untied, its lm_head a copy of the embedding."""
    cfg = replace(TIED, tie_embeddings=False)
    head = {**full["head"], "lm_head": {"weight": full["embed"]["embed_tokens"]["weight"].clone()}}
    twin = {**full, "head": head}
    return cfg, twin


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_tied_gradient_is_embedding_use_plus_head_use(world):
    model, full = qwen_model(TIED), init_params(TIED, seed=1)
    g = torch.Generator().manual_seed(2)
    full = odcfn.tree_map(lambda t: t + 0.1 * torch.randn(t.shape, generator=g), full)
    batch = odcfn.random_batch([6, 11, 3, 9, 5], TIED.vocab_size, seed=4)
    ucfg, twin = _untied_twin(full)
    _, g_untied = odcfn.reference_value_and_grad(qwen_model(ucfg), twin, batch)
    both = g_untied["embed"]["embed_tokens"]["weight"] + g_untied["head"]["lm_head"]["weight"]
    loss_ref, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    torch.testing.assert_close(g_ref["embed"]["embed_tokens"]["weight"], both, rtol=1e-5, atol=1e-7)
    assert "lm_head" not in g_ref["head"]
    want = ref_shards(g_ref, model, world)
    for comm in ("odc", "collective"):
        for balance in ("lb_mini", "round_robin"):
            out = run_grad_step(
                full, batch, model, world, comm=comm, balance=balance, max_tokens_per_microbatch=14
            )
            for rank, (grads, m) in enumerate(out):
                odcfn.tree_assert_allclose(grads, want[rank], rtol=2e-4, atol=2e-6, what=f"{comm} {rank}")
                assert abs(m.loss - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
                assert m.counters.syncs == 1
                # the plan IR: embed is gathered again for the head, and pushed once per microbatch
                n = len(m.plan.microbatches)
                if comm == "odc":
                    pushes = [s for s in m.plan.steps if isinstance(s, ScatterAccumulate)]
                    assert len(pushes) == n * len(model.units)
                    assert sum(s.unit == "embed" for s in pushes) == n
                else:
                    rs = [s for s in m.plan.steps if isinstance(s, ReduceScatter) and s.unit == "embed"]
                    assert len(rs) == n


def test_work_stealing_on_a_tied_model():
    model, full = qwen_model(TIED), init_params(TIED, seed=6)
    batch = odcfn.random_batch([9, 3, 12, 5, 7, 4, 10], TIED.vocab_size, seed=8)
    _, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    want = ref_shards(g_ref, model, 3)
    out = run_grad_step(full, batch, model, 3, balance="work_stealing", max_tokens_per_microbatch=12)
    for rank, (grads, m) in enumerate(out):
        odcfn.tree_assert_allclose(grads, want[rank], rtol=2e-4, atol=2e-6, what=f"rank {rank}")
        assert any(getattr(s, "uses", ()) == ("embed",) for s in m.plan.steps)


def test_plan_shows_the_extra_gather():
    units = qwen_model(TIED).unit_names
    uses = ScheduleOptions(uses=qwen_model(TIED).uses)
    tied = compile_plan(units, (((0,), (1,)),), 0, "odc", uses)
    plain = compile_plan(units, (((0,), (1,)),), 0, "odc")
    embed_gathers = [sum(isinstance(s, Gather) and s.unit == "embed" for s in p.steps) for p in (tied, plain)]
    assert embed_gathers[0] == embed_gathers[1] + 2  # one more per microbatch, for the head
    assert "Forward           head mb0 uses embed" in str(tied)
    assert "Backward          head mb1 uses embed" in str(tied)
    coll = compile_plan(units, (((0,),), ((1,),)), 1, "collective", uses)
    assert sum(isinstance(s, AllGather) and s.unit == "embed" for s in coll.steps) == 3
    # without resharding embed stays gathered from its forward to its backward: no extra gather
    keep = compile_plan(units, (((0,),),), 0, "odc", replace(uses, reshard_after_forward=False))
    assert sum(isinstance(s, Gather) and s.unit == "embed" for s in keep.steps) == 1
    with pytest.raises(ValueError, match="uses"):
        compile_plan(units, (((0,),),), 0, "odc", ScheduleOptions(uses=(("embed", ("head",)),)))


def test_layout_prints_the_tie_and_the_head_has_no_matrix():
    model = qwen_model(TIED)
    text = str(odcfn.make_layout(model, odcfn.Mesh(2)))
    assert "head" in text and "+ reads embed (tied: one copy)" in text
    assert TIED.num_params == replace(TIED, tie_embeddings=False).num_params - TIED.vocab_size * TIED.d_model


def test_simulator_times_the_extra_gather():
    from odcfn.schedule.simulate import A100_COMM, Workload, simulate

    model = qwen_model(replace(TIED, vocab_size=50_000))  # embed is most of the bytes
    work = Workload.of_model(model, param_bytes=1e8)  # the gathers outlast the compute
    assignment = (((0,), (2,)), ((1,), (3,)))
    lengths = [400, 300, 200, 100]
    runs = {}
    for name, opts in [("plain", ScheduleOptions()), ("tied", ScheduleOptions(uses=model.uses))]:
        plans = [compile_plan(model.unit_names, assignment, r, "odc", opts) for r in range(2)]
        runs[name] = simulate(plans, lengths, workload=work, comm=A100_COMM, mesh=odcfn.Mesh(2))
    assert runs["tied"].makespan > runs["plain"].makespan
    ev, plain_ev = runs["tied"].events[0], runs["plain"].events[0]
    gathers = [e for e in ev if e.kind == "gather" and e.name == "embed"]
    assert len(gathers) == sum(e.kind == "gather" and e.name == "embed" for e in plain_ev) + 2
    # the head's forward waits for the embed gather issued for it
    head_fwd = next(e for e in ev if e.kind == "forward" and e.name == "head")
    assert head_fwd.start >= gathers[1].end


def test_module_mirror_sums_both_uses():
    """QwenModule (the FSDP2 parity mirror) with tie: one Parameter, autograd sums both uses."""
    model, full = qwen_model(TIED), init_params(TIED, seed=3)
    batch = odcfn.random_batch([5, 7], TIED.vocab_size, seed=1)
    mod = QwenModule(TIED)
    mod.load_params(full)
    assert "head.lm_head.weight" not in dict(mod.named_parameters())
    from odcfn.batch import pack

    (mod(pack(batch, [0, 1])) / batch.num_loss_tokens).backward()
    _, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    torch.testing.assert_close(mod.embed.embed_tokens.weight.grad, g_ref["embed"]["embed_tokens"]["weight"])


def test_adamw_steps_on_a_tied_model_match_torch():
    model, full = qwen_model(TIED), init_params(TIED, seed=5)
    batches = [odcfn.random_batch([4, 9, 6], TIED.vocab_size, seed=s) for s in range(3)]
    params = odcfn.tree_map(lambda x: x.clone().requires_grad_(), full)
    opt = torch.optim.AdamW(odcfn.tree.tree_leaves(params), lr=1e-2, weight_decay=0.1)
    for b in batches:
        opt.zero_grad()
        odcfn.reference_loss(model, params, b).backward()
        opt.step()
    want = odcfn.tree_map(lambda x: x.detach(), params)

    def fn(rank, tr):
        state = make_state(full, model, tr, odcfn.adamw(1e-2, weight_decay=0.1), balance="lb_mini",
                           max_tokens_per_microbatch=12)  # fmt: skip
        for b in batches:
            state, _ = odcfn.train_step(state, b)
        return state.params

    got = odcfn.unshard(odcfn.run_local(fn, 3), model, odcfn.Mesh(3))
    odcfn.tree_assert_allclose(got, want, rtol=1e-4, atol=1e-6)
