"""The staleness version stores (``odcfn.transport.versions_base``) at the transport level, issue
40: a gather cannot return a slot rewritten under it, in-process and over /dev/shm (item 12: the
slot's tag is read before and after the copy); deterministic staleness over /dev/shm gives its
accumulator pages back once a step is applied, so only steps in flight hold them (item 13)."""

from __future__ import annotations

import os
import threading
import types
import uuid

import pytest
import torch

import odcfn
from odcfn.sharding import make_layout
from odcfn.step import stale
from odcfn.transport.base import Counters, TransportError
from odcfn.transport.local import LocalCollectives, LocalWorld
from odcfn.transport.shm import ShmTransport
from odcfn.transport.versions_shm import StaleShm
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import make_state, tiny


def _local_store():
    world = LocalWorld(1, timeout=5)
    return world.transport(0).versions(2, 0)  # τ = 1: two slots, version v in slot v % 2


def _shm_store():
    """A one-rank /dev/shm store in this process (its collectives: a one-thread LocalWorld's)."""
    mesh = odcfn.Mesh(1, 0)
    tr = types.SimpleNamespace(
        mesh=mesh,
        counters=Counters(),
        collectives=LocalCollectives(LocalWorld(1), 0),
        timeout=5.0,
        chunk=1 << 16,
        _stem=f"odcfn-test-{uuid.uuid4().hex[:8]}",
    )
    return StaleShm(tr, 2, 0)


@pytest.mark.parametrize("make", [_local_store, _shm_store], ids=["threads", "shm"])
def test_a_gather_never_returns_a_slot_rewritten_under_it(make):
    """Version 2 reuses version 0's slot. A publish of 2 that has written the first unit and not
    yet the second (held there) is in progress while version 0 is gathered: the gather must
    refuse, not return version 2's weights as version 0's. A finished rewrite is refused too,
    and an untouched slot reads back exactly what was published."""
    _, model, full = tiny()
    mesh = odcfn.Mesh(1, 0)
    layout = make_layout(model, mesh)
    v0 = odcfn.shard(full, model, mesh)
    store = make()
    try:
        store.start(layout, v0, torch.float32, lambda k, grads, stats: v0)
        store.open(0, dict.fromkeys(model.unit_names, 1))
        first, second = layout.units[0].name, layout.units[1].name
        out = torch.empty(layout[first].shard_size)
        store.gather(first, out)
        assert torch.equal(out, v0[first]) and store.pinned[first] == 0

        entered, release = threading.Event(), threading.Event()

        class Held(dict):
            def __getitem__(self, unit):
                if unit == second:  # the first unit of version 2 is written by now
                    entered.set()
                    assert release.wait(10)
                return super().__getitem__(unit)

        v2 = Held({k: v + 1 for k, v in v0.items()})
        writer = threading.Thread(target=store.publish, args=(0, 2, v2))
        writer.start()
        try:
            assert entered.wait(10)
            store.pinned.clear()  # a fresh pin: version 0 is still the newest published
            with pytest.raises(TransportError, match=f"torn read of '{first}' version 0"):
                store.gather(first, out)
        finally:
            release.set()
            writer.join()
        store.pinned[first] = 0  # pinned before the rewrite, read after it
        with pytest.raises(TransportError, match="holding version 2"):
            store.gather(first, out)
    finally:
        store.close()


def _resident(fd: int, lo: int, hi: int) -> int:
    """Bytes of ``[lo, hi)`` of a tmpfs file backed by pages (SEEK_DATA / SEEK_HOLE)."""
    n, pos = 0, lo
    while pos < hi:
        try:
            d = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past pos
            break
        if d >= hi:
            break
        h = os.lseek(fd, d, os.SEEK_HOLE)
        n, pos = n + min(h, hi) - d, h
    return n


def deterministic_memory_worker(n: int):
    """``n`` deterministic stale steps (rank 1 slow), then drain: this rank's segment's resident
    bytes in its accumulator slots and in its published versions."""
    import time

    torch.set_num_threads(1)
    _, model, full = tiny()
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=30) as tr:
        st = make_state(full, model, tr, optimizer=odcfn.sgd(0.5), staleness=1, deterministic=True)
        for j in range(n):
            if mesh.rank == 1:
                time.sleep(0.05)
            st, _ = odcfn.train_step(st, odcfn.random_batch([5, 9, 3, 7], 37, seed=j))
        st, _ = stale.drain(st)
        view = tr._stale
        fd, off = view._segs[mesh.rank].fd, view.off

        def span(offsets: list[dict[str, int]], esize: int) -> tuple[int, int]:
            ends = [(o, o + view.sizes[u] * esize) for part in offsets for u, o in part.items()]
            return min(o for o, _ in ends), max(e for _, e in ends)

        acc = sum(_resident(fd, *span(slot, 4)) for slot in off.acc)
        pub = sum(_resident(fd, *span([slot], 4)) for slot in off.pub)
        return acc, pub


def test_deterministic_accumulators_hold_memory_only_while_steps_are_in_flight(mp_pool):  # noqa: F811
    for acc, pub in mp_pool.run(deterministic_memory_worker, 2, args=(4,)):
        assert pub > 0  # the published versions are resident: the measure sees tmpfs pages
        assert acc == 0  # every step applied: no accumulator page left (W parts per slot before)
