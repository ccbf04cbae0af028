"""Races between the saves of one job, forced deterministically: a peer's probe of the staging
directory that rank 0's commit (a rename) or a peer's abort (a removal) overtakes between the
check and the listing is a commit or an abort, never a ``FileNotFoundError``; a rank whose
background save failed tells the peers of its next save why, also a peer that comes late,
instead of leaving them to the save timeout."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

import odcfn
from odcfn.checkpoint.async_save import AsyncSaver
from odcfn.checkpoint.commit import CheckpointError, Staging, list_quietly
from odcfn.models import QwenConfig, init_params, qwen_model

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def _overtaken(monkeypatch, staged: Path, then) -> None:
    """Run ``then()`` (what a peer does) right before ``staged`` is next listed: after the
    rank's existence checks, before the directory is read."""
    listing, fired = os.scandir, []

    def scandir(path=".", *a):
        if not fired and isinstance(path, (str, os.PathLike)) and os.fspath(path) == os.fspath(staged):
            fired.append(True)
            then()
        return listing(path, *a)

    monkeypatch.setattr(os, "scandir", scandir)


def test_a_commit_between_a_peers_check_and_its_listing_is_a_commit(tmp_path, monkeypatch):
    root = tmp_path / "step-00000001"
    stage = Staging(root, "attempt", rank=1, timeout=5.0)
    (stage.dir / "manifest.json").write_text(json.dumps({"attempt": "attempt"}))
    _overtaken(monkeypatch, stage.dir, lambda: os.rename(stage.dir, root))  # rank 0 commits
    stage.wait(lambda: [] if (root / "manifest.json").exists() else [0], lambda m: "rank 0's commit", (0,))
    assert json.loads((root / "manifest.json").read_text())["attempt"] == "attempt"


def test_an_abort_between_a_peers_check_and_its_listing_is_an_abort(tmp_path, monkeypatch):
    import shutil

    root = tmp_path / "step-00000001"
    stage = Staging(root, "attempt", rank=0, timeout=5.0)
    _overtaken(monkeypatch, stage.dir, lambda: shutil.rmtree(stage.dir))  # rank 1 gave up
    with pytest.raises(CheckpointError, match="disappeared"):
        stage.wait(lambda: [1], lambda m: f"the files of ranks {m}", (0, 1))


def test_listing_a_directory_that_is_gone_is_empty(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / ".abort-1").write_text("why")
    assert list_quietly(tmp_path / "a", ".abort-*") == [tmp_path / "a" / ".abort-1"]
    assert list_quietly(tmp_path / "gone", "*") == []
    (tmp_path / "file").write_text("")
    assert list_quietly(tmp_path / "file", "*") == []


def test_a_rank_whose_last_save_failed_tells_the_peers_of_its_next_save_even_late_ones(tmp_path):
    """Rank 1's first background save commits, then its own follow-up fails (as the memory
    tier's publish or a prune can): its next ``save`` raises before writing. Rank 0 starts that
    next save a second later, after rank 1 gave it up: it learns why at once (it used to wait
    for rank 1's file until the save timeout)."""
    model = qwen_model(CFG)

    def fn(rank, tr):
        state = odcfn.TrainState.create(params=init_params(CFG, seed=0), model=model,
                                        optimizer=odcfn.adamw(1e-2), transport=tr)
        saver = AsyncSaver()

        def follow_up(path: Path) -> None:
            raise OSError(28, "No space left on device (the follow-up)")

        saver.save(tmp_path / "a", state.params, state.opt_state, 1, model=model, mesh=state.mesh,
                   timeout=20.0, after=follow_up if rank == 1 else None)
        if rank == 0:
            saver.wait()
            time.sleep(1.0)  # late: rank 1 has given the next save up by now
        t0 = time.monotonic()
        try:
            saver.save(tmp_path / "b", state.params, state.opt_state, 2, model=model, mesh=state.mesh,
                       timeout=20.0)
            saver.wait()
            return "saved", 0.0
        except RuntimeError as e:
            return str(e), time.monotonic() - t0

    (err0, took0), (err1, _) = odcfn.run_local(fn, 2)
    assert "(step 1) failed: OSError" in err1 and "the follow-up" in err1, err1
    assert "(step 2) failed: CheckpointError" in err0, err0
    assert "rank 1 failed: its previous save failed" in err0, err0
    assert "No space left on device (the follow-up)" in err0
    assert took0 < 5.0, took0  # the note, not the 20 s timeout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no staging of "b" left
