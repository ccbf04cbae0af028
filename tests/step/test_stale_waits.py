"""Issue 40, the waits of bounded staleness on in-process ranks: a busy peer is not taken for a
dead one (item 6: every wait times out from the peers' last progress, as the synchronous step's
do), and a rank waiting while another thread applies an owner's update sleeps on the condition
instead of spinning (item 11)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

import odcfn
from odcfn.step import stale
from odcfn.step.execute import Executor
from tests.util import make_state, tiny

LR = 0.5
GATHER_S = 0.3  # rank 1's every gather: a plan step (a beat) every 0.3 s, a step of over 1 s


@pytest.mark.parametrize(("tau", "deterministic"), [(0, False), (1, False), (1, True)])
def test_a_busy_peer_is_not_a_dead_one(monkeypatch, tau, deterministic):
    """Rank 1 takes well over the 1 s timeout for its step but makes progress every 0.3 s; rank 0
    waits for it (in drain at τ = 1, at the sync at τ = 0) and must not time out."""
    cfg, model, full = tiny()
    batch = odcfn.random_batch([5, 9], cfg.vocab_size, seed=0)  # one microbatch per rank
    gather = Executor._gather

    def slow_gather(self, s, offset):
        if self.rank == 1:
            time.sleep(GATHER_S)
        return gather(self, s, offset)

    monkeypatch.setattr(Executor, "_gather", slow_gather)

    def fn(rank, tr):
        st = make_state(full, model, tr, optimizer=odcfn.sgd(LR), staleness=tau, deterministic=deterministic)
        t0 = time.perf_counter()
        st, m = odcfn.train_step(st, batch)
        st, _ = stale.drain(st)
        return time.perf_counter() - t0, m.counters.gathers

    (t0, _), (t1, gathers) = odcfn.run_local(fn, 2, timeout=1.0)
    assert gathers * GATHER_S > 1.5 and t0 > 1.0  # rank 0 really waited past the timeout


def test_a_waiter_sleeps_while_another_thread_applies_an_owners_update(monkeypatch):
    """Rank 1 completes step 0 last, so its thread applies owner 0's update (slowed to 1 s) while
    rank 0 waits for it in drain: rank 0's thread must sleep, not spin (its CPU time stays a
    small fraction of the wait)."""
    cfg, model, full = tiny()
    batch = odcfn.random_batch([5, 9, 3, 7], cfg.vocab_size, seed=0)
    plain = odcfn.sgd(LR)
    applying = threading.Event()

    def update(*args, **kwargs):
        applying.set()
        time.sleep(1.0)
        return plain.update(*args, **kwargs)

    slow = dataclasses.replace(plain, update=update)
    stepped = threading.Event()
    gather = Executor._gather

    def late_gather(self, s, offset):
        if self.rank == 1:  # past the step's collectives: rank 0 completes step 0 first
            assert stepped.wait(10)
        return gather(self, s, offset)

    monkeypatch.setattr(Executor, "_gather", late_gather)

    def fn(rank, tr):
        st = make_state(full, model, tr, optimizer=slow if rank == 0 else plain, staleness=1)
        st, _ = odcfn.train_step(st, batch)
        if rank == 1:
            return None
        stepped.set()
        cpu, wall = time.thread_time(), time.perf_counter()
        st, _ = stale.drain(st)
        return time.thread_time() - cpu, time.perf_counter() - wall

    (cpu, wall), _ = odcfn.run_local(fn, 2, timeout=30)
    assert applying.is_set() and wall > 0.9  # rank 0 did wait for the slow update
    assert cpu < 0.05, (cpu, wall)
