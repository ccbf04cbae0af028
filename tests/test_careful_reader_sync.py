"""Issue 40's findings on start-up races and rank agreement: each test here failed on the code
before its fix (the commit that added it says how)."""

from __future__ import annotations

import sys

import pytest
import torch

import odcfn
from odcfn.sft.lock import RankLock, RunDirLocked, RunLock
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import make_state, tiny

CFG, MODEL, FULL = tiny()


def test_run_lock_probe_never_takes_a_rank_lock_a_rank_is_acquiring(tmp_path, monkeypatch):
    """Issue 40, item 7. Under torchrun rank 0 takes the run lock while its peers take their
    rank locks. Its probe of the rank locks used to *take* each one for a moment, so a peer
    acquiring its own lock in that moment was refused as "another run" (with its own pid).
    A profile hook makes "that moment" every moment: after each C call of the run lock's
    acquisition (the probe's lock calls included) a rank takes and drops its lock."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    RankLock(tmp_path, 1).acquire().release()  # the file exists, as after a rank's start
    refused: list[str] = []
    tries = [0]

    def a_rank_starts_now(frame: object, event: str, arg: object) -> None:
        if event == "c_return":  # the profiler does not trace its own hook: no recursion
            tries[0] += 1
            try:
                RankLock(tmp_path, 1).acquire().release()
            except RunDirLocked as e:
                refused.append(str(e))

    sys.setprofile(a_rank_starts_now)
    try:
        RunLock(tmp_path, wait_ranks=1.0).acquire().release()
    finally:
        sys.setprofile(None)
    assert tries[0] > 5
    assert not refused, f"{len(refused)} of {tries[0]} rank-lock acquisitions refused: {refused[0]}"


# --- item 20: the fingerprint names the field that differs ---------------------------------------


def _extras_batch(edit: str | None) -> odcfn.Batch:
    """Tokens and two per-token extras; ``edit``: change one extra's value (or drop one extra)."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for n in (5, 9, 3, 7):
        tokens = torch.randint(0, CFG.vocab_size, (n,), generator=g)
        extras = {"expert_ids": torch.randint(0, 8, (n, 3, 2), generator=g),
                  "advantages": torch.randn(n, generator=g)}
        samples.append(odcfn.Sample(tokens, extras=extras))
    if edit == "drop":
        samples = [odcfn.Sample(s.tokens, extras={"advantages": s.extras["advantages"]}) for s in samples]
    elif edit is not None:
        s = samples[2]
        v = s.extras[edit].clone()
        v.view(-1)[1] += 1
        samples[2] = odcfn.Sample(s.tokens, extras={**s.extras, edit: v})
    return odcfn.Batch(tuple(samples))


@pytest.mark.parametrize("edit, said", [
    ("expert_ids", "the values of a per-token extra differ (this rank: extras['expert_ids']"),
    ("advantages", "the values of a per-token extra differ (this rank: extras['advantages']"),
    ("drop", "the per-token extras' names / dtypes / shapes differ"),
])
def test_the_fingerprint_error_names_the_extra_that_differs(edit, said):
    """Issue 40, item 20: when only an extra differed, the error said the token ids or loss masks
    differ. It names the extra now, and does not blame the tokens."""

    def fn(rank, tr):
        try:
            odcfn.grad_step(make_state(FULL, MODEL, tr), _extras_batch(edit if rank == 1 else None))
        except ValueError as e:
            return str(e)
        return None

    for msg in odcfn.run_local(fn, 2, timeout=30):
        assert msg is not None and msg.startswith("ranks disagree on the minibatch: "), msg
        assert said in msg and "token ids" not in msg, msg


# --- item 22: sets and tensors are fingerprinted by what they hold -------------------------------


def test_stable_repr_sees_the_contents_of_sets_and_tensors():
    """Issue 40, item 22: ``stable_repr`` described a set or a tensor by its type alone, so
    ``ScheduleOptions.remat`` / ``frozen`` / ``passthrough`` agreed whatever they held."""
    from odcfn.schedule.plan import ScheduleOptions
    from odcfn.step.fingerprint import stable_repr

    a, b = ScheduleOptions(remat=frozenset({"layers.0"})), ScheduleOptions(remat=frozenset({"head"}))
    assert stable_repr(a) != stable_repr(b)
    assert stable_repr(ScheduleOptions(frozen=frozenset({"embed"}))) != stable_repr(ScheduleOptions())
    assert stable_repr({"b", "a", "c"}) == stable_repr({"c", "a", "b"}) != stable_repr({"a", "b"})
    assert stable_repr({1, "1"}) != stable_repr({1})  # mixed types sort too
    t = torch.arange(6.0)
    assert stable_repr(t) == stable_repr(t.clone())
    assert stable_repr(t) != stable_repr(t + 1) and stable_repr(t) != stable_repr(t.reshape(2, 3))
    assert stable_repr(t) != stable_repr(t.double())


def _train_differently(tr, rank: int, **config) -> tuple[str, int, int]:
    """One train_step where rank 1 freezes the embedding and rank 0 trains everything: what it
    raised, and the gathers and pushes this rank made."""
    batch = odcfn.random_batch([5, 9, 3, 7], CFG.vocab_size, seed=0)
    kw = {"trainable": lambda n: not n.startswith("embed")} if rank == 1 else {}
    state = odcfn.TrainState.create(params=FULL, model=MODEL, optimizer=odcfn.sgd(0.1), transport=tr,
                                    config=odcfn.StepConfig(balance="round_robin", **config), **kw)
    try:
        odcfn.train_step(state, batch)
        out = "trained"
    except Exception as e:  # noqa: BLE001 - whatever it was, it is the outcome under test
        out = f"{type(e).__name__}: {e}"
    return out, tr.counters.gathers, tr.counters.scatters


def _raised_alike_before_any_gather(out: list) -> None:
    (msg, *_), (msg1, *_) = out
    assert msg == msg1, out
    assert msg.startswith("ValueError: ranks disagree on the trained units"), msg
    assert "rank 0 trains every unit" in msg and "rank 1 freezes ['embed']" in msg, msg
    assert all(g == 0 and s == 0 for _, g, s in out), out


@pytest.mark.parametrize("config", [{}, {"comm": "collective"}, {"staleness": 1}])
def test_ranks_that_train_different_units_raise_alike_before_the_first_gather(config):
    """Issue 40, item 22: rank 1 froze the embedding, rank 0 trained everything. Rank 0 died of
    a ``KeyError: 'embed'`` pushing into rank 1's missing accumulator; rank 1 timed out waiting
    for it. Both must raise the same error, naming the trainable sets, before any gather."""
    _raised_alike_before_any_gather(odcfn.run_local(lambda r, tr: _train_differently(tr, r, **config), 2,
                                                    timeout=10))


def train_differently_worker() -> tuple[str, int, int]:
    from odcfn.kernels.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=20) as tr:
        return _train_differently(tr, mesh.rank)


def test_processes_that_train_different_units_raise_alike_before_the_first_gather(mp_pool):  # noqa: F811
    _raised_alike_before_any_gather(mp_pool.run(train_differently_worker, 2, timeout=120))


# --- item 23: "busy" means recent progress ------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _wait(monkeypatch, beats_at: list[float], until: float, timeout: float = 1.0) -> tuple[bool, str]:
    """A ``Patience`` on a fake clock, polled every 10 ms up to ``until`` seconds into the wait,
    with the peer's progress counter moving at ``beats_at``: whether it expired, and its notes."""
    import io

    from odcfn.kernels import heartbeat

    clock, err = _Clock(), io.StringIO()
    monkeypatch.setattr(heartbeat.time, "monotonic", clock)
    monkeypatch.setattr(heartbeat.sys, "stderr", err)
    t0 = clock.now
    beats = lambda: sum(t0 + b <= clock.now for b in beats_at)  # noqa: E731
    patience = heartbeat.Patience(timeout, "rank 1 to publish", beats)
    expired = False
    while clock.now < t0 + until and not (expired := patience.expired()):
        clock.now += 0.01
    return expired, err.getvalue()


def test_a_peer_stopped_after_a_first_beat_is_not_called_busy(monkeypatch):
    """Issue 40, item 23: a peer that made progress in the wait's first milliseconds and was
    then SIGSTOPped was reported as "busy, not stuck" a timeout later, just before the timeout
    ("no progress from it for 1.0s") ended the wait."""
    expired, err = _wait(monkeypatch, beats_at=[0.005], until=3.0)
    assert expired
    assert "busy" not in err, err


def test_a_peer_making_progress_is_still_called_busy(monkeypatch):
    expired, err = _wait(monkeypatch, beats_at=[0.3 * k for k in range(1, 11)], until=2.5)
    assert not expired
    assert "the peer is busy, not stuck" in err, err
