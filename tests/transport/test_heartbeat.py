"""A busy peer is not a dead peer (``odcfn.transport.heartbeat``): a rank that computes for much
longer than ``timeout`` — but makes progress, plan step by plan step — keeps its peers waiting
and the step finishes; a rank that stops making progress still ends the wait within about
``timeout``; on threads and on processes over /dev/shm alike."""

from __future__ import annotations

import time

import pytest

import odcfn
from odcfn.step.execute import Executor
from tests.util import make_state, tiny

SLOW = 0.25  # seconds per forward/backward of one unit on the slow rank


def _slow_rank(monkeypatch_setattr, rank: int, per_step: float) -> None:
    """Make ``rank``'s every forward and backward take ``per_step`` longer (a long sample)."""
    for name in ("_forward", "_backward"):
        orig = getattr(Executor, name)

        def slow(self, s, offset, orig=orig):
            if self.rank == rank:
                time.sleep(per_step)
            return orig(self, s, offset)

        monkeypatch_setattr(Executor, name, slow)


def _train(rank, tr, cfg, model, full, batch, steps=2):
    state = make_state(full, model, tr)
    t0 = time.monotonic()
    for _ in range(steps):
        state, m = odcfn.train_step(state, batch)
    return time.monotonic() - t0, m.loss


def test_a_busy_rank_beyond_the_timeout_keeps_its_peer_waiting_threads(monkeypatch, capsys):
    cfg, model, full = tiny()
    batch = odcfn.random_batch([3, 4, 5, 6], cfg.vocab_size)
    _slow_rank(monkeypatch.setattr, 1, SLOW)  # ~8 unit steps a minibatch: ~2 s, 4x the timeout
    out = odcfn.run_local(lambda r, tr: _train(r, tr, cfg, model, full, batch), 2, timeout=0.5)
    assert out[0][0] > 4 * 0.5  # rank 0 really waited beyond its timeout, and finished
    assert out[0][1] == out[1][1]
    err = capsys.readouterr().err
    assert "still waiting for" in err and "the peer is busy, not stuck" in err  # progress shown


def test_a_stuck_rank_still_times_out_in_bounded_time(monkeypatch):
    cfg, model, full = tiny()
    batch = odcfn.random_batch([3, 4, 5, 6], cfg.vocab_size)
    _slow_rank(monkeypatch.setattr, 1, 4.0)  # one plan step far beyond the timeout: no progress
    seen = {}

    def fn(rank, tr):
        t0 = time.monotonic()
        try:
            return _train(rank, tr, cfg, model, full, batch, steps=1)
        finally:
            seen[rank] = time.monotonic() - t0

    with pytest.raises(odcfn.TransportError, match=r"timed out after 0.5s .*no progress from it"):
        odcfn.run_local(fn, 2, timeout=0.5)
    assert seen[0] < 3.0  # ~timeout (+ the 1 s polling slice), not the 4 s of the stuck step


def shm_worker(timeout: float, slow: float, steps: int) -> tuple[float, float]:
    """One rank under odcfn.launch: ODC over /dev/shm, rank 1 slowed."""
    import torch

    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    cfg, model, full = tiny()
    batch = odcfn.random_batch([3, 4, 5, 6], cfg.vocab_size)
    mesh = odcfn.Mesh.from_env()
    # set up and warm up with a generous timeout (ranks start seconds apart on a loaded machine;
    # a fresh process's first backward is one slow plan step), then the short one: waits read it
    with ShmTransport(mesh, timeout=60) as tr:
        _train(mesh.rank, tr, cfg, model, full, batch, 1)
        tr.timeout = timeout
        _slow_rank(lambda obj, name, fn: setattr(obj, name, fn), 1, slow)
        return _train(mesh.rank, tr, cfg, model, full, batch, steps)


def test_a_busy_rank_beyond_the_timeout_keeps_its_peer_waiting_processes():
    out = odcfn.launch(shm_worker, 2, args=(1.0, 0.4, 1), timeout=60)
    assert out[0][0] > 3 * 1.0 and out[0][1] == out[1][1]
