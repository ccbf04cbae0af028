"""Issue 40's findings on start-up races and rank agreement: each test here failed on the code
before its fix (the commit that added it says how)."""

from __future__ import annotations

import sys

from odcfn.sft.lock import RankLock, RunDirLocked, RunLock


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
