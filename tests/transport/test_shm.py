"""ShmTransport's own mechanics across real processes (exact accumulation under heavy lock
contention, segments unlinked after setup, the lazy counter reset), its primitives in one
process, CollectiveTransport on its own, and launch. The protocol's semantics on every
transport: tests/transport/test_transport_conformance.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import odcfn
from odcfn.launch import LaunchError, launch
from odcfn.model import Model, Unit
from odcfn.sharding import make_layout
from odcfn.transport.base import TransportError, supports_odc
from odcfn.transport.collective import CollectiveTransport, TorchCollectives
from odcfn.transport.shm import ShmTransport
from odcfn.transport.shm_sync import RangeLock, Segment, pid_alive, shm_dir, wait_until
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

UNITS, SHARD, ROUNDS, CHUNK = 8, 960, 8, 48


def _flat_model(world: int) -> Model:
    shape = {"w": torch.Size([SHARD * world])}
    return Model(tuple(Unit(f"u{i}", lambda p, x, mb: x, shape) for i in range(UNITS)))


def _pattern(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) % 7 + 1  # small integers: fp32 sums are exact


# --- workers ----------------------------------------------------------------------------------


def stress_worker():
    """Every rank pushes every unit ROUNDS times into every owner, in CHUNK-element locked
    pieces, all at once: 4 ranks x 8 units x 8 rounds x 4 owners x 20 chunks = 20480 locked adds."""
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    w, r = mesh.world_size, mesh.rank
    layout = make_layout(_flat_model(w), mesh)
    shards = {u.name: torch.zeros(u.shard_size) for u in layout.units}
    grad = _pattern(SHARD * w) * (r + 1)
    with ShmTransport(mesh, timeout=30, chunk_elems=CHUNK) as tr:
        tr.begin_step(layout, shards, torch.float32)
        tr.collectives.barrier()  # start pushing together: maximal contention
        t0 = time.perf_counter()
        for _ in range(ROUNDS):
            for u in layout.units:
                tr.scatter_accumulate(u.name, grad)
        tr.flush()
        took = time.perf_counter() - t0
        acc = {k: v.clone() for k, v in tr.grad_shards().items()}
        claims = [tr.fetch_add(0) for _ in range(5 + r)]  # unequal numbers of adds per rank
        tr.sync(torch.zeros(1, dtype=torch.float64))
    return acc, took, claims


def unlinked_worker():
    """After the first step every rank has mapped every segment and unlinked its own."""
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    layout = make_layout(_flat_model(mesh.world_size), mesh)
    prefix = os.environ["ODCFN_SHM_PREFIX"]
    with ShmTransport(mesh, timeout=30) as tr:
        tr.begin_step(layout, {u.name: torch.zeros(u.shard_size) for u in layout.units}, torch.float32)
        tr.flush()
        tr.sync(torch.ones(1, dtype=torch.float64))
        return [f for f in os.listdir(shm_dir()) if f.startswith(prefix)], len(tr._segs)


def behind_worker():
    """A rank already in the next step touched counter 5: a rank still in this step (calling
    fetch_add after the sync) must not silently reset it back."""
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    layout = make_layout(_flat_model(mesh.world_size), mesh)
    shards = {u.name: torch.zeros(u.shard_size) for u in layout.units}
    with ShmTransport(mesh, timeout=30) as tr:
        tr.begin_step(layout, shards, torch.float32)
        tr.sync(torch.zeros(1, dtype=torch.float64))
        if mesh.rank == 0:
            tr.begin_step(layout, shards, torch.float32)
            tr.fetch_add(5)
        tr.collectives.barrier()
        try:
            return tr.fetch_add(5) if mesh.rank == 1 else None
        except TransportError as e:
            return str(e)
        finally:
            tr.collectives.barrier()


def collective_refuses_worker():
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    layout = make_layout(_flat_model(mesh.world_size), mesh)
    out = {}
    with CollectiveTransport(mesh, timeout=10) as tr:
        tr.begin_step(layout, {u.name: torch.full((u.shard_size,), float(mesh.rank)) for u in layout.units},
                      torch.float32)
        buf = torch.empty(layout.units[0].padded_numel)
        tr.all_gather("u0", buf)
        out["gathered"] = buf.view(mesh.world_size, -1)[:, 0].tolist()
        out["odc"] = supports_odc(tr)
        out["sync"] = tr.sync(torch.tensor([1.0], dtype=torch.float64)).item()
    return out


def process_group_worker(kind, callers):
    """With ``callers``, this "user" made the default group before the transport (as torchrun
    scripts, verl and Ray Train do): the transport must use it and leave it working. Without,
    the transport creates one and the last odcfn user of it destroys it."""
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    out = {}
    if callers:
        store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           mesh.world_size, mesh.rank == 0)
        torch.distributed.init_process_group("gloo", store=store, rank=mesh.rank, world_size=mesh.world_size)
        mine = torch.distributed.group.WORLD
    layout = make_layout(_flat_model(mesh.world_size), mesh)
    shards = {u.name: torch.full((u.shard_size,), float(mesh.rank)) for u in layout.units}
    first = ShmTransport(mesh, timeout=30) if kind == "shm" else CollectiveTransport(mesh, timeout=30)
    second = CollectiveTransport(mesh, timeout=30)  # a second user of the same default group
    first.begin_step(layout, shards, torch.float32)
    first.sync(torch.ones(1, dtype=torch.float64))
    first.close()
    second.begin_step(layout, shards, torch.float32)
    buf = torch.empty(layout.units[0].padded_numel)
    second.all_gather("u0", buf)  # still works although the group's creator may have closed
    out["gathered"] = buf.view(mesh.world_size, -1)[:, 0].tolist()
    second.close()
    out["initialized"] = torch.distributed.is_initialized()
    if callers:
        out["same"] = torch.distributed.group.WORLD is mine
        t = torch.ones(1)
        torch.distributed.all_reduce(t)  # the caller's group still works
        out["sum"] = t.item()
    return out


def env_worker(fail_rank, kill_rank):
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EXTRA")
    rank = int(os.environ["RANK"])
    if rank == fail_rank:
        raise ValueError("bad sample 3")
    if rank == kill_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    return {k: os.environ.get(k) for k in keys}


# --- multi-process ----------------------------------------------------------------------------


def test_concurrent_scatter_accumulate_is_exact(mp_pool):  # noqa: F811
    world = 4
    out = mp_pool.run(stress_worker, world)
    want = _pattern(SHARD * world).view(world, SHARD) * ROUNDS * sum(r + 1 for r in range(world))
    for r, (acc, _, _) in enumerate(out):
        assert set(acc) == {f"u{i}" for i in range(UNITS)}
        for name, a in acc.items():
            assert torch.equal(a, want[r]), (r, name, (a - want[r]).abs().max().item())
    # fetch_add(0): shared by all ranks: every number exactly once, none skipped
    claims = sorted(c for o in out for c in o[2])
    assert claims == list(range(len(claims)))


def test_segments_are_unlinked_once_every_rank_mapped_them(mp_pool):  # noqa: F811
    for visible, mapped in mp_pool.run(unlinked_worker, 3):
        assert visible == [] and mapped == 3  # from here on a crash leaves nothing in /dev/shm


def test_fetch_add_refuses_to_reset_a_counter_a_later_step_uses(mp_pool):  # noqa: F811
    # (fetch_add's semantics on every transport: tests/transport/test_transport_conformance.py)
    out = mp_pool.run(behind_worker, 2)
    assert out[0] is None
    assert "counter 5" in out[1] and "step 2" in out[1], out[1]


def test_collective_transport_gathers_and_has_no_one_sided_ops(mp_pool):  # noqa: F811
    out = mp_pool.run(collective_refuses_worker, 2)
    for o in out:
        assert o["gathered"] == [0.0, 1.0] and o["sync"] == 2.0
        assert o["odc"] is False


@pytest.mark.parametrize("kind", ["shm", "collective"])
@pytest.mark.parametrize("callers", [True, False])
def test_transports_use_the_callers_process_group_and_never_destroy_it(mp_pool, kind, callers):  # noqa: F811
    for o in mp_pool.run(process_group_worker, 2, args=(kind, callers)):
        assert o["gathered"] == [0.0, 1.0]
        if callers:
            assert o == {"gathered": [0.0, 1.0], "initialized": True, "same": True, "sum": 2.0}
        else:  # created by odcfn, destroyed when its last user closed
            assert o["initialized"] is False


def test_launch_sets_the_torchrun_env_and_reports_failing_and_killed_ranks():
    with pytest.raises(LaunchError) as info:
        launch(env_worker, 3, args=(1, 2), env={"EXTRA": "x"}, timeout=30)
    err = info.value
    assert "rank 1" in str(err) and "ValueError: bad sample 3" in str(err)
    assert "raise ValueError" in str(err)  # the failing rank's traceback comes along
    assert set(err.errors) == {1, 2} and set(err.results) == {0}
    assert "killed by signal 9" in err.errors[2]
    env = err.results[0]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
    assert env["LOCAL_RANK"] == "0" and env["EXTRA"] == "x" and int(env["MASTER_PORT"]) > 0


# --- one process ------------------------------------------------------------------------------


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        launch(env_worker, 0)
    with pytest.raises(TypeError, match="callable"):
        launch("env_worker", 2)
    with pytest.raises(ValueError, match="timeout"):
        launch(env_worker, 2, timeout=0)
    with pytest.raises(TypeError, match="env"):
        launch(env_worker, 2, env={"A": 1})


def test_transport_arguments_are_checked_before_any_communication(monkeypatch):
    mesh = odcfn.Mesh(2, 0)
    with pytest.raises(ValueError, match="chunk_elems"):
        ShmTransport(mesh, chunk_elems=0)
    with pytest.raises(ValueError, match="timeout"):
        TorchCollectives(mesh, timeout=0)
    with pytest.raises(TypeError, match="Mesh"):
        TorchCollectives("mesh")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT not set"):
        CollectiveTransport(mesh)


def test_segment_is_unlinked_but_stays_mapped(tmp_path, monkeypatch):
    monkeypatch.setenv("ODCFN_SHM_DIR", str(tmp_path))
    path = os.path.join(shm_dir(), "seg")
    own = Segment(path, 4096, create=True)
    peer = Segment(path, 4096, create=False)
    own.unlink()
    assert not os.path.exists(path)
    own.view(64, 4, torch.float32).copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert peer.view(64, 4, torch.float32).tolist() == [1.0, 2.0, 3.0, 4.0]  # same memory
    with pytest.raises(ValueError, match="aligned"):
        own.view(2, 1, torch.float32)
    other = Segment(os.path.join(shm_dir(), "x"), 8, create=True)
    with pytest.raises(TransportError, match="layout"):
        Segment(other.path, 16, create=False)
    for seg in (own, peer, other):
        seg.close()
    assert os.listdir(tmp_path) == []


def test_range_lock_excludes_a_second_holder_and_times_out(tmp_path):
    path = str(tmp_path / "lockfile")
    open(path, "wb").close()
    fd1, fd2 = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)
    try:
        with RangeLock(fd1, 7, 1.0, "byte 7"):
            # OFD locks exclude other open file descriptions even inside one process
            t0 = time.monotonic()
            with pytest.raises(TransportError, match="byte 7"):
                with RangeLock(fd2, 7, 0.2, "byte 7"):
                    pass
            assert 0.2 <= time.monotonic() - t0 < 2.0
            with RangeLock(fd2, 8, 0.2, "byte 8"):  # another byte: independent
                pass
        with RangeLock(fd2, 7, 0.2, "byte 7"):  # released
            pass
    finally:
        os.close(fd1)
        os.close(fd2)


def test_wait_until_ends_on_timeout_abort_and_dead_peer():
    with pytest.raises(TransportError, match="timed out after 0.1s"):
        wait_until(lambda: False, timeout=0.1, what="nothing")
    with pytest.raises(TransportError, match="peer gone"):
        wait_until(lambda: False, timeout=5, what="x", check=lambda: "peer gone")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not pid_alive(dead.pid) and pid_alive(os.getpid())
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=f"rank 3 \\(pid {dead.pid}\\) died"):
        wait_until(lambda: False, timeout=5, what="x", peers=[(3, lambda: dead.pid)])
    assert time.monotonic() - t0 < 1.0
    wait_until(lambda: True, timeout=0.0, what="already true")
