"""Bounded staleness (StepConfig.staleness, issue 31): a run with forced delays reads versions up
to τ behind, never more, and equals the single-process replay of its record; τ = 0 units stay
synchronous; bad configurations are refused before any communication; a dead peer raises."""

from __future__ import annotations

import random
import threading
import time

import pytest

import odcfn
from odcfn.reference import replay
from odcfn.step import stale
from odcfn.transport.local import LocalTransport
from odcfn.tree import tree_leaves
from tests.util import make_state, tiny

LR = 0.5  # large enough that reading another version moves the params far beyond fp32 noise


def _batches(cfg, n, seed=0):
    return [odcfn.random_batch([5, 9, 3, 7, 4], cfg.vocab_size, seed=seed + s) for s in range(n)]


def _run(world, batches, *, before=None, optimizer=None, timeout=30, **config):
    """train_step over ``batches`` on every rank, ``before(rank, step)`` called ahead of each
    step (forced delays), then drain; returns [(final shards, [metrics])] by rank."""
    cfg, model, full = tiny()

    def fn(rank, tr):
        st = make_state(full, model, tr, optimizer=optimizer or odcfn.sgd(LR), **config)
        ms = []
        for j, b in enumerate(batches):
            if before is not None:
                before(rank, j)
            st, m = odcfn.train_step(st, b)
            ms.append(m)
        st, _ = stale.drain(st)
        return st.params, ms

    return odcfn.run_local(fn, world, timeout=timeout)


def _max_err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(tree_leaves(a), tree_leaves(b)))


def _check_against_replay(out, batches, world, optimizer=None, tol=2e-6):
    """The run equals the replay of its record; the synchronous replay of the same schedule does
    not (so a run that ignored the recorded versions would fail)."""
    _, model, full = tiny()
    rec = stale.record([m for _, m in out])
    got = odcfn.unshard([p for p, _ in out], model, odcfn.Mesh(world, 0))
    want = replay(model, full, optimizer or odcfn.sgd(LR), batches, rec)
    assert _max_err(got, want) < tol  # fp32 summation order (docs/staleness.md)
    sync = [[(s, {u: k for u in v}) for s, v in r] for k, r in enumerate(rec)]
    assert _max_err(got, replay(model, full, optimizer or odcfn.sgd(LR), batches, sync)) > 1e-3


@pytest.mark.parametrize("tau", [1, 2])
def test_forced_lag_reaches_tau_never_exceeds_it_and_equals_the_replay(tau):
    """Rank 1 starts step j >= 1 only after rank 0 finished step j + τ: rank 0 must then read
    version j at step j + τ (lag exactly τ), and nothing may wait on rank 1 before that."""
    cfg, _, _ = tiny()
    n = 4 + tau
    batches = _batches(cfg, n)
    finished = [threading.Event() for _ in range(n)]

    def before(rank, j):
        if rank == 0 and j:  # rank 0 has finished step j - 1
            finished[j - 1].set()
        if rank == 1 and 1 <= j <= n - 2 - tau:  # wait until rank 0 finished step j + τ
            assert finished[j + tau].wait(20)

    out = _run(2, batches, before=before, staleness=tau)
    lags = [[j - v for v in m.extra["versions_read"].values()] for j, m in enumerate(out[0][1])]
    assert max(max(x) for x in lags) == tau
    for _, ms in out:
        for j, m in enumerate(ms):
            assert 0 <= m.extra["staleness_max"] <= tau
            assert all(0 <= j - v <= tau for v in m.extra["versions_read"].values())
            assert m.counters.syncs == 0  # no global synchronisation at all
    _check_against_replay(out, batches, 2)


@pytest.mark.parametrize("world,tau,balance", [(3, 1, "lb_mini"), (2, 2, odcfn.WorkStealing())])
def test_drawn_delays_equal_the_replay(world, tau, balance):
    cfg, _, _ = tiny()
    batches = _batches(cfg, 5, seed=7)
    rng = random.Random(world * 10 + tau)
    delays = [[rng.choice([0.0, 0.0, 0.05, 0.15]) for _ in batches] for _ in range(world)]
    out = _run(world, batches, before=lambda r, j: time.sleep(delays[r][j]), staleness=tau, balance=balance)
    for _, ms in out:
        assert all(m.extra["staleness_max"] <= tau for m in ms)
    _check_against_replay(out, batches, world)


def test_adamw_state_follows_the_versions():
    cfg, _, _ = tiny()
    batches = _batches(cfg, 4, seed=3)
    opt = odcfn.adamw(0.05)
    out = _run(2, batches, before=lambda r, j: time.sleep(0.1 * r), staleness=1, optimizer=opt)
    assert any(m.extra["staleness_max"] for m in out[0][1])
    # Adam divides by sqrt(v): a near-zero gradient element's rounding moves its update by up to
    # lr x O(1e-4) (measured 6e-6 at lr 0.05), still far below a version's difference
    _check_against_replay(out, batches, 2, optimizer=opt, tol=5e-5)


def test_units_at_zero_stay_synchronous():
    cfg, _, _ = tiny()
    batches = _batches(cfg, 4, seed=1)
    out = _run(2, batches, before=lambda r, j: time.sleep(0.2 * r), staleness={"head": 0, "*": 1})
    for _, ms in out:
        for j, m in enumerate(ms):
            assert m.extra["versions_read"]["head"] == j  # the hybrid barrier: never behind
    assert max(j - m.extra["versions_read"]["layers.0"] for j, m in enumerate(out[0][1])) == 1
    _check_against_replay(out, batches, 2)


def test_metrics_arrive_late_and_every_step_is_reported_once():
    cfg, model, full = tiny()
    batches = _batches(cfg, 4, seed=5)

    def fn(rank, tr):
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), staleness=1)
        reports = {}
        for b in batches:
            time.sleep(0.1 * rank)
            st, m = odcfn.train_step(st, b)
            assert not set(reports) & set(m.extra["reports"])
            reports.update(m.extra["reports"])
        st, rest = stale.drain(st)
        reports.update(rest)
        return reports

    def sync(rank, tr):  # the synchronous run's first step: the same loss at step 0
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR))
        return odcfn.train_step(st, batches[0])[1]

    got = odcfn.run_local(fn, 2, timeout=30)
    first = odcfn.run_local(sync, 2, timeout=30)[0]
    for reports in got:
        assert sorted(reports) == list(range(len(batches)))
        assert reports[0]["loss"] == pytest.approx(first.loss, rel=1e-6)
        assert reports[0]["grad_norm"] == pytest.approx(first.grad_norm, rel=1e-5)


@pytest.mark.parametrize("value", [-1, True, 1.5, "1", {}, {"*": -1}, {"*": True}, {1: 1}, {"": 1}])
def test_bad_staleness_values_name_the_field(value):
    with pytest.raises(ValueError, match="StepConfig.staleness"):
        odcfn.StepConfig(staleness=value)


def test_collective_cannot_be_stale_and_zero_is_the_default():
    assert odcfn.StepConfig().staleness == 0
    with pytest.raises(ValueError, match="needs comm='odc'"):
        odcfn.StepConfig(comm="collective", staleness=1)
    odcfn.StepConfig(comm="collective", staleness={"*": 0})  # all synchronous: fine


class _NoVersions(LocalTransport):
    versions = None  # a transport without parameter versions


@pytest.mark.parametrize(
    "config,match",
    [
        ({"staleness": {"head": 0, "mlp*": 1}}, "'mlp\\*' matches no unit"),
        ({"staleness": 1, "max_grad_norm": 1.0}, "max_grad_norm cannot be combined"),
        ({"staleness": 1, "nonfinite": "skip"}, "nonfinite='skip' cannot"),
        ({"staleness": 1, "donate": True}, "donate=True cannot"),
    ],
)
def test_refusals_come_before_any_communication(config, match):
    cfg, model, full = tiny()
    batch = _batches(cfg, 1)[0]
    world = odcfn.LocalWorld(2)

    def fn(rank, tr):
        with pytest.raises(ValueError, match=match):
            odcfn.train_step(make_state(full, model, tr, **config), batch)
        return tr.counters.as_dict()

    counters = odcfn.run_local(fn, 2, transport=lambda w, r: world.transport(r))
    assert all(not any(c.values()) for c in counters) and world.versions is None


def test_grad_step_hybrid_and_transports_without_versions_refuse():
    cfg, model, full = tiny()
    batch = _batches(cfg, 1)[0]

    def fn(rank, tr):
        with pytest.raises(ValueError, match="grad_step cannot run"):
            odcfn.grad_step(make_state(full, model, tr, staleness=1), batch)
        with pytest.raises(TypeError, match="needs a transport with parameter versions"):
            odcfn.train_step(make_state(full, model, _NoVersions(tr.world, tr.mesh), staleness=1), batch)

    odcfn.run_local(fn, 2)

    def hybrid(rank, tr):
        with pytest.raises(ValueError, match="hybrid sharding"):
            odcfn.train_step(make_state(full, model, tr, staleness=1), batch)

    odcfn.run_local(hybrid, 4, ranks_per_node=2, sharding="hybrid")


def test_ranks_that_disagree_raise_not_hang():
    cfg, model, full = tiny()
    batches = _batches(cfg, 2)

    def different_batches(rank, tr):
        st = make_state(full, model, tr, staleness=1)
        st, _ = odcfn.train_step(st, batches[rank])
        stale.drain(st)

    with pytest.raises(ValueError, match="ranks disagree on the minibatch"):
        odcfn.run_local(different_batches, 2, timeout=10)

    def different_tau(rank, tr):
        odcfn.train_step(make_state(full, model, tr, staleness=1 + rank), batches[0])

    with pytest.raises(ValueError, match="staleness differs between ranks"):
        odcfn.run_local(different_tau, 2, timeout=10)


def test_a_dead_peer_raises_within_the_timeout():
    cfg, model, full = tiny()
    batches = _batches(cfg, 4)

    def fn(rank, tr):
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), staleness=1)
        for b in batches[: 1 if rank else None]:  # rank 1 dies after its first step
            st, _ = odcfn.train_step(st, b)

    t0 = time.perf_counter()
    with pytest.raises(odcfn.TransportError, match="timed out after 2"):
        odcfn.run_local(fn, 2, timeout=2)
    assert time.perf_counter() - t0 < 15


def test_the_docs_example_runs_and_matches_its_replay(capsys):
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "staleness.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/staleness.md", "exec"), {})
    lines = capsys.readouterr().out.strip().splitlines()
    assert float(lines[-1]) < 2e-6
