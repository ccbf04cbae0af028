"""Hierarchical shards (hpZ) on every transport kind of the conformance suite (in-process ranks,
the CUDA-IPC and NVSHMEM fabrics on CPU in threads, /dev/shm processes with gloo or /dev/shm
collectives, the IPC fabric in processes): W = 4, k = 2, one ``grad_step``; the gradients equal
the single-process reference and the backward's group gathers read in-group peers only, the same
bytes per peer on every kind. The NVSHMEM kind puts every peer on another node, so its group
gathers take the remote-get path."""

from __future__ import annotations

import pytest

import odcfn
from odcfn.schedule import ScheduleOptions
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.step.test_hpz import ASSIGNMENT, ATOL, RTOL
from tests.transport.test_transport_conformance import KINDS, run
from tests.util import fixed_balancer, make_state, ref_shards, tiny

W, K = 4, 2
CFG, MODEL, FULL = tiny()
BATCH = odcfn.random_batch([5, 9, 3, 7, 4, 6], CFG.vocab_size, seed=1)


def hpz_grads(rank, tr):
    opts = ScheduleOptions(prefetch=1, reshard_after_forward=K)
    state = make_state(FULL, MODEL, tr, balance=fixed_balancer(ASSIGNMENT), options=opts)
    grads, m = odcfn.grad_step(state, BATCH)
    return {k: v.clone() for k, v in grads.items()}, m.counters.syncs, dict(tr.group_bytes)


@pytest.mark.parametrize("kind", KINDS)
def test_hpz_equals_reference_and_stays_in_group_on_every_kind(kind, mp_pool):  # noqa: F811
    out = run(kind, mp_pool, hpz_grads, W)
    _, grads_ref = odcfn.reference_value_and_grad(MODEL, FULL, BATCH)
    want = ref_shards(grads_ref, MODEL, W)
    for rank, (grads, syncs, group) in enumerate(out):
        odcfn.tree_assert_allclose(grads, want[rank], rtol=RTOL, atol=ATOL, what=f"{kind} rank {rank}")
        assert syncs == 1
        mine = set(range(rank - rank % K, rank - rank % K + K))
        assert set(group) <= mine - {rank}, (kind, rank, group)
    assert any(group for _, _, group in out)  # some backward read its group
    if kind != "local":  # the same bytes per peer as the in-process ranks
        local = run("local", mp_pool, hpz_grads, W)
        assert [g for _, _, g in out] == [g for _, _, g in local]
