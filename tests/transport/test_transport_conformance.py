"""One conformance suite for every transport: a new transport passes it or it is not done.

Kinds (``KINDS``): the in-process ``LocalWorld`` (threads); ``ShmTransport`` (processes of the
session pool), with gloo collectives and with ``collectives="shm"`` (``shm_coll``); the
CUDA-IPC fabric on CPU (threads, and processes sharing /dev/shm arenas over
a caller-made gloo group); the NVSHMEM fabric on CPU (threads: ``NvshmemFabric``'s own host
code with its three device kernels replaced by CPU equivalents, every peer on another "node",
so gathers and pushes take the remote get / put-with-signal path). Properties: gradients equal
the single-process reference (full and hybrid meshes, ODC and collective), exactly one sync on
the wire per ODC step, the gather/scatter counters and bytes, version gating (a gather never
sees a stale or torn shard, accumulators are fresh and exact each step), a stuck or dead peer
ends in ``TransportError`` within a bound, and ``fetch_add`` semantics.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import odcfn
from odcfn.launch import LaunchError
from odcfn.model import Model, Unit
from odcfn.sharding import make_layout
from odcfn.transport.base import TransportError
from odcfn.transport.gpu import nvshmem as nvmod
from odcfn.transport.gpu._engine import ArenaTransport
from odcfn.transport.gpu.cuda_ipc import IpcFabric, cuda_ipc_transport
from odcfn.transport.local import LocalCollectives
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import make_state, tiny

THREADS, PROCESSES = ("local", "ipc_threads", "nvshmem_threads"), ("shm", "shm_coll", "ipc_procs")
KINDS = THREADS + PROCESSES


# --- the NVSHMEM fabric on CPU ------------------------------------------------------------------


class CpuNvshmemFabric(nvmod.NvshmemFabric):
    """``NvshmemFabric`` whose symmetric heap is the IPC fabric's /dev/shm arenas and whose
    kernels (get, put-with-signal, signal) are CPU copies through those mappings. Its routing
    (same-node peers by pointer, others by kernel), staging and signal order are the real code."""

    def __init__(self, mesh: odcfn.Mesh, store, timeout: float) -> None:
        self.mesh, self.group, self.device = mesh, mesh.shard_group, torch.device("cpu")
        # the memory provider sees one node: it only maps files, routing is decided above
        self.mem = IpcFabric(odcfn.Mesh(mesh.world_size, mesh.rank, None, mesh.sharding)
                             if mesh.sharding == "full" else mesh, store, "cpu", timeout=timeout)
        self.side_stream, self._pes, self.peer_views = None, {}, {}
        self._staging = torch.empty(0, dtype=torch.uint8)
        self.ops = SimpleNamespace(accumulate=lambda acc, x: acc.add_(x), cast_copy=lambda d, s: d.copy_(s))
        self.k = SimpleNamespace(nvshmem_gather_kernel=self._get, nvshmem_put_signal_kernel=self._put,
                                 nvshmem_signal_kernel=self._signal)

    def setup(self, nbytes: int, words: int, key: str) -> None:
        self.mem.setup(nbytes, words, key)
        self.arena, self.sig = self.mem.arena, self.mem.sig
        self.peer_views = {r: self.mem.peers[r] for r in self.group if self._same_node(r)}

    def fence(self) -> None:
        return None  # CPU stores: x86-64 keeps them in order (as the IPC fabric on CPU)

    def signal_read(self, idx: int) -> int:
        # a plain load of the mapped word: the CUDA side-stream poll is the device's own
        # mechanism (tests/transport/test_gpu_nvshmem_poll.py covers it)
        return int(self.sig[idx])

    def close(self) -> None:
        self.mem.close()

    # the device kernels: addresses are symmetric, so an offset into our arena names the peer's
    def _get(self, grid, out, src_addr, pes, pos, nbytes, CHUNK_BYTES):
        off = src_addr - self.arena.data_ptr()
        for pe, i in zip(pes.tolist(), pos.tolist()):
            out[i * nbytes : (i + 1) * nbytes].copy_(self.mem.peers[pe][off : off + nbytes])

    def _signal(self, grid, sig_addr, value, pe):
        self.mem.peer_sigs[pe][(sig_addr - self.sig.data_ptr()) // 8] = value

    def _put(self, grid, src, src_off, nbytes, dst_addr, sig_addr, vals, pes, _):
        pe, off = int(pes[0]), dst_addr - self.arena.data_ptr()
        self.mem.peers[pe][off : off + nbytes].copy_(src[src_off : src_off + nbytes])
        self._signal(grid, sig_addr, int(vals[0]), pe)  # after the bytes, as the kernel's signal


# --- running one function on W ranks of a kind ------------------------------------------------


def _thread_factory(kind: str):
    if kind == "local":
        return None
    if kind == "ipc_threads":
        return lambda w, r: cuda_ipc_transport(w.mesh.with_rank(r), w.store, LocalCollectives(w, r),
                                               device="cpu", mode="landing", slot_elems=64, slots=2,
                                               timeout=w.timeout)

    def nvshmem(w, r):
        mesh = w.mesh.with_rank(r)
        fabric = CpuNvshmemFabric(mesh, w.store, w.timeout)
        return ArenaTransport(mesh, fabric, w.store, LocalCollectives(w, r), mode="landing", slots=8,
                              slot_elems=64, timeout=w.timeout)

    return nvshmem


def _process_transport(kind: str, timeout: float, ranks_per_node, sharding):
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    mesh = odcfn.Mesh(world, rank, ranks_per_node, sharding)
    if kind == "shm":
        return ShmTransport(mesh, timeout=timeout)
    if kind == "shm_coll":  # the same transport with its collectives over /dev/shm too
        return ShmTransport(mesh, timeout=timeout, collectives="shm")
    # the caller's own group and store (as verl / Ray Train would have): the transport reuses them
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    return cuda_ipc_transport(mesh, store, device="cpu", mode="landing", slot_elems=64, slots=2,
                              timeout=timeout)


def _proc_main(kind, fn, args, timeout, ranks_per_node, sharding):
    torch.set_num_threads(1)
    tr = _process_transport(kind, timeout, ranks_per_node, sharding)
    try:
        return fn(tr.mesh.rank, tr, *args)
    except BaseException:
        getattr(tr, "abort", lambda: None)()  # peers stop waiting for us now
        raise
    finally:
        tr.close()


def run(kind, pool, fn, world, *args, timeout=30.0, ranks_per_node=None, sharding="full"):
    """``fn(rank, transport, *args)`` on ``world`` ranks of ``kind``; results by rank."""
    if kind == "nvshmem_threads" and sharding == "full" and ranks_per_node is None:
        ranks_per_node = 1  # every peer on another node: the remote get/put path
    if kind == "nvshmem_threads":  # the fabric's kernels are CPU methods: launch = call
        with mock.patch.object(nvmod, "_launch", lambda kernel, grid, *a, **k: kernel(grid, *a, **k)):
            return odcfn.run_local(lambda r, tr: fn(r, tr, *args), world, transport=_thread_factory(kind),
                                   ranks_per_node=ranks_per_node, sharding=sharding, timeout=timeout)
    if kind in THREADS:
        return odcfn.run_local(lambda r, tr: fn(r, tr, *args), world, transport=_thread_factory(kind),
                               ranks_per_node=ranks_per_node, sharding=sharding, timeout=timeout)
    return pool.run(_proc_main, world, args=(kind, fn, args, timeout, ranks_per_node, sharding),
                    timeout=4 * timeout + 30)


# --- gradients equal the reference; one sync on the wire --------------------------------------

CFG, MODEL, FULL = tiny()
LENGTHS, CAP = [5, 9, 3, 7, 4, 6], 12


def _grad_step(tr, comm):
    batch = odcfn.random_batch(LENGTHS, CFG.vocab_size, seed=0)
    return odcfn.grad_step(make_state(FULL, MODEL, tr, comm=comm, max_tokens_per_microbatch=CAP), batch)


def grads_fn(rank, tr, comms):
    out = []
    for comm in comms:
        wire = tr.collectives.calls.copy()
        g, m = _grad_step(tr, comm)
        out.append(({k: v.clone() for k, v in g.items()}, m.loss, m.counters.as_dict(),
                    dict(tr.collectives.calls - wire)))
    return out


@pytest.mark.parametrize("world,ranks_per_node,sharding", [(3, None, "full"), (4, 2, "hybrid")])
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_equal_the_reference_with_one_sync_per_step(kind, mp_pool, world, ranks_per_node, sharding):  # noqa: F811
    comms = ("odc", "odc", "collective")
    out = run(kind, mp_pool, grads_fn, world, comms, ranks_per_node=ranks_per_node, sharding=sharding)
    batch = odcfn.random_batch(LENGTHS, CFG.vocab_size, seed=0)
    loss, g = odcfn.reference_value_and_grad(MODEL, FULL, batch)
    mesh = odcfn.Mesh(world, 0, ranks_per_node, sharding)
    replica = int(len(mesh.replica_group) > 1)
    for r in range(world):
        ref = odcfn.shard(g, MODEL, mesh.with_rank(r))
        for step, (comm, (grads, got_loss, counters, wire)) in enumerate(zip(comms, out[r])):
            odcfn.tree_assert_allclose(grads, ref, rtol=1e-5, atol=1e-7)
            assert got_loss == pytest.approx(float(loss), rel=1e-5)
            assert counters["syncs"] == 1
            if comm == "odc":  # point-to-point only, but for hybrid's one replica all-reduce
                assert counters["collectives"] == replica and counters["gathers"] > 0, counters
                if step > 0:  # (step 0 may also set up: shm maps its segments between barriers)
                    assert wire == {"all_reduce": 1 + replica}, wire
            else:
                assert counters["collectives"] > 0 and counters["gathers"] == 0


# --- the protocol directly: counters, version gating, timeouts, fetch_add ---------------------

UNITS = 3


def _flat_layout(mesh, shard):
    shape = {"w": torch.Size([shard * mesh.shard_count])}
    model = Model(tuple(Unit(f"u{i}", lambda p, x, mb: x, shape) for i in range(UNITS)))
    return make_layout(model, mesh)


def counters_fn(rank, tr, shard):
    layout, out = _flat_layout(tr.mesh, shard), []
    for dtype in (torch.float32, torch.bfloat16):  # the second step also re-lays out every buffer
        before = tr.counters.copy()
        tr.begin_step(layout, {u.name: torch.zeros(u.shard_size) for u in layout.units}, dtype)
        buf = torch.empty(layout.units[0].padded_numel, dtype=dtype)
        for u in layout.units:
            tr.gather(u.name, buf)
            tr.gather(u.name, buf)
            tr.scatter_accumulate(u.name, buf)
        tr.flush()
        tr.sync(torch.zeros(2, dtype=torch.float64))
        out.append((tr.counters - before).as_dict())
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_counters_count_ops_and_the_bytes_that_left_the_rank(kind, mp_pool):  # noqa: F811
    world, shard = 3, 256
    for per_step in run(kind, mp_pool, counters_fn, world, shard):
        for c, esize in zip(per_step, (4, 2)):
            peer_bytes = UNITS * (world - 1) * shard * esize
            assert c == {"syncs": 1, "collectives": 0, "gathers": 2 * UNITS, "scatters": UNITS,
                         "gather_bytes": 2 * peer_bytes, "scatter_bytes": peer_bytes, "collective_bytes": 0}


def _pattern(n):
    return torch.arange(n, dtype=torch.float32) % 13 + 1  # small integers: every sum is exact


def versions_fn(rank, tr, steps, shard, late):
    """Each step every rank publishes 1000*step + rank and pushes (rank+1)*step*pattern into
    every owner. At each step the ``late`` rank publishes 0.3 s after the others: their
    gathers must wait for it, not read what it published the step before."""
    layout, w = _flat_layout(tr.mesh, shard), tr.mesh.world_size
    seen, accs, claims = [], [], []
    for step in range(1, steps + 1):
        if rank == late:
            time.sleep(0.3)
        mine = {u.name: torch.full((u.shard_size,), 1000.0 * step + rank) for u in layout.units}
        tr.begin_step(layout, mine, torch.float32)
        out = torch.empty(layout.units[0].padded_numel)
        for u in layout.units:
            tr.gather(u.name, out)
            seen.append(out.view(w, -1).clone())
        grad = _pattern(shard * w) * (rank + 1) * step
        for u in layout.units:
            tr.scatter_accumulate(u.name, grad)
        claims.append(tr.fetch_add(0))
        tr.flush()
        accs.append({k: v.clone() for k, v in tr.grad_shards().items()})
        tr.sync(torch.ones(1, dtype=torch.float64))  # the only meeting point between steps
    return seen, accs, claims


@pytest.mark.parametrize("kind", KINDS)
def test_gathers_see_exactly_this_steps_shards_and_accumulators_are_fresh(kind, mp_pool):  # noqa: F811
    world, steps, shard = 3, 3, 4096
    out = run(kind, mp_pool, versions_fn, world, steps, shard, world - 1)
    want_acc = _pattern(shard * world).view(world, shard) * sum(r + 1 for r in range(world))
    for r, (seen, accs, _) in enumerate(out):
        for i, s in enumerate(seen):  # every element: no stale and no half-written shard
            want = (1000.0 * (i // UNITS + 1) + torch.arange(world, dtype=torch.float32))[:, None]
            assert torch.equal(s, want.expand_as(s)), (r, i)
        for step, acc in enumerate(accs, 1):  # exactly this step's pushes, none lost
            assert set(acc) == {f"u{i}" for i in range(UNITS)}
            for a in acc.values():
                assert torch.equal(a, want_acc[r] * step), (r, step)
    for step in range(steps):  # one fetch_add(0) per rank per step: each step hands out 0..W-1
        assert sorted(o[2][step] for o in out) == list(range(world))


def stuck_fn(rank, tr, stall):
    """Rank 1 stops taking part after step 1; rank 0 reports how its step-2 gather ended."""
    layout = _flat_layout(tr.mesh, 64)
    shards = {u.name: torch.zeros(u.shard_size) for u in layout.units}
    tr.begin_step(layout, shards, torch.float32)
    tr.flush()
    tr.sync(torch.zeros(1, dtype=torch.float64))
    if rank == 1:
        if stall is None:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(stall)
        return None
    tr.begin_step(layout, shards, torch.float32)
    t0 = time.monotonic()
    try:
        tr.gather("u0", torch.empty(layout.units[0].padded_numel))
        return "no error", time.monotonic() - t0
    except TransportError as e:
        return str(e), time.monotonic() - t0


@pytest.mark.parametrize("kind", KINDS)
def test_a_stuck_peer_ends_in_transport_error_within_the_timeout(kind, mp_pool):  # noqa: F811
    timeout = 1.0
    msg, waited = run(kind, mp_pool, stuck_fn, 2, 1.5 * timeout, timeout=timeout)[0]
    assert msg != "no error" and "rank 1" in msg, msg
    assert waited < timeout + 10  # bounded (measured ~timeout), never a hang


@pytest.mark.parametrize("kind", PROCESSES)
def test_a_dead_peer_ends_in_transport_error(kind, mp_pool):  # noqa: F811
    timeout = 1.0
    with pytest.raises(LaunchError) as info:
        run(kind, mp_pool, stuck_fn, 2, None, timeout=timeout)
    assert set(info.value.errors) == {1} and "worker died" in info.value.errors[1]
    msg, waited = info.value.results[0]
    assert msg != "no error" and "rank 1" in msg, msg
    assert waited < timeout + 10


def fetch_add_fn(rank, tr, steps):
    """Per step, between barriers: read counters fresh, add to several at once (unequal counts on
    counter 0, powers of ten on 1, negatives on 2, the last index), read the totals back."""
    layout = _flat_layout(tr.mesh, 64)
    shards = {u.name: torch.zeros(u.shard_size) for u in layout.units}
    last, out = tr.max_counters - 1, {"steps": []}
    for step in range(1, steps + 1):
        tr.begin_step(layout, shards, torch.float32)
        fresh = [tr.fetch_add(c, 0) for c in (0, 1, 2, last)]
        tr.collectives.barrier()  # nobody adds before everyone has read the fresh values
        took = [tr.fetch_add(0) for _ in range(2 + rank + step)]  # concurrent claims
        before = (tr.fetch_add(1, 10**rank), tr.fetch_add(2, -(rank + 1)), tr.fetch_add(last, 5))
        tr.collectives.barrier()  # every add of this step has landed
        totals = [tr.fetch_add(c, 0) for c in (0, 0, 1, 2, last, 3)]  # n=0 twice: no change
        out["steps"].append((fresh, took, before, totals))
        tr.flush()
        tr.sync(torch.zeros(1, dtype=torch.float64))
    for bad in (-1, tr.max_counters):
        with pytest.raises(ValueError, match=f"counter {bad} is out of range.*max_counters"):
            tr.fetch_add(bad)
    out["max_counters"] = tr.max_counters
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_fetch_add_is_atomic_fresh_each_step_and_bounded(kind, mp_pool):  # noqa: F811
    world, steps = 3, 2
    out = run(kind, mp_pool, fetch_add_fn, world, steps)
    assert {o["max_counters"] for o in out} == {1 << 16}
    for step in range(steps):
        per_rank = [o["steps"][step] for o in out]
        for fresh, _, _, _ in per_rank:
            assert fresh == [0, 0, 0, 0]  # step 2 starts at 0 again although step 1 left values
        took = sorted(i for p in per_rank for i in p[1])
        total = sum(2 + r + step + 1 for r in range(world))
        assert took == list(range(total))  # every number handed out exactly once
        # counter 1 got 1, 10, 100 in some order: each rank saw the sum of those before it
        firsts = sorted(p[2][0] for p in per_rank)
        assert firsts[0] == 0 and set(firsts[1:]) <= {1, 10, 100, 11, 101, 110}
        assert sorted(p[2][2] for p in per_rank) == [0, 5, 10]
        for p in per_rank:
            assert p[3] == [total, total, 111, -6, 15, 0]

