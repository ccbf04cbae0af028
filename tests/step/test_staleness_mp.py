"""Bounded staleness across processes (ShmTransport, odcfn.transport.versions_shm): runs with
forced delays read versions up to τ behind, never more, and equal the single-process replay of
their record; disagreeing ranks, a dead peer and a failed update end every rank with an error."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

import odcfn
from odcfn.launch import LaunchError
from odcfn.reference import replay
from odcfn.step import stale
from odcfn.transport.base import TransportError
from odcfn.transport.shm import ShmTransport
from odcfn.tree import tree_leaves
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import make_state, tiny

LR = 0.5


def _batches(n, seed=0):
    cfg, _, _ = tiny()
    return [odcfn.random_batch([5, 9, 3, 7, 4], cfg.vocab_size, seed=seed + s) for s in range(n)]


# --- worker functions (top level: the pool pickles them by reference) -------------------------


def stale_worker(n, seed, delays, config, timeout=30):
    """``n`` stale train_steps, sleeping ``delays[rank][j]`` before step j, then drain."""
    torch.set_num_threads(1)
    _, model, full = tiny()
    mesh = odcfn.Mesh.from_env()
    batches = _batches(n, seed)
    with ShmTransport(mesh, timeout=timeout) as tr:
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), **config)
        ms = []
        for j, b in enumerate(batches):
            time.sleep(delays[mesh.rank][j])
            st, m = odcfn.train_step(st, b)
            ms.append(m)
        st, late = stale.drain(st)
        record = [step[0] for step in stale.record([ms])]  # this rank's (samples, versions) per step
        planned = [step[0] for step in stale.record([ms], plans=True)]  # (plan, versions): exact replay
        reported = sorted({k for m in ms for k in m.extra["reports"]} | set(late))
        return {
            "params": {k: v.clone() for k, v in st.params.items()}, "record": record, "reported": reported,
            "planned": planned,
            "lags": [m.extra["staleness_max"] for m in ms], "syncs": sum(m.counters.syncs for m in ms),
            "wait": [m.extra["version_wait_s"] for m in ms], "step": st.step,
        }


def disagree_worker():
    """Rank 1 trains on another minibatch than rank 0: the owners' fingerprint check refuses."""
    torch.set_num_threads(1)
    _, model, full = tiny()
    mesh = odcfn.Mesh.from_env()
    batches = _batches(3, seed=10 * mesh.rank)
    with ShmTransport(mesh, timeout=20) as tr:
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), staleness=1)
        try:
            for b in batches:
                st, _ = odcfn.train_step(st, b)
            stale.drain(st)
        except (ValueError, TransportError) as e:
            return f"{type(e).__name__}: {e}"
    return "no error"


def dying_worker(timeout):
    """Rank 1 exits hard after one step; rank 0 must raise within about ``timeout``."""
    torch.set_num_threads(1)
    _, model, full = tiny()
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=timeout) as tr:
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), staleness=1)
        t0 = time.monotonic()
        try:
            for j, b in enumerate(_batches(6)):
                if mesh.rank == 1 and j == 1:
                    os._exit(3)
                st, _ = odcfn.train_step(st, b)
            stale.drain(st)
        except TransportError as e:
            return time.monotonic() - t0, str(e), os.environ["ODCFN_SHM_PREFIX"]
    return None


# --- tests ---------------------------------------------------------------------------------


def _unshard(outs):
    _, model, _ = tiny()
    return odcfn.unshard([o["params"] for o in outs], model, odcfn.Mesh(len(outs), 0))


def _max_err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(tree_leaves(a), tree_leaves(b)))


@pytest.mark.parametrize("world,tau,balance", [(2, 1, "lb_mini"), (3, 2, "round_robin"), (2, 1, "steal")])
def test_processes_equal_the_replay_of_their_record(mp_pool, world, tau, balance):  # noqa: F811
    n, seed = 6, 3
    rng = random.Random(world * 7 + tau)
    delays = [[rng.choice([0.0, 0.0, 0.1, 0.3]) for _ in range(n)] for _ in range(world)]
    delays[0] = [0.0] * n  # rank 0 runs ahead: the others' steps are late, so it reads stale
    bal = odcfn.WorkStealing() if balance == "steal" else balance
    outs = mp_pool.run(stale_worker, world, args=(n, seed, delays, {"staleness": tau, "balance": bal}))
    for o in outs:
        assert o["step"] == n and o["syncs"] == 0 and max(o["lags"]) <= tau
        assert o["reported"] == list(range(n))  # every step's figures, each once, late or at the end
    assert any(max(o["lags"]) >= 1 for o in outs)  # it did read stale versions
    _, model, full = tiny()
    record = [[o["record"][k] for o in outs] for k in range(n)]
    got = _unshard(outs)
    want = replay(model, full, odcfn.sgd(LR), _batches(n, seed), record)
    assert _max_err(got, want) < 2e-6
    synchronous = [[(s, {u: k for u in v}) for s, v in r] for k, r in enumerate(record)]
    assert _max_err(got, replay(model, full, odcfn.sgd(LR), _batches(n, seed), synchronous)) > 1e-3


@pytest.mark.parametrize("world", [2, 3])
def test_deterministic_processes_equal_the_exact_replay_bit_for_bit(mp_pool, world):  # noqa: F811
    n, seed = 5, 4
    delays = [[0.0] * n] + [[0.0, 0.2, 0.0, 0.2, 0.0]] * (world - 1)
    config = {"staleness": 1, "deterministic": True, "balance": "lb_mini"}
    outs = mp_pool.run(stale_worker, world, args=(n, seed, delays, config))
    assert any(max(o["lags"]) >= 1 for o in outs)
    _, model, full = tiny()
    record = [[o["planned"][k] for o in outs] for k in range(n)]
    got = _unshard(outs)
    want = replay(model, full, odcfn.sgd(LR), _batches(n, seed), record, exact=True)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(got), tree_leaves(want)))
    sync = [[(plan, dict.fromkeys(v, k)) for plan, v in ranks] for k, ranks in enumerate(record)]
    assert _max_err(got, replay(model, full, odcfn.sgd(LR), _batches(n, seed), sync, exact=True)) > 1e-3


def test_hybrid_units_at_zero_read_the_newest_version(mp_pool):  # noqa: F811
    n = 5
    delays = [[0.0] * n, [0.2] * n]
    outs = mp_pool.run(stale_worker, 2, args=(n, 1, delays, {"staleness": {"head": 0, "embed": 0, "*": 1}}))
    for o in outs:
        for j, (_, versions) in enumerate(o["record"]):
            assert versions["head"] == j and versions["embed"] == j
            assert all(j - v <= 1 for v in versions.values())


def test_ranks_with_different_tau_or_minibatches_raise_on_every_rank(mp_pool):  # noqa: F811
    outs = mp_pool.run(stale_worker, 2, args=(3, 0, [[0.0] * 3] * 2, {"staleness": 1}))
    assert all(o["step"] == 3 for o in outs)  # the control: same τ, same data, no error
    with pytest.raises(Exception, match="staleness differs between ranks"):
        mp_pool.run(_tau_by_rank_worker, 2, timeout=60)
    msgs = mp_pool.run(disagree_worker, 2, timeout=60)
    assert all("differ" in m or "aborted" in m for m in msgs), msgs
    assert any("differ" in m for m in msgs), msgs


def _tau_by_rank_worker():
    torch.set_num_threads(1)
    _, model, full = tiny()
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=20) as tr:
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), staleness=1 + mesh.rank)
        odcfn.train_step(st, _batches(1)[0])


def test_a_dead_peer_raises_within_the_timeout_and_leaves_no_segment(mp_pool):  # noqa: F811
    timeout = 10.0
    with pytest.raises(LaunchError) as info:
        mp_pool.run(dying_worker, 2, args=(timeout,), timeout=60)
    assert "worker died" in info.value.errors[1]
    waited, msg, prefix = info.value.results[0]
    assert "rank 1" in msg and "died" in msg, msg
    assert waited < timeout  # seen by its pid, not by the timeout
    # this run's segments only: other tests (xdist workers) may be running their own meanwhile
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]
