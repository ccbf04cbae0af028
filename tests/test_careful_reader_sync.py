"""Issue 40's findings on start-up races and rank agreement: each test here failed on the code
before its fix (the commit that added it says how)."""

from __future__ import annotations

import sys

import pytest
import torch

import odcfn
from odcfn.sft.lock import RankLock, RunDirLocked, RunLock
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
