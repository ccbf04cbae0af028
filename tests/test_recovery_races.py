"""Races between the saves of one job, forced deterministically: a peer's probe of the staging
directory that rank 0's commit (a rename) or a peer's abort (a removal) overtakes between the
check and the listing is a commit or an abort, never a ``FileNotFoundError``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from odcfn.checkpoint.commit import CheckpointError, Staging, list_quietly


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
