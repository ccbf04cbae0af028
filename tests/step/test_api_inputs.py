"""An adversarial pass over the public API: hostile inputs are refused by name on every rank
before any communication, and other model shapes (0-1 layers, odd head counts, tied, Qwen3's
free head_dim) on W = 1-5 full and hybrid meshes give the single-process reference's gradients
for ODC, collective and work stealing; a TrainState survives ``tree_map``."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.schedule.plan import compile_forward_plan
from tests.util import make_state, ref_shards, run_grad_step, tiny

CFG, MODEL, FULL = tiny()
BATCH = odcfn.random_batch([7, 5, 9], CFG.vocab_size)


def _every_rank_raises(fn, world=2):
    """``fn(state)`` on every rank; each rank's error (type name, message), or None if it
    returned. A TransportError on any rank would mean some rank communicated first."""

    def body(rank, tr):
        try:
            fn(make_state(FULL, MODEL, tr))
        except (TypeError, ValueError) as e:
            return type(e).__name__, str(e)
        return None

    return odcfn.run_local(body, world, timeout=20)


def test_step_config_refuses_a_loss_that_is_not_one():
    for bad in ("cross_entropy", object()):
        with pytest.raises(TypeError, match="StepConfig.loss"):
            odcfn.StepConfig(loss=bad)
    with pytest.raises(TypeError, match="StepConfig.loss"):
        odcfn.StepConfig().replace(loss=lambda logp: logp)


@pytest.mark.parametrize("field", ["config", "model", "optimizer", "transport"])
def test_a_replaced_static_field_is_refused_by_name_on_every_rank(field):
    calls = [
        lambda s: odcfn.train_step(s, BATCH), lambda s: odcfn.grad_step(s, BATCH),
        lambda s: odcfn.log_probs(s, BATCH), lambda s: odcfn.gather_params(s),
    ]
    for call in calls:
        out = _every_rank_raises(lambda s, call=call: call(s.replace(**{field: "oops"})))
        assert out == [out[0]] * 2 and out[0][0] == "TypeError", out
        assert f"TrainState.{field}" in out[0][1]


def test_loss_mask_values_other_than_0_1_are_refused():
    tokens = torch.tensor([1, 2, 3, 4])
    for mask in ([0, 2, 1, 1], [0.0, 0.5, 1.0, 1.0], [0, -1, 1, 1]):
        with pytest.raises(ValueError, match="Sample.loss_mask must hold only 0/1"):
            odcfn.Sample(tokens, loss_mask=torch.tensor(mask))


def test_int_and_float_0_1_masks_train_like_the_bool_mask():
    tokens = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8])]
    masks = [torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 1, 1])]
    ref_batch = odcfn.Batch(tuple(odcfn.Sample(t, loss_mask=m.bool()) for t, m in zip(tokens, masks)))
    _, ref = odcfn.reference_value_and_grad(MODEL, FULL, ref_batch)
    want = ref_shards(ref, MODEL, 2)
    for dtype in (torch.int64, torch.float32):
        batch = odcfn.Batch(tuple(odcfn.Sample(t, loss_mask=m.to(dtype)) for t, m in zip(tokens, masks)))
        assert batch.num_loss_tokens == ref_batch.num_loss_tokens == 5
        for (grads, _), w in zip(run_grad_step(FULL, batch, MODEL, 2), want):
            odcfn.tree_assert_allclose(grads, w, rtol=2e-4, atol=1e-6)


def test_gather_params_and_log_probs_refuse_bools():
    out = _every_rank_raises(lambda s: odcfn.gather_params(s, dst=True))
    assert all(o is not None and "dst must be a rank" in o[1] for o in out), out
    out = _every_rank_raises(lambda s: odcfn.log_probs(s, BATCH, temperature=True))
    assert all(o is not None and "temperature" in o[1] for o in out), out
    with pytest.raises(ValueError, match="temperature"):
        odcfn.losses.LogProbs(temperature=float("inf"))


def test_create_refuses_an_opt_state_of_another_optimizer_or_mesh():
    def body(rank, tr):
        errors = []
        sgd_state = make_state(FULL, MODEL, tr).opt_state
        w3 = odcfn.shard(FULL, MODEL, odcfn.Mesh(3, 0))
        for opt_state in (sgd_state, odcfn.adamw(1e-3).init(w3)):
            try:
                odcfn.TrainState.create(params=FULL, model=MODEL, optimizer=odcfn.adamw(1e-3),
                                        transport=tr, opt_state=opt_state)
            except ValueError as e:
                errors.append(str(e))
        return errors

    for errors in odcfn.run_local(body, 2, timeout=20):
        assert len(errors) == 2 and all("TrainState.create: opt_state" in e for e in errors), errors
        assert "gives shape" in errors[1]


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"n_layers": -1}, "n_layers"), ({"n_layers": 1.5}, "n_layers"), ({"vocab_size": 0}, "vocab_size"),
     ({"n_kv_heads": 0}, "n_kv_heads"), ({"n_heads": True, "n_kv_heads": 1}, "n_heads"),
     ({"d_ff": 0}, "d_ff"), ({"head_dim": 0}, "head_dim")],
)
def test_qwen_config_refuses_bad_sizes_by_name(kw, field):
    with pytest.raises(ValueError, match=f"QwenConfig.{field}"):
        QwenConfig(**kw)


def test_run_local_refuses_a_transport_that_is_not_a_factory():
    with pytest.raises(TypeError, match="run_local: transport must be a factory"):
        odcfn.run_local(lambda r, t: None, 2, transport=3)


_SMALL = dict(vocab_size=23, d_model=12, n_heads=3, n_kv_heads=1, d_ff=10)
_SHAPES = {
    "0 layers": QwenConfig(n_layers=0, **_SMALL),
    "1 layer, 3 heads, 1 kv head": QwenConfig(n_layers=1, **_SMALL),
    "tied, 1 layer": QwenConfig(n_layers=1, tie_embeddings=True, **_SMALL),
    "qwen3 head_dim 8 != 12/3, tied": QwenConfig(
        n_layers=2, head_dim=8, qk_norm=True, qkv_bias=False, tie_embeddings=True, **_SMALL),
    "llama o_bias, 6 heads, 2 kv": QwenConfig(
        vocab_size=19, d_model=12, n_layers=1, n_heads=6, n_kv_heads=2, d_ff=8, qkv_bias=False, o_bias=True),
}
_MESHES = [(1, None, "full"), (2, None, "full"), (3, None, "full"), (4, 2, "hybrid"), (5, None, "full"),
           (2, 1, "hybrid")]
_MODES = [("odc", "lb_mini"), ("collective", "lb_micro"), ("odc", "work_stealing")]


@pytest.mark.parametrize("shape", list(_SHAPES))
@pytest.mark.parametrize("mesh", range(len(_MESHES)))
def test_other_model_shapes_match_the_reference(shape, mesh):
    cfg = _SHAPES[shape]
    world, rpn, sharding = _MESHES[mesh]
    comm, balance = _MODES[(mesh + len(shape)) % len(_MODES)]  # every shape meets every mode
    model, full = qwen_model(cfg), init_params(cfg, seed=1)
    batch = odcfn.random_batch([5, 1, 7, 2, 6], cfg.vocab_size, seed=2)  # a one-token sample too
    loss, ref = odcfn.reference_value_and_grad(model, full, batch)
    got = run_grad_step(full, batch, model, world, ranks_per_node=rpn, sharding=sharding,
                        comm=comm, balance=balance, max_tokens_per_microbatch=8)
    for (grads, metrics), want in zip(got, ref_shards(ref, model, world, rpn, sharding)):
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
        odcfn.tree_assert_allclose(grads, want, rtol=2e-4, atol=1e-6)


def test_a_step_after_tree_map_over_the_state():
    def body(rank, tr):
        state = make_state(FULL, MODEL, tr, optimizer=odcfn.sgd(0.1, momentum=0.9))  # opt_state: tensors
        want, _ = odcfn.train_step(state, BATCH)
        is_t = lambda x: isinstance(x, torch.Tensor)
        clone = odcfn.tree_map(lambda x: x.clone() if is_t(x) else x, state)
        assert type(clone) is odcfn.TrainState and clone.transport is state.transport
        round_trip = odcfn.tree_map(lambda x: x.double().float() if is_t(x) else x, state)
        for s in (clone, round_trip):  # ODC sums pushes in arrival order: not bit for bit
            got, _ = odcfn.train_step(s, BATCH)
            odcfn.tree_assert_allclose(got.params, want.params, rtol=1e-5, atol=1e-7)
            odcfn.tree_assert_allclose(got.opt_state, want.opt_state, rtol=1e-4, atol=1e-7)
            assert got.step == 1
        bf16 = odcfn.tree_map(lambda x: x.bfloat16() if is_t(x) else x, state)
        try:
            odcfn.train_step(bf16, BATCH)
        except ValueError as e:
            return str(e)

    for msg in odcfn.run_local(body, 2, timeout=30):
        assert "has dtype torch.bfloat16, expected torch.float32" in msg


@pytest.mark.parametrize(
    ("assignment", "msg"),
    [([[[0]], [[2]]], r"left samples \[1\] unassigned"), ([[[0, 1]], [[1, 2]]], "gave sample 1 twice"),
     ([[[0, 1]], [[2, 5]]], "put 5 in rank 1's"), ([[[0, 1]], [[-1, 2]]], "put -1 in rank 1's"),
     ([[[False, 1]], [[2]]], "put False in rank 0's"), ([[[0, 1, 2]]], "returned 1 rank lists"),
     ([[[0]], [[1]], [[2]]], "returned 3 rank lists")],
)
def test_a_balancer_callable_that_drops_or_doubles_samples_is_refused(assignment, msg):
    for comm, call in (("odc", odcfn.grad_step), ("collective", odcfn.grad_step), ("odc", odcfn.log_probs)):
        def body(rank, tr, comm=comm, call=call):
            state = make_state(FULL, MODEL, tr, comm=comm, balance=lambda lengths, w, cap: assignment)
            with pytest.raises(ValueError, match=msg):
                call(state, BATCH)
            return True

        assert odcfn.run_local(body, 2, timeout=20) == [True, True]


def test_a_balancer_that_differs_by_rank_is_caught_by_the_fingerprint():
    def body(rank, tr):
        mine = [[[0, 1]], [[2]]] if rank == 0 else [[[0]], [[1, 2]]]  # sample 1 on both ranks
        state = make_state(FULL, MODEL, tr, balance=lambda lengths, w, cap: mine)
        with pytest.raises(ValueError, match="ranks disagree on the minibatch"):
            odcfn.train_step(state, BATCH)
        return True

    assert odcfn.run_local(body, 2, timeout=20) == [True, True]


def test_load_refuses_a_checkpoint_of_another_optimizer(tmp_path):
    def body(rank, tr):
        odcfn.save(tmp_path / "sgd", make_state(FULL, MODEL, tr))
        with pytest.raises(ValueError, match="odcfn.load: the opt_state of checkpoint"):
            odcfn.load(tmp_path / "sgd", make_state(FULL, MODEL, tr, optimizer=odcfn.adamw(1e-3)))
        return True

    assert odcfn.run_local(body, 2, timeout=30) == [True, True]


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"kl_loss_coef": float("nan")}, "kl_loss_coef"), ({"entropy_coeff": float("inf")}, "entropy_coeff"),
     ({"clip_ratio_high": "0.28"}, "clip_ratio_high"), ({"clip_ratio_c": True}, "clip_ratio_c"),
     ({"temperature": True}, "temperature"), ({"temperature": "hot"}, "temperature")],
)
def test_policy_gradient_refuses_non_finite_or_non_numeric_settings(kw, field):
    with pytest.raises(ValueError, match=field):
        odcfn.losses.policy_gradient(**kw)


@pytest.mark.parametrize(("world", "prefetch"), [(7, 1), (6, 2), (3, 2), (2, 3)])
def test_collective_log_probs_when_ranks_run_different_microbatch_counts(world, prefetch):
    """Ranks with fewer (or no) microbatches must still issue the all-gathers in the same order:
    the prefetch moved a gather above another one on them, pairing different units' shards."""
    batch = odcfn.random_batch([5, 1, 7, 2, 3, 4], CFG.vocab_size, seed=3)
    options = odcfn.ScheduleOptions(prefetch=prefetch)

    def body(rank, tr):
        state = make_state(FULL, MODEL, tr, comm="collective", max_tokens_per_microbatch=7, options=options)
        return odcfn.log_probs(state, batch)

    want = odcfn.reference_loss(MODEL, FULL, batch).item() * batch.num_loss_tokens  # summed -logp
    for got in odcfn.run_local(body, world, timeout=20):
        assert -sum(float(x.sum()) for x in got) == pytest.approx(want, rel=1e-5)
        for i, s in enumerate(batch.samples):  # each sample's own token mean, independently
            one = odcfn.Batch((s,)) if s.length > 1 else None
            if one is not None:
                mean = odcfn.reference_loss(MODEL, FULL, one).item()
                assert -float(got[i][1:].mean()) == pytest.approx(mean, rel=1e-5), i  # [0] = 0


def test_forward_plans_all_gather_in_the_same_order_on_every_rank():
    units = MODEL.unit_names
    assignment = (((0,), (1,), (2,)), ((3,),), ())
    for prefetch in range(4):
        options = odcfn.ScheduleOptions(prefetch=prefetch)
        orders = {
            tuple(s.unit for s in compile_forward_plan(units, assignment, r, "collective", options).steps
                  if type(s).__name__ == "AllGather")
            for r in range(len(assignment))
        }
        assert orders == {tuple(units)}, (prefetch, orders)
