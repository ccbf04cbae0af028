"""Hierarchical shards (hpZ) on the arena transports (``odcfn.transport.gpu._hpz``), run without a
GPU: the CUDA-IPC fabric on CPU arenas in /dev/shm, ranks as threads (the protocol the GPU runs,
through the torch reference copies instead of the Triton kernels).

- W = 4, k = 2: gradients equal the single-process reference at two parameter versions on one
  transport (the second step's slices are the second step's), the backward's group gathers read
  in-group peers only and move the same bytes per peer as ``LocalTransport``'s;
- a group peer that never builds its slice ends the gather in ``TransportError`` within the
  timeout; a k that disagrees, a missing reservation and a wrong buffer are named.
"""

from __future__ import annotations

import time

import pytest
import torch

import odcfn
from odcfn.schedule import ScheduleOptions
from odcfn.transport.base import TransportError
from odcfn.transport.gpu._protocol import pack_stamp
from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport
from odcfn.transport.local import LocalCollectives
from tests.step.test_hpz import ASSIGNMENT, ATOL, RTOL
from tests.util import fixed_balancer, make_state, ref_shards, tiny

W, K = 4, 2
CFG, MODEL, FULL = tiny()
BATCH = odcfn.random_batch([5, 9, 3, 7, 4, 6], CFG.vocab_size, seed=1)
FULL2 = odcfn.tree_map(lambda v: v * 0.9 + 0.01, FULL)  # a second parameter version


def _ipc(timeout):
    def make(world, rank):
        return cuda_ipc_transport(world.mesh.with_rank(rank), world.store, LocalCollectives(world, rank),
                                  device="cpu", timeout=timeout)
    return make


def _body(rank, tr):
    opts = ScheduleOptions(prefetch=1, reshard_after_forward=K)
    out = []
    for full in (FULL, FULL2):  # one transport, two steps
        before = dict(tr.group_bytes)
        state = make_state(full, MODEL, tr, balance=fixed_balancer(ASSIGNMENT), options=opts)
        g, m = odcfn.grad_step(state, BATCH)
        group = {p: b - before.get(p, 0) for p, b in tr.group_bytes.items() if b != before.get(p, 0)}
        out.append(({k: v.clone() for k, v in g.items()}, m.loss, m.counters.syncs, group))
    return out


def test_hpz_on_the_ipc_fabric_equals_reference_and_local_counts():
    got = odcfn.run_local(_body, W, transport=_ipc(30), timeout=30)
    local = odcfn.run_local(_body, W, timeout=30)
    for s, full in enumerate((FULL, FULL2)):
        loss_ref, grads_ref = odcfn.reference_value_and_grad(MODEL, full, BATCH)
        want = ref_shards(grads_ref, MODEL, W)
        for rank in range(W):
            grads, loss, syncs, group = got[rank][s]
            odcfn.tree_assert_allclose(grads, want[rank], rtol=RTOL, atol=ATOL, what=f"step {s} rank {rank}")
            assert abs(loss - float(loss_ref)) <= 1e-5 * abs(float(loss_ref)) and syncs == 1
            mine = set(range(rank - rank % K, rank - rank % K + K))
            assert set(group) <= mine - {rank}  # never across the group
            assert group == local[rank][s][3]  # the same bytes per peer as the in-process ranks
        assert any(got[r][s][3] for r in range(W))  # some backward did read its group


def _unit_setup(tr, reserve=K):
    layout = odcfn.sharding.make_layout(MODEL, tr.mesh)
    if reserve:
        tr.reserve_secondary(reserve)
    tr.begin_step(layout, odcfn.shard(FULL, MODEL, tr.mesh), torch.float32)
    unit = layout.names[1]
    full = torch.empty(layout[unit].padded_numel)
    tr.gather(unit, full)
    return unit, full


def test_a_group_peer_that_never_builds_its_slice_ends_the_gather():
    timeout = 1.5

    def body(rank, tr):
        unit, full = _unit_setup(tr)
        if rank != 1:  # rank 1 never builds its slice
            tr.publish_secondary(unit, full, K)
        t0, out = time.monotonic(), torch.empty_like(full)
        if rank == 0:
            with pytest.raises(TransportError, match="rank 1 to build its group shard"):
                tr.gather_group(unit, out, K)
            return time.monotonic() - t0
        if rank in (2, 3):  # the other group is whole
            tr.gather_group(unit, out, K)
            assert torch.equal(out, full)
        return 0.0

    waited = odcfn.run_local(body, W, transport=_ipc(timeout), timeout=30)
    assert timeout <= waited[0] < timeout + 1.0


def test_disagreeing_k_missing_reservation_and_bad_buffers_are_named():
    def body(rank, tr):
        unit, full = _unit_setup(tr)
        i = tr._unit_index[unit]
        if rank == 1:  # as a peer that cut its slice for k = 1 would stamp it
            for peer in (0, 1):
                tr.fabric.signal_write(peer, tr.sig.secondary(i, tr.me), pack_stamp(tr.step, 1))
        else:
            tr.publish_secondary(unit, full, K)
            tr.publish_secondary(unit, full * 2, K)  # again in the step: a no-op
        if rank == 0:
            with pytest.raises(TransportError, match="rank 1 built its group shard for k=1"):
                tr.gather_group(unit, torch.empty_like(full), K)
        if rank in (2, 3):
            out = torch.empty_like(full)
            tr.gather_group(unit, out, K)
            assert torch.equal(out, full)  # the first build's
        with pytest.raises(TypeError, match="gathered copy"):
            tr.publish_secondary(unit, full.double(), K)
        with pytest.raises(TransportError, match=r"holds k=2 slices: call reserve_secondary\(1\)"):
            tr.gather_group(unit, full, 1)
        with pytest.raises(ValueError, match="reshard_after_forward=3"):
            tr.reserve_secondary(3)
        return True

    assert all(odcfn.run_local(body, W, transport=_ipc(10), timeout=30))

    def unreserved(rank, tr):
        unit, full = _unit_setup(tr, reserve=0)
        with pytest.raises(TransportError, match=r"no hpZ slices: call reserve_secondary\(2\)"):
            tr.publish_secondary(unit, full, K)
        return True

    assert all(odcfn.run_local(unreserved, 2, transport=_ipc(10), timeout=30))

    def disagree(rank, tr):  # ranks reserving different k lay out different arenas: refused
        with pytest.raises(TransportError) as info:
            _unit_setup(tr, reserve=1 if rank == 1 else K)
        return str(info.value)

    said = odcfn.run_local(disagree, W, transport=_ipc(10), timeout=30)
    # the first to give up names the sizes (a later reader may find the rendezvous already torn
    # down by a peer that gave up: another TransportError)
    assert any("laid out" in m and "arena bytes" in m for m in said), said
