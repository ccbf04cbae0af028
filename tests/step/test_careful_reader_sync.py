"""Issue 40's findings on start-up races and rank agreement: each test here failed on the code
before its fix (the commit that added it says how)."""

from __future__ import annotations

import os
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
    from odcfn.transport.shm import ShmTransport

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

    from odcfn.transport import heartbeat

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


# --- item 8: two rendezvous on one node never share a secret file --------------------------------


def test_two_jobs_rendezvousing_at_once_on_one_node_do_not_share_a_secret(monkeypatch):
    """Issue 40, item 8: the conformance test's ``nvshmem_threads`` case failed once beside
    another run. The CUDA-IPC rendezvous (the CPU NVSHMEM fabric's memory too) names its node-local
    secret file after (uid, torchrun env, key, group): the same for two jobs on one node without
    torchrun's env (two test runs' threads). The first job to finish unlinks the file; a late rank
    of the other then makes a fresh secret, and its peers' records fail authentication. Forced
    here: job B's rank 0 reads the secret, job A rendezvouses start to end, then B's rank 1."""
    import threading
    from datetime import timedelta

    from torch.distributed import HashStore

    from odcfn.transport.gpu.cuda_ipc import IpcFabric

    monkeypatch.delenv("ODCFN_JOB_SECRET", raising=False)
    monkeypatch.setenv("ODCFN_SHM_PREFIX", f"odcfn-item8-{os.getpid()}")  # away from other runs

    def job() -> tuple[HashStore, list[IpcFabric]]:
        store = HashStore()
        store.set_timeout(timedelta(seconds=10))
        return store, [IpcFabric(odcfn.Mesh(2, r), store, "cpu", timeout=10) for r in range(2)]

    outcome: dict[str, object] = {}

    def setup(name: str, fabric: IpcFabric) -> threading.Thread:
        def go() -> None:
            try:
                fabric.setup(4096, 8, "odcfn/arena/1")
                outcome[name] = "ok"
            except Exception as e:  # noqa: BLE001 - the outcome under test
                outcome[name] = e

        t = threading.Thread(target=go, daemon=True)
        t.start()
        return t

    (_, job_a), (store_b, job_b) = job(), job()
    try:
        b0 = setup("b0", job_b[0])
        store_b.get("odcfn/arena/1/0")  # B's rank 0 has read the secret and sealed its record
        for t in [setup("a0", job_a[0]), setup("a1", job_a[1])]:
            t.join(15)
        b1 = setup("b1", job_b[1])
        b0.join(15)
        b1.join(15)
        assert outcome == {"a0": "ok", "a1": "ok", "b0": "ok", "b1": "ok"}, outcome
    finally:
        for f in job_a + job_b:
            f.close()
