"""Integer and multi-dimensional extras (MoE routing replay: ``routed_experts`` of shape
(T, MoE layers, top-k)) pass through packing, every balancer, work stealing, the forward-only
log-probs path, a process transport and the minibatch fingerprint unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import odcfn
from odcfn.schedule.policy import POLICIES
from odcfn.step.fingerprint import minibatch_words
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture (multi-process test)
from tests.util import TINY, make_state, tiny

# any integer per-position extra behaves like MoE routing replay's ``routed_experts``; a dense
# model refuses that key itself (it has no experts: tests/moe/test_moe_replay.py)
KEY = "expert_ids"


def routed_batch(lengths, *, seed: int = 0, dtype: torch.dtype = torch.int64, shape=(3, 2)) -> odcfn.Batch:
    """Random tokens with an integer (T, *shape) routing extra and a float per-target extra."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        tokens = torch.randint(0, TINY.vocab_size, (n,), generator=g)
        routed = torch.randint(0, 8, (n, *shape), generator=g).to(dtype)
        extras = {KEY: routed, "advantages": torch.randn(n, generator=g)}
        samples.append(odcfn.Sample(tokens, extras=extras))
    return odcfn.Batch(tuple(samples))


def recording(model: odcfn.Model, batch: odcfn.Batch, seen: list) -> odcfn.Model:
    """``model`` whose first unit records, for each microbatch it runs, its sample ids and
    whether its routing rows are exactly the samples' rows concatenated (same dtype)."""
    first = model.units[0]

    def fwd(params, x, mb):
        want = torch.cat([batch.samples[i].extras[KEY] for i in mb.sample_ids])
        got = mb.extras[KEY]
        seen.append((mb.sample_ids, got.dtype == want.dtype and torch.equal(got.cpu(), want)))
        return first.fwd(params, x, mb)

    return dataclasses.replace(model, units=(dataclasses.replace(first, fwd=fwd), *model.units[1:]))


def check_seen(seen: list, n: int) -> None:
    assert seen and all(ok for _, ok in seen), [ids for ids, ok in seen if not ok]
    assert {i for ids, _ in seen for i in ids} == set(range(n))


# --- pack --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
@pytest.mark.parametrize("split", [[[0, 1, 2, 3]], [[2, 0], [3, 1]], [[3], [1, 2, 0]], [[], [1]]])
def test_pack_concatenates_integer_extras_in_sample_order(dtype, split):
    batch = routed_batch([5, 3, 7, 4], dtype=dtype)
    for ids in split:
        mb = odcfn.pack(batch, ids)
        got = mb.extras[KEY]
        assert got.dtype == dtype and got.shape == (mb.num_tokens, 3, 2)
        if ids:  # row t of the microbatch is input position t: no shift, unlike float extras
            assert torch.equal(got, torch.cat([batch.samples[i].extras[KEY] for i in ids]))
            adv = [batch.samples[i].extras["advantages"] for i in ids]
            shifted = torch.cat([torch.cat([a[1:], a[:1] * 0]) for a in adv])
            assert torch.equal(mb.extras["advantages"], shifted)


def test_multidimensional_float_extras_shift_along_tokens():
    a = odcfn.Sample(torch.tensor([5, 6, 7]), extras={"x": torch.tensor([[1.0, 2], [3, 4], [5, 6]])})
    b = odcfn.Sample(torch.tensor([8, 9]), extras={"x": torch.tensor([[7.0, 8.0], [9.0, 10.0]])})
    mb = odcfn.pack(odcfn.Batch((a, b)), [1, 0])
    assert mb.extras["x"].tolist() == [[9, 10], [0, 0], [3, 4], [5, 6], [0, 0]]
    assert mb.extras["x"].dtype == torch.float32


# --- bad extras ----------------------------------------------------------------------------------


def test_bad_extras_name_the_key_and_sample():
    t = torch.arange(4)
    r = lambda *shape, dtype=torch.int64: torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=rf"extras\['{KEY}'\].*first dimension.*length 4.*\(5, 3, 2\)"):
        odcfn.Sample(t, extras={KEY: r(5, 3, 2)})
    with pytest.raises(ValueError, match=rf"extras\['{KEY}'\].*first dimension"):
        odcfn.Sample(t, extras={KEY: torch.tensor(3)})
    with pytest.raises(ValueError, match=r"extras\['x'\] is not finite at token 2 \(nan\)"):
        odcfn.Sample(t, extras={"x": torch.tensor([[0.0, 0], [0, 0], [0, float("nan")], [0, 0]])})
    ok = odcfn.Sample(t, extras={KEY: r(4, 3, 2)})
    name = rf"extras\['{KEY}'\]"
    with pytest.raises(TypeError, match=rf"samples\[1\]\.{name} has dtype torch.int32.*torch.int64"):
        odcfn.Batch((ok, odcfn.Sample(t, extras={KEY: r(4, 3, 2, dtype=torch.int32)})))
    with pytest.raises(ValueError, match=rf"samples\[2\]\.{name} has per-token shape \(2, 2\).*\(3, 2\)"):
        odcfn.Batch((ok, ok, odcfn.Sample(t, extras={KEY: r(4, 2, 2)})))
    f = lambda *shape: odcfn.Sample(t, extras={"x": torch.zeros(shape)})
    with pytest.raises(ValueError, match=r"samples\[1\]\.extras\['x'\] has per-token shape \(1,\)"):
        odcfn.Batch((f(4), f(4, 1)))


# --- fingerprint -------------------------------------------------------------------------------


def test_fingerprint_hashes_dtype_shape_and_every_element():
    words = lambda b: minibatch_words(b, None, "")[4:]  # the extras' words (names, each one's values)
    base = routed_batch([5, 3], seed=1)
    assert words(base) == words(routed_batch([5, 3], seed=1))

    def edit(b: odcfn.Batch, fn) -> odcfn.Batch:
        *rest, s = b.samples
        return odcfn.Batch((*rest, odcfn.Sample(s.tokens, s.loss_mask, {**s.extras, KEY: fn(s.extras[KEY])})))

    def bump(v: torch.Tensor) -> torch.Tensor:
        v = v.clone()
        v[2, 1, 0] += 1
        return v

    assert words(edit(base, bump)) != words(base)
    assert words(routed_batch([5, 3], seed=1, dtype=torch.int32)) != words(base)  # same values
    one = odcfn.Batch(base.samples[1:])  # (3, 3, 2): the same bytes in another per-token shape
    assert words(edit(one, lambda v: v.reshape(3, 2, 3))) != words(one)


def test_ranks_with_different_routing_are_refused():
    _, model, full = tiny()
    batches = [routed_batch([6, 5, 7], seed=2) for _ in range(2)]
    s = batches[1].samples[0]
    routed = s.extras[KEY].clone()
    routed[4, 2, 1] += 1  # same tokens and rewards, one expert choice differs
    other = odcfn.Sample(s.tokens, s.loss_mask, {**s.extras, KEY: routed})
    batches[1] = odcfn.Batch((other, *batches[1].samples[1:]))

    def fn(rank, tr):
        try:
            odcfn.grad_step(make_state(full, model, tr), batches[rank])
        except ValueError as e:
            return str(e)
        return None

    for msg in odcfn.run_local(fn, 2, timeout=30):
        assert msg is not None and "the values of a per-token extra differ" in msg, msg
        assert f"extras[{KEY!r}]" in msg, msg


# --- balancers, work stealing, log-probs -----------------------------------------------------------


@pytest.mark.parametrize("balance", sorted(POLICIES))
def test_every_balancer_delivers_the_routing_rows(balance):
    from odcfn.models.slow import slow_model

    _, model, full = tiny()
    lengths = [9, 8, 7, 6, 5, 4, 3, 2]
    batch = routed_batch(lengths, seed=3)
    seen: list = []
    kw = dict(balance=balance, max_tokens_per_microbatch=9)
    loss_ref, _ = odcfn.reference_value_and_grad(model, full, batch)

    def fn(rank, tr):
        torch.set_num_threads(1)
        mine = recording(model, batch, seen)
        if balance == "work_stealing" and rank == 1:  # slow: rank 0 takes some of its samples
            mine = slow_model(mine, 8.0)
        return odcfn.grad_step(make_state(full, mine, tr, **kw), batch)[1]

    metrics = odcfn.run_local(fn, 2, timeout=30)
    check_seen(seen, len(lengths))
    assert all(m.loss == pytest.approx(float(loss_ref), rel=1e-5) for m in metrics)
    if balance == "work_stealing":  # the stolen samples were among those checked
        from odcfn.schedule import steal_plan

        own = steal_plan(lengths, 2, 9, cost=odcfn.schedule.cost.DEFAULT_COST).lists
        ran = {i for mb in metrics[0].plan.microbatches for i in mb}
        assert ran & {i for mb in own[1] for i in mb}, "rank 0 ran some of the slow rank's samples"


def test_log_probs_delivers_the_routing_rows():
    _, model, full = tiny()
    batch = routed_batch([6, 3, 8, 5], seed=4)
    seen: list = []

    def fn(rank, tr):
        state = make_state(full, recording(model, batch, seen), tr, balance="work_stealing")
        return odcfn.log_probs(state, batch)

    out = odcfn.run_local(fn, 2, timeout=30)
    check_seen(seen, len(batch))
    plain = odcfn.run_local(lambda rank, tr: odcfn.log_probs(make_state(full, model, tr), batch), 1)[0]
    for a, b in zip(out[0], plain):
        torch.testing.assert_close(a, b)


# --- a process transport -------------------------------------------------------------------------


def shm_routing_worker(lengths, differ_on_rank1):
    """A work-stealing grad_step on a ShmTransport whose ranks each build the routing batch
    (rank 1 with one expert choice changed when ``differ_on_rank1``)."""
    from odcfn.models import init_params, qwen_model
    from odcfn.transport.shm import ShmTransport

    model, full = qwen_model(TINY), init_params(TINY, seed=0)
    batch = routed_batch(lengths, seed=5)
    mesh = odcfn.Mesh.from_env()
    if differ_on_rank1 and mesh.rank == 1:
        s = batch.samples[-1]
        routed = s.extras[KEY].clone()
        routed[0, 0, 0] += 1
        other = odcfn.Sample(s.tokens, s.loss_mask, {**s.extras, KEY: routed})
        batch = odcfn.Batch((*batch.samples[:-1], other))
    seen: list = []
    with ShmTransport(mesh, timeout=30) as tr:
        state = make_state(full, recording(model, batch, seen), tr, balance="work_stealing")
        try:
            _, m = odcfn.grad_step(state, batch)
        except ValueError as e:
            return str(e), seen
        return m.loss, seen


def test_shm_processes_deliver_and_fingerprint_the_routing(mp_pool):  # noqa: F811
    lengths = [5, 9, 3, 7, 4, 6]
    out = mp_pool.run(shm_routing_worker, 2, args=(lengths, False))
    check_seen([x for _, seen in out for x in seen], len(lengths))
    assert out[0][0] == pytest.approx(out[1][0]) and isinstance(out[0][0], float)
    out = mp_pool.run(shm_routing_worker, 2, args=(lengths, True))
    assert all("the values of a per-token extra differ" in msg and KEY in msg for msg, _ in out), out
