"""``ShmCollectives``: the collectives over /dev/shm that the same-wire collective baseline uses
(``ShmTransport(mesh, collectives="shm")``). Each op against what it must equal, computed here
from every rank's inputs: exact for integer-valued data, and for random floats the sum in group
order bit for bit (so every rank of an all-reduce gets the same bits); staging that grows
mid-run; shard and replica groups of a hybrid mesh; bad groups refused; a dead or stuck peer
inside a collective ends in ``TransportError``. (Gradients through it: the conformance suite's
``shm_coll`` kind and tests/step/test_fsdp2_parity.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import odcfn
from odcfn.transport.base import TransportError
from odcfn.transport.shm_collective import ShmCollectives
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture


def _inputs(rank: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def ops_fn(ranks_per_node, sharding, sizes):
    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    mesh = odcfn.Mesh(world, rank, ranks_per_node, sharding)
    c = ShmCollectives(mesh, timeout=30)
    out = []
    try:
        for step, n in enumerate(sizes):  # growing sizes: the staging is replaced on the way
            for dtype in (torch.float32, torch.bfloat16, torch.float64):
                for group in (mesh.shard_group, mesh.replica_group, tuple(range(world))):
                    k = len(group)
                    mine = _inputs(rank, n, dtype, step)
                    gathered = torch.empty(n * k, dtype=dtype)
                    c.all_gather(group, mine, gathered)
                    grad = _inputs(rank, n * k, dtype, step + 100)
                    piece = torch.empty(n, dtype=dtype)
                    c.reduce_scatter(group, grad, piece)
                    total = c.all_reduce(group, mine.view(-1, 1))
                    assert total.shape == (n, 1)
                    out.append((n, str(dtype), group, gathered, piece, total.view(-1)))
            c.barrier()
        return out, dict(c.calls)
    finally:
        c.close()


@pytest.mark.parametrize("world,ranks_per_node,sharding", [(3, None, "full"), (4, 2, "hybrid")])
def test_ops_equal_their_definition_in_group_order(mp_pool, world, ranks_per_node, sharding):  # noqa: F811
    sizes = (5, 1000, 40_000)  # 40_000 fp64 x 4 ranks outgrows the first staging buffers
    res = mp_pool.run(ops_fn, world, args=(ranks_per_node, sharding, sizes), timeout=120)
    per_rank = [r[0] for r in res]
    for rank, (rows, calls) in enumerate(res):
        assert calls == {"all_gather": 27, "reduce_scatter": 27, "all_reduce": 27, "barrier": 3}
        for i, (n, dt, group, gathered, piece, total) in enumerate(rows):
            dtype = getattr(torch, dt.split(".")[1])
            step = sizes.index(n)
            mine = [_inputs(p, n, dtype, step) for p in group]
            assert torch.equal(gathered, torch.cat(mine)), (rank, n, dt, group)
            grads = [_inputs(p, n * len(group), dtype, step + 100) for p in group]
            j = group.index(rank)
            want = grads[0][j * n : (j + 1) * n].clone()
            for g in grads[1:]:  # the sum in group order, as the op defines it
                want += g[j * n : (j + 1) * n]
            assert torch.equal(piece, want), (rank, n, dt, group)
            want = mine[0].clone()
            for m in mine[1:]:
                want += m
            assert torch.equal(total, want), (rank, n, dt, group)
            for p in group:  # every member got the same bits
                assert torch.equal(per_rank[p][i][5], total)
            if dtype == torch.float64:  # and it is the sum (float64: to rounding)
                torch.testing.assert_close(total, torch.stack(mine).sum(0), rtol=1e-12, atol=1e-12)


def bad_group_fn():
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    c = ShmCollectives(mesh, timeout=30)
    try:
        errors = []
        for call in (lambda: c.all_reduce((0, 5), torch.zeros(1)),
                     lambda: c.all_gather((0, 1), torch.zeros(2), torch.zeros(3)),
                     lambda: c.reduce_scatter((0, 1), torch.zeros(3), torch.zeros(2))):
            try:
                call()
                errors.append("no error")
            except ValueError as e:
                errors.append(str(e))
        c.barrier()  # nothing was half-issued: the group still meets
        return errors
    finally:
        c.close()


def test_bad_groups_and_sizes_are_refused_before_any_wait(mp_pool):  # noqa: F811
    for errors in mp_pool.run(bad_group_fn, 2, timeout=60):
        assert "(0, 5) is not a group" in errors[0]
        assert "all_gather: out must hold 2 x 2" in errors[1]
        assert "reduce_scatter: grad must hold 2 x 2" in errors[2]


def peer_fault_fn(stall):
    """Rank 1 leaves after one all-reduce (killed, or stalled); rank 0's next one must end."""
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    c = ShmCollectives(mesh, timeout=1.0)
    try:
        c.all_reduce((0, 1), torch.ones(4))
        if mesh.rank == 1:
            if stall is None:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(stall)
            return None
        t0 = time.monotonic()
        try:
            c.all_reduce((0, 1), torch.ones(4))
            return "no error", time.monotonic() - t0
        except TransportError as e:
            return str(e), time.monotonic() - t0
    finally:
        c.close()


@pytest.mark.parametrize("stall", [None, 2.0], ids=["dead", "stuck"])
def test_a_dead_or_stuck_peer_ends_a_collective_in_transport_error(mp_pool, stall):  # noqa: F811
    from odcfn.launch import LaunchError

    try:
        msg, waited = mp_pool.run(peer_fault_fn, 2, args=(stall,), timeout=60)[0]
    except LaunchError as e:  # the killed rank is reported; rank 0's own result still comes back
        assert stall is None and "worker died" in e.errors[1]
        msg, waited = e.results[0]
    assert msg != "no error" and "rank 1" in msg, msg
    assert waited < 10  # bounded by the 1 s timeout (plus polling), never a hang
