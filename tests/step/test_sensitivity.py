"""Automatic hybrid synchronisation (odcfn.step.sensitivity, bounded staleness): measure() equals
S(u) computed by hand from the single-process reference gradients, at any world size and under
hybrid sharding; hybrid() keeps exactly the most sensitive units at τ = 0; its dict runs stale
with those units reading the newest version; bad inputs are refused."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import odcfn
from odcfn.reference import replay
from odcfn.step import sensitivity, stale
from odcfn.tree import tree_leaves
from tests.util import make_state, tiny


def _batches(cfg, n, seed=0):
    return [odcfn.random_batch([5, 9, 3, 7, 4], cfg.vocab_size, seed=seed + s) for s in range(n)]


def _by_hand(model, full, batches, eps=1e-12):
    """S(u) from the unsharded reference gradients (torch.func), in fp64 after the fact."""
    grads = []
    for b in batches:
        _, g = odcfn.reference_value_and_grad(model, full, b)
        grads.append(
            {u: torch.cat([x.reshape(-1) for x in tree_leaves(g[u])]).double() for u in model.unit_names}
        )
    return {
        u: sum(
            float((grads[t][u] - grads[t - 1][u]).norm()) / (float(grads[t - 1][u].norm()) + eps)
            for t in range(1, len(grads))
        )
        / (len(grads) - 1)
        for u in model.unit_names
    }


def _measure(world, batches, **mesh):
    _, model, full = tiny()
    return odcfn.run_local(
        lambda r, tr: sensitivity.measure(make_state(full, model, tr), batches), world, timeout=60, **mesh
    )


def test_measure_equals_the_reference_at_every_world_size():
    cfg, model, full = tiny()
    batches = _batches(cfg, 3)
    want = _by_hand(model, full, batches)
    (w1,) = _measure(1, batches)
    assert list(w1) == list(model.unit_names)
    for u in want:
        assert w1[u] == pytest.approx(want[u], rel=1e-5), u
    # the scores differ between units by far more than the tolerance, so a mixed-up unit fails
    assert max(want.values()) - min(want.values()) > 1e-3
    for out in (_measure(2, batches), _measure(4, batches, ranks_per_node=2, sharding="hybrid")):
        assert all(o == out[0] for o in out)  # one all-reduce: every rank has the same scores
        for u in w1:  # W shards summed (hybrid: each shard counted once, not per replica)
            assert out[0][u] == pytest.approx(w1[u], rel=1e-5), u


def test_frozen_units_get_no_score_and_measure_leaves_the_state_alone():
    cfg, model, full = tiny()
    batches = _batches(cfg, 2, seed=3)
    want = _by_hand(model, full, batches)

    def fn(rank, tr):
        state = odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=odcfn.sgd(0.5),
            transport=tr,
            trainable=lambda name: not name.startswith("embed."),
        )
        before = {k: v.clone() for k, v in state.params.items()}
        got = sensitivity.measure(state, batches)
        assert state.step == 0 and all(torch.equal(before[k], state.params[k]) for k in before)
        return got

    for got in odcfn.run_local(fn, 2, timeout=60):
        assert list(got) == ["layers.0", "layers.1", "head"]
        for u in got:  # freezing embed does not change the other units' gradients
            assert got[u] == pytest.approx(want[u], rel=1e-5), u


def test_hybrid_keeps_exactly_the_top_units_ties_by_name():
    scores = {"head": 3.0, "embed": 2.0, "layers.0": 2.0, "layers.1": 1.0}
    assert sensitivity.hybrid(scores, 2, n=2) == {"head": 0, "embed": 0, "layers.0": 2, "layers.1": 2}
    assert sensitivity.hybrid(scores, 1, keep=0.5) == sensitivity.hybrid(scores, 1, n=2)
    assert sensitivity.hybrid(scores, 1) == {"head": 0, "embed": 1, "layers.0": 1, "layers.1": 1}  # 0.25
    assert sensitivity.hybrid(scores, 1, keep=0.3) == sensitivity.hybrid(scores, 1, n=2)  # ceil
    assert set(sensitivity.hybrid(scores, 1, n=0).values()) == {1}
    assert set(sensitivity.hybrid(scores, 1, keep=1.0).values()) == {0}
    ten = {f"u{i}": float(i) for i in range(10)}
    assert sum(v == 0 for v in sensitivity.hybrid(ten, 1, keep=0.3).values()) == 3  # not 4: 0.3 * 10


@given(
    st.dictionaries(
        st.sampled_from([f"u{i}" for i in range(8)]), st.sampled_from([0.0, 0.5, 1.0, 2.5]), min_size=1
    ),
    st.data(),
)
def test_hybrid_property_kept_units_outrank_the_rest(scores, data):
    n = data.draw(st.integers(0, len(scores)))
    tau = data.draw(st.integers(1, 4))
    out = sensitivity.hybrid(scores, tau, n=n)
    assert list(out) == list(scores) and set(out.values()) <= {0, tau}
    kept = [u for u, t in out.items() if t == 0]
    rest = [u for u, t in out.items() if t == tau]
    assert len(kept) == n
    for k in kept:
        for r in rest:
            assert (scores[k], r) > (scores[r], k)  # higher score, or equal and earlier by name
    assert sensitivity.hybrid(dict(reversed(list(scores.items()))), tau, n=n) == out  # order-free


def test_the_hybrid_dict_runs_stale_and_its_kept_units_read_the_newest_version():
    """The workflow: measure on the transport, switch the same state to the hybrid config, train
    with a slow rank 1; the kept units read version j at step j on every rank, and the run equals
    the single-process replay of its record."""
    cfg, model, full = tiny()
    probe, batches = _batches(cfg, 3, seed=10), _batches(cfg, 4, seed=20)

    def fn(rank, tr):
        state = make_state(full, model, tr, optimizer=odcfn.sgd(0.5))
        taus = sensitivity.hybrid(sensitivity.measure(state, probe), 1, n=1)
        state = state.replace(config=odcfn.StepConfig(staleness=taus, balance="round_robin"))
        ms = []
        for b in batches:
            time.sleep(0.2 * rank)
            state, m = odcfn.train_step(state, b)
            ms.append(m)
        state, _ = stale.drain(state)
        return taus, state.params, ms

    out = odcfn.run_local(fn, 2, timeout=60)
    taus = out[0][0]
    kept = [u for u, t in taus.items() if t == 0]
    assert len(kept) == 1 and all(o[0] == taus for o in out)
    assert sensitivity.hybrid(_by_hand(model, full, probe), 1, n=1) == taus  # the same top unit
    for _, _, ms in out:
        for j, m in enumerate(ms):
            assert m.extra["versions_read"][kept[0]] == j
            assert m.counters.syncs == 0  # it did run stale
    rec = stale.record([ms for _, _, ms in out])
    got = odcfn.unshard([p for _, p, _ in out], model, odcfn.Mesh(2, 0))
    want = replay(model, full, odcfn.sgd(0.5), batches, rec)
    assert max(float((a - b).abs().max()) for a, b in zip(tree_leaves(got), tree_leaves(want))) < 2e-6


def test_measure_after_a_drained_stale_run_scores_the_drained_params():
    """The state's τ >= 1 is ignored (the measurement is synchronous), and on the transport a
    stale run used the scores are those of the params drain returned."""
    cfg, model, full = tiny()
    batches = _batches(cfg, 5, seed=30)

    def fn(rank, tr):
        state = make_state(full, model, tr, optimizer=odcfn.sgd(0.5), staleness=1)
        for b in batches[:3]:
            state, _ = odcfn.train_step(state, b)
        state, _ = stale.drain(state)
        return sensitivity.measure(state, batches[3:]), state.params

    out = odcfn.run_local(fn, 2, timeout=60)
    params = odcfn.unshard([p for _, p in out], model, odcfn.Mesh(2, 0))
    want = _by_hand(model, params, batches[3:])
    for scores, _ in out:
        for u in want:
            assert scores[u] == pytest.approx(want[u], rel=1e-5), u


def test_ranks_that_disagree_raise_on_every_rank():
    cfg, model, full = tiny()
    batches = _batches(cfg, 3)

    def count(rank, tr):  # rank 1 passes one minibatch fewer: refused before any step
        with pytest.raises(ValueError, match=r"ranks passed \{0: 3, 1: 2\}"):
            sensitivity.measure(make_state(full, model, tr), batches[: 3 - rank])
        return tr.counters.syncs

    assert odcfn.run_local(count, 2, timeout=30) == [0, 0]

    def content(rank, tr):  # same count, another second minibatch on rank 1: grad_step's fingerprint
        mine = [batches[0], batches[1 + rank]]
        with pytest.raises(ValueError, match="ranks disagree"):
            sensitivity.measure(make_state(full, model, tr), mine)

    odcfn.run_local(content, 2, timeout=30)


def test_bad_inputs_are_refused():
    cfg, model, full = tiny()
    batches = _batches(cfg, 2)
    with pytest.raises(TypeError, match="must be an odcfn.TrainState"):
        sensitivity.measure(None, batches)

    def fn(rank, tr):
        state = make_state(full, model, tr)
        for bad, match in [(batches[:1], "at least 2 minibatches"), (iter([]), "got 0")]:
            with pytest.raises(ValueError, match=match):
                sensitivity.measure(state, bad)
        for eps in (0.0, -1.0, math.nan, True):
            with pytest.raises(ValueError, match="eps must be"):
                sensitivity.measure(state, batches, eps=eps)
        return tr.counters.as_dict()

    assert not any(odcfn.run_local(fn, 1)[0].values())  # refused before any communication
    scores = {"head": 1.0, "embed": 0.5}
    for kwargs, match in [
        ({"tau": 0}, "tau must be an int >= 1"),
        ({"tau": True}, "tau must be"),
        ({"tau": 1.0}, "tau must be"),
        ({"tau": 1, "keep": 0.0}, r"keep must be a fraction in \(0, 1\]"),
        ({"tau": 1, "keep": 1.5}, "keep must"),
        ({"tau": 1, "n": 3}, r"n must be an int in \[0, 2\]"),
        ({"tau": 1, "n": -1}, "n must"),
        ({"tau": 1, "keep": 0.5, "n": 1}, "not both"),
    ]:
        with pytest.raises(ValueError, match=match):
            sensitivity.hybrid(scores, **kwargs)
    for bad in ({}, {"head": math.nan}, {"head": -1.0}, {"": 1.0}, [("head", 1.0)]):
        with pytest.raises(ValueError, match="sensitivity.hybrid"):
            sensitivity.hybrid(bad, 1)


def test_the_docs_example_runs(capsys):
    text = (Path(__file__).parents[2] / "docs" / "staleness.md").read_text()
    section = text.split("## Automatic hybrid synchronisation", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/staleness.md", "exec"), {})
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "ok"


def test_the_bench_table_command_runs_small():
    import random

    from odcfn.bench.sensitivity import bench_sensitivity, counting_batch

    b = counting_batch(3, 64, random.Random(0))
    for s in b.samples:  # a counting sequence: one stride per sample, modulo the vocabulary
        steps = (s.tokens[1:] - s.tokens[:-1]) % 64
        assert len(set(steps.tolist())) == 1 and 1 <= int(steps[0]) <= 4
    res = bench_sensitivity(world=2, steps=1, probes=2, samples=2)
    assert list(res["before"]) == list(res["after"]) == list(res["numel"])
    assert len(res["kept"]) == 2  # ceil(0.25 * 6 units)
    assert res["before"] != res["after"]  # measured again at the trained parameters


def test_measure_on_an_undrained_stale_state_reads_one_version_on_every_owner():
    """Issue 40, item 3: after stale steps with a slow rank, each owner's newest applied version
    trails ``state.step`` by a different amount; ``measure`` on that state (not drained) scores
    the params of exactly ``state.step`` updates, as ``log_probs`` reads them, not a mix."""
    cfg, model, full = tiny()
    batches, probe = _batches(cfg, 4, seed=40), _batches(cfg, 2, seed=50)

    def fn(rank, tr):
        state = make_state(full, model, tr, optimizer=odcfn.sgd(2.0), staleness=1)
        for b in batches:
            time.sleep(0.15 * rank)  # rank 0 runs ahead: its owner trails, rank 1's does not
            state, _ = odcfn.train_step(state, b)
        handed = state.params  # each owner's newest applied version: not one version
        scores = sensitivity.measure(state, probe)
        state, _ = stale.drain(state)
        return scores, state.params, handed

    out = odcfn.run_local(fn, 2, timeout=60)
    drained = odcfn.unshard([p for _, p, _ in out], model, odcfn.Mesh(2, 0))
    mixed = odcfn.unshard([h for _, _, h in out], model, odcfn.Mesh(2, 0))
    want, wrong = _by_hand(model, drained, probe), _by_hand(model, mixed, probe)
    assert max(abs(want[u] - wrong[u]) for u in want) > 1e-3  # the mix would have been seen
    for scores, _, _ in out:
        for u in want:
            assert scores[u] == pytest.approx(want[u], rel=1e-5), u
