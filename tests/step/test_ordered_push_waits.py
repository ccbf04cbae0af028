"""Issue 40, item 6, the synchronous deterministic step: a rank waiting for another's turn in the
fixed push order times out from that peer's last progress, not from a fixed deadline, so a busy
peer is not taken for a dead one; a stuck one still ends the wait within the timeout."""

from __future__ import annotations

import time

import odcfn
from odcfn.step.execute import Executor
from odcfn.transport.base import TransportError
from tests.util import make_state, tiny

GATHER_S = 0.3  # rank 1's every gather: a plan step (a beat) every 0.3 s, its step well over 1 s


def _slow_rank_1(monkeypatch, stuck_s: float = 0.0) -> None:
    gather = Executor._gather
    stuck = [stuck_s]  # rank 1 sticks once: after that it winds down at its normal pace

    def slow_gather(self, s, offset):
        if self.rank == 1:
            time.sleep(GATHER_S)
            if stuck[0]:
                time.sleep(stuck.pop())  # stuck: no progress at all for this long
                stuck.append(0.0)
        return gather(self, s, offset)

    monkeypatch.setattr(Executor, "_gather", slow_gather)


def _two_microbatches_each(rank, tr):
    cfg, model, full = tiny()
    batch = odcfn.random_batch([6, 6, 6, 6], cfg.vocab_size, seed=0)
    st = make_state(full, model, tr, optimizer=odcfn.sgd(0.1), deterministic=True,
                    max_tokens_per_microbatch=6)
    t0 = time.perf_counter()
    try:
        _, m = odcfn.train_step(st, batch)
    except TransportError as e:
        return time.perf_counter() - t0, str(e)
    return time.perf_counter() - t0, m.counters.gathers


def test_a_busy_peer_keeps_its_turn(monkeypatch):
    """Rank 0's second microbatch slot comes after rank 1's first, which takes over 1 s to
    reach while rank 1 beats every 0.3 s: rank 0 waits past the 1 s timeout and succeeds."""
    _slow_rank_1(monkeypatch)
    (t0, gathers0), (_, gathers) = odcfn.run_local(_two_microbatches_each, 2, timeout=1.0)
    assert isinstance(gathers0, int), gathers0  # no error
    assert gathers * GATHER_S > 1.5 and t0 > 1.0  # rank 0 really waited past the timeout


def test_a_stuck_peer_still_ends_the_wait(monkeypatch):
    """Rank 1 stops making progress for 6 s: rank 0 gives up waiting for its turn about 1 s
    after rank 1's last progress (in-process, the pusher used a fixed 60 s before)."""
    _slow_rank_1(monkeypatch, stuck_s=6.0)
    (t0, msg), _ = odcfn.run_local(_two_microbatches_each, 2, timeout=1.0)
    assert isinstance(msg, str) and "deterministic push order" in msg and "no progress" in msg, msg
    assert t0 < 5.0, t0
