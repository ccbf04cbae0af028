"""GPU transports without a GPU, beyond the conformance suite (which runs the CUDA-IPC and
NVSHMEM fabrics on CPU through every transport property): the arena transports' own mechanics
(host grads, request-id wraps inside real steps, dtype re-layout, landing drained while the owner
computes, store key cleanup, the Triton kernels under the interpreter), NVSHMEM's host-side
routing, and the clear errors where CUDA / NVSHMEM is missing."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch
from torch.distributed import HashStore

import odcfn
from odcfn.transport.gpu._protocol import (
    HEADER_BYTES,
)
from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport
from odcfn.transport.local import LocalCollectives, LocalWorld
from tests.util import make_state, tiny

# --- the protocol on CPU: CUDA-IPC fabric, threads --------------------------------------------

CFG, MODEL, FULL = tiny()
BATCH = odcfn.random_batch([5, 9, 3, 7, 4, 6], CFG.vocab_size, seed=0)
LOSS_REF, G_REF = odcfn.reference_value_and_grad(MODEL, FULL, BATCH)


def _run_threads(world_size, comm, steps=2, ranks_per_node=None, sharding="full", **kw):
    def make(world, rank):
        return cuda_ipc_transport(world.mesh.with_rank(rank), world.store, LocalCollectives(world, rank),
                                  device="cpu", timeout=30, **kw)

    def body(rank, tr):
        state = make_state(FULL, MODEL, tr, comm=comm, max_tokens_per_microbatch=12)
        per_step = []
        for _ in range(steps):
            g, m = odcfn.grad_step(state, BATCH)
            per_step.append(({k: v.clone() for k, v in g.items()}, m))
        return per_step

    return odcfn.run_local(body, world_size, transport=make, ranks_per_node=ranks_per_node,
                           sharding=sharding, timeout=30)


def _in_threads(body, world_size):
    """Run ``body(rank)`` on ``world_size`` threads; re-raise the first error (an assertion in a
    thread would otherwise only be printed)."""
    errors: list = []

    def run(rank):
        try:
            body(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _assert_grads(out, world_size, ranks_per_node=None, sharding="full"):
    mesh = odcfn.Mesh(world_size, 0, ranks_per_node, sharding)
    for r in range(world_size):
        ref = odcfn.shard(G_REF, MODEL, mesh.with_rank(r))
        for g, m in out[r]:  # every step: accumulators were zeroed, versions moved on
            odcfn.tree_assert_allclose(g, ref, rtol=1e-5, atol=1e-7)
            assert m.loss == pytest.approx(float(LOSS_REF), rel=1e-6)


def test_host_grads_are_cpu_copies_taken_at_flush():
    out = _run_threads(2, "odc", steps=2, mode="landing", host_grads=True)
    _assert_grads(out, 2)


def test_gpu_check_script_skips_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run for real")
    p = subprocess.run(["bash", "bench/gpu_check.sh"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "skipped" in p.stdout


def test_request_ids_wrap_many_times_inside_real_steps():
    """4-bit request ids, 2 slots, 32-element slots: each step pushes more than 16 chunks per
    (client, owner) pair, so the ids wrap within every step; gradients stay exact."""
    out = _run_threads(2, "odc", steps=2, mode="landing", slot_elems=32, slots=2, id_bits=4)
    _assert_grads(out, 2)


def test_gathers_deliver_the_compute_dtype_and_a_dtype_change_re_lays_the_arena():
    """Step 1 publishes fp32, step 2 bf16 (same byte count per element differs: new arena,
    new rendezvous); every gather equals the owners' shards cast to that step's dtype."""
    world, store = LocalWorld(2), HashStore()
    from odcfn.sharding import make_layout

    got: list = [None, None]

    def body(rank):
        mesh = odcfn.Mesh(2, rank)
        tr = cuda_ipc_transport(mesh, store, LocalCollectives(world, rank), device="cpu", mode="landing")
        layout = make_layout(MODEL, mesh)
        res = []
        for dtype in (torch.float32, torch.bfloat16):
            tr.begin_step(layout, odcfn.shard(FULL, MODEL, mesh), dtype)
            u = layout.units[1]
            out = torch.empty(u.padded_numel, dtype=dtype)
            tr.gather(u.name, out)
            res.append((out.clone(), tr.generation))
            tr.flush()
            tr.sync(torch.zeros(2, dtype=torch.float64))
        got[rank] = res
        tr.close()

    _in_threads(body, 2)
    layout = make_layout(MODEL, odcfn.Mesh(2, 0))
    u = layout.units[1]
    full_flat = u.flatten(FULL[u.name])
    for rank in range(2):
        (o32, g1), (o16, g2) = got[rank]
        assert torch.equal(o32, full_flat)
        assert torch.equal(o16, full_flat.to(torch.bfloat16))
        assert (g1, g2) == (1, 2)


def test_landing_pushes_complete_while_the_owner_computes_something_else():
    """Rank 0 pushes many more chunks than there are slots into rank 1 while rank 1's own thread
    is busy elsewhere (sleeping, no transport call): only rank 1's drain thread serves them, so
    the pushes finish before rank 1 looks, and the accumulator holds exactly the pushed slice."""
    world, store = LocalWorld(2), HashStore()
    from odcfn.sharding import make_layout

    layout = make_layout(MODEL, odcfn.Mesh(2, 0))
    u = layout.units[1]  # 992-element shards: 62 chunks of 16 through 2 slots
    grad = torch.arange(u.padded_numel, dtype=torch.float32)
    times: dict = {}
    acc_after: list = []
    ready = threading.Barrier(2)

    def body(rank):
        mesh = odcfn.Mesh(2, rank)
        tr = cuda_ipc_transport(
            mesh, store, LocalCollectives(world, rank), device="cpu", mode="landing", slot_elems=16, slots=2
        )
        tr.begin_step(layout, odcfn.shard(FULL, MODEL, mesh), torch.float32)
        ready.wait()
        if rank == 0:
            tr.scatter_accumulate(u.name, grad)
            times["pushed"] = time.monotonic()
        else:
            time.sleep(1.0)  # "compute": the main thread never enters the transport
            times["owner_back"] = time.monotonic()
        tr.flush()
        if rank == 1:
            acc_after.append(tr.grad_shards()[u.name].clone())
        tr.sync(torch.zeros(2, dtype=torch.float64))
        tr.close()

    _in_threads(body, 2)
    assert times["pushed"] < times["owner_back"]
    assert torch.equal(acc_after[0], grad[u.shard_size : 2 * u.shard_size])


def test_fetch_add_store_keys_of_a_step_go_at_the_next_step():
    """fetch_add's semantics are the conformance suite's; specific to the arena transports: the
    store does not keep a key per counter per step forever."""
    world, store = LocalWorld(2), HashStore()
    from odcfn.sharding import make_layout

    kept: list = [None, None]
    phase = threading.Barrier(2, timeout=30)

    def body(rank):
        mesh = odcfn.Mesh(2, rank)
        tr = cuda_ipc_transport(mesh, store, LocalCollectives(world, rank), device="cpu", mode="landing")
        layout = make_layout(MODEL, mesh)
        tr.begin_step(layout, odcfn.shard(FULL, MODEL, mesh), torch.float32)
        for c in (0, 1, 2):
            tr.fetch_add(c, rank + 1)
        tr.flush()
        tr.sync(torch.zeros(2, dtype=torch.float64))
        keys = [tr._counter_key(tr.step, c) for c in (0, 1, 2)]
        phase.wait()
        before = store.check(keys)
        phase.wait()  # both have looked before either deletes
        tr.begin_step(layout, odcfn.shard(FULL, MODEL, mesh), torch.float32)
        phase.wait()
        kept[rank] = (before, [store.check([k]) for k in keys])
        tr.close()

    _in_threads(body, 2)
    assert kept == [(True, [False, False, False])] * 2


# --- errors where the hardware is missing -----------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_transports_fail_clearly_without_cuda():
    from odcfn.transport.gpu.nvshmem import nvshmem_transport

    mesh = odcfn.Mesh(2, 0)
    with pytest.raises(RuntimeError, match="CUDA-IPC transport needs a CUDA GPU"):
        cuda_ipc_transport(mesh, HashStore(), None)
    import nvshmem.core  # noqa: F401  (the gpu extra: what the transport imports first)

    with pytest.raises(RuntimeError, match="NVSHMEM transport needs a CUDA GPU"):
        nvshmem_transport(mesh, HashStore(), None)


def test_nvshmem_bitcode_choice_and_location():
    from odcfn.transport.gpu.nvshmem import _bitcode_arch

    assert [_bitcode_arch(c) for c in [(7, 0), (8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]] == [
        70,
        80,
        80,
        89,
        90,
        100,
        100,
    ]
    from odcfn.transport.gpu._nvshmem_device import device_bitcode

    path = device_bitcode(90)
    assert path.endswith("libnvshmem_device_sm_90.bc") and os.path.getsize(path) > 1 << 20


def _fake_nvshmem_fabric(monkeypatch, mesh, views):
    """An ``NvshmemFabric`` on CPU tensors with the kernel launcher recorded, not run: checks
    the host-side routing (same-node peers by pointer, the rest through NVSHMEM kernels)."""
    from types import SimpleNamespace

    from odcfn.transport.gpu import nvshmem as nvmod

    launches: list = []
    monkeypatch.setattr(nvmod, "_launch", lambda kernel, grid, *a, **k: launches.append((kernel, grid, a, k)))
    fab = object.__new__(nvmod.NvshmemFabric)
    fab.mesh, fab.group, fab.device = mesh, mesh.shard_group, torch.device("cpu")
    fab.k = SimpleNamespace(
        nvshmem_gather_kernel="GET", nvshmem_put_signal_kernel="PUT", nvshmem_signal_kernel="SIG"
    )
    fab.arena = torch.zeros(4096, dtype=torch.uint8)
    fab.sig = torch.zeros(16, dtype=torch.int64)
    fab.peer_views, fab._pes = dict(views), {}
    fab._staging = torch.empty(0, dtype=torch.uint8)
    fab.fence = lambda: None
    return fab, launches


def test_nvshmem_gather_routes_same_node_peers_by_pointer_and_others_by_get(monkeypatch):
    mesh = odcfn.Mesh(4, 1, 2, "full")  # ranks 0,1 on node 0 (this one), 2,3 on node 1
    arenas = {r: torch.full((4096,), 10 * r + 1, dtype=torch.uint8) for r in range(2)}
    fab, launches = _fake_nvshmem_fabric(monkeypatch, mesh, arenas)
    out = torch.zeros(4 * 100, dtype=torch.uint8)
    fab.get((0, 1, 2, 3), 256, out)
    assert out[:100].eq(1).all() and out[100:200].eq(11).all()  # copied through the mappings
    assert out[200:].eq(0).all()  # left to the kernel
    ((kernel, grid, args, consts),) = launches
    assert kernel == "GET" and grid == (2, 1)
    assert args[0].data_ptr() == out.data_ptr() and args[1] == fab.arena.data_ptr() + 256  # symmetric
    assert args[2].tolist() == [2, 3] and args[3].tolist() == [2, 3] and args[4] == 100
    assert consts == {"CHUNK_BYTES": fab.CHUNK_BYTES}


def test_nvshmem_put_signal_stages_header_and_data_in_one_put(monkeypatch):
    mesh = odcfn.Mesh(4, 1, 2, "full")
    fab, launches = _fake_nvshmem_fabric(monkeypatch, mesh, {})
    header = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    data = torch.arange(10, dtype=torch.float32)
    fab.put_signal(3, [(512, header), (512 + HEADER_BYTES, data)], idx=7, value=99)
    ((kernel, grid, args, _),) = launches
    assert kernel == "PUT" and grid == (1,)
    src, _, nbytes, dst_addr, sig_addr, vals, pes, _ = args
    assert nbytes == HEADER_BYTES + 40 and dst_addr == fab.arena.data_ptr() + 512
    assert sig_addr == fab.sig.data_ptr() + 8 * 7 and vals.tolist() == [99] and pes.tolist() == [3]
    assert src[:32].view(torch.int64).tolist() == [1, 2, 3, 4]
    assert torch.equal(src[HEADER_BYTES : HEADER_BYTES + 40].view(torch.float32), data)


def test_nvshmem_unique_id_survives_the_byte_broadcast():
    import nvshmem.core as nv

    from odcfn.transport.gpu.nvshmem import uid_from_bytes, uid_to_bytes

    uid = nv.get_unique_id()  # works without a GPU: it only names the bootstrap endpoint
    data = uid_to_bytes(uid)
    assert len(data) == 128 and any(data)
    assert uid_from_bytes(data) == uid
    assert uid_from_bytes(bytes(128)) != uid
    with pytest.raises(ValueError, match="must be 128 bytes"):
        uid_from_bytes(data[:-1])


def test_remote_add_without_triton_atomics_and_cross_node_ipc_are_refused(monkeypatch):
    from odcfn.transport.gpu import cuda_ipc

    monkeypatch.setattr(cuda_ipc, "_triton_ops", lambda device: None)  # CPU, no interpreter
    with pytest.raises(RuntimeError, match="remote_add.*needs triton atomics"):
        cuda_ipc_transport(odcfn.Mesh(2, 0), HashStore(), None, device="cpu", mode="remote_add")
    with pytest.raises(ValueError, match="spans 2 nodes"):
        cuda_ipc_transport(odcfn.Mesh(4, 0, 2, "full"), HashStore(), None, device="cpu", mode="landing")


# --- real processes and the triton kernels (interpreter) --------------------------------------


def _interpreted_triton_ops():
    """``odcfn.kernels.triton_ops`` with its kernels decorated under the interpreter (see
    test_triton_ops: the choice is made at decoration time; the variable is restored)."""
    import importlib

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import odcfn.kernels.triton_ops as T

        return T if T.interpreting() else importlib.reload(T)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


@pytest.mark.parametrize("mode", ["remote_add", "landing"])
def test_ipc_transport_through_the_triton_kernels_under_the_interpreter(mode):
    """Every data move (publish cast, one-launch gather, atomic scatter or landing
    accumulate) goes through the Triton kernels, run by the interpreter on CPU tensors."""
    T = _interpreted_triton_ops()
    calls = {"gather": 0, "scatter_add": 0, "accumulate": 0}
    wrapped = {k: getattr(T, k) for k in calls}

    def counting(name):
        def f(*a, **k):
            calls[name] += 1
            return wrapped[name](*a, **k)

        return f

    try:
        for k in calls:
            setattr(T, k, counting(k))
        out = _run_threads(2, "odc", steps=1, mode=mode, slot_elems=256)
    finally:
        for k, f in wrapped.items():
            setattr(T, k, f)
    _assert_grads(out, 2)
    assert calls["gather"] > 0
    assert (calls["scatter_add"] > 0) == (mode == "remote_add")
    assert calls["accumulate"] > 0 or mode == "remote_add"
