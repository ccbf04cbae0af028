"""Snapshots that outlive the trainer: a memory tier in /dev/shm, and picking the newest good one.

A ``MemoryTier`` keeps a run's newest snapshots as ordinary sharded checkpoints (the same
manifest, per-file sha256 and atomic commit as on disk) in a directory of the shared-memory
file system (``ODCFN_SHM_DIR``, default /dev/shm) that no training process owns: the files stay
when a rank is killed, so a restarted job on the same node reads them at memory speed. The disk
tier is the copy that survives the node.

Each snapshot is written beside the last (``step-XXXXXXXX``), then rank 0 verifies every file
against the manifest and only then switches the pointer (``CURRENT``, replaced atomically) to it
and removes the snapshots older than the one the pointer named before: there is never a moment
with no verified snapshot. ``cleanup`` removes the directory at the run's normal end.

``newest_verified(roots)``: among the committed snapshots of several tiers, the one with the
highest step whose every file matches its manifest; a snapshot that fails is skipped for the
next with a warning naming the file. Every rank checks every file, so all ranks (which see the
same files on one node) reach the same verdict without communicating.

Across nodes, /dev/shm is per node: ``MemoryTier(out_dir, node=n)`` is node n's directory, whose
snapshots are *parts* (its own ranks' files and a copy of its neighbour's) written and restored
by ``checkpoint/node_tier.py``. ``ODCFN_SNAPSHOT_DIR`` puts the tier elsewhere than the
shared-memory directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

from odcfn.checkpoint.commit import CheckpointError, fsync_path, list_quietly
from odcfn.checkpoint.sharded import MANIFEST, read_manifest, write_shards
from odcfn.checkpoint.verify import check_files, sha256
from odcfn.kernels.shm_sync import shm_dir

__all__ = ["MemoryTier", "committed", "newest_verified", "remove_stale", "verify_all"]

POINTER = "CURRENT"


def verify_all(path: Path, *, part_ok: bool = False) -> None:
    """Every file of checkpoint ``path`` against its manifest; ``CheckpointError`` naming the
    first file that is missing or differs. A node's part of a cross-node snapshot (its held
    files only) passes only with ``part_ok``: it is not a checkpoint one can load alone."""
    doc = read_manifest(path)
    if "part" in doc and not part_ok:
        raise CheckpointError(f"checkpoint {path} is one node's part of a snapshot, not a whole checkpoint")
    try:
        files = check_files(doc, path)
        keep = held(doc)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from e
    for f, entry in zip(files, doc["files"]):
        if entry.get("rank") not in keep:
            continue  # a part of a cross-node snapshot: another node keeps that file
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        if f.stat().st_size != entry.get("bytes") or sha256(f) != entry.get("sha256"):
            raise CheckpointError(f"{f} does not match the sha256 in its manifest")


def held(doc: dict) -> set[int]:
    """The ranks whose files a checkpoint directory holds: all of them, or a part's (a node's
    share of a snapshot of the memory tier across nodes, ``checkpoint/node_tier.py``)."""
    part = doc.get("part")
    if part is None:
        return {e.get("rank") for e in doc["files"]}
    ranks = part.get("held") if isinstance(part, dict) else None
    if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
        raise CheckpointError(f"the manifest's part record is malformed: {part!r}")
    return set(ranks)


def committed(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every committed ``step-*`` snapshot under ``root``, newest first."""
    out = []
    for d in list_quietly(root, "step-*"):
        try:
            step = int(json.loads((d / MANIFEST).read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # uncommitted, or removed since the listing
        out.append((step, d))
    return sorted(out, key=lambda x: x[0], reverse=True)


def newest_verified(roots: Sequence[Path]) -> Path | None:
    """The verified snapshot with the highest step among ``roots`` (earlier roots win a tie:
    list the fastest tier first); failing ones are skipped with a warning naming the file."""
    found = [(step, -i, d) for i, root in enumerate(roots) for step, d in committed(Path(root))]
    for step, _, d in sorted(found, reverse=True):
        try:
            verify_all(d)
            return d
        except (CheckpointError, FileNotFoundError) as e:
            warnings.warn(f"skipping snapshot {d} (step {step}) for an older one: {e}", stacklevel=2)
    return None


def remove_stale(root: Path, newer_than: int) -> None:
    """Remove ``root``'s snapshots past step ``newer_than`` and every staging leftover (call
    before a run's first save, when no save of this job is in flight)."""
    for d in list_quietly(root, ".step-*.tmp-*"):
        shutil.rmtree(d, ignore_errors=True)
    for d in list_quietly(root, "step-*"):
        num = d.name.removeprefix("step-")
        if num.isdigit() and int(num) > newer_than:
            shutil.rmtree(d, ignore_errors=True)


class MemoryTier:
    """The shared-memory snapshots of the run whose output directory is ``out_dir``.

    Its face to the training loop (``sft/restart.py``), which ``NodeTier`` shares: ``leader``
    (the rank that publishes, clears and cleans up), ``write`` (what a snapshot's save commits
    with), ``resume(disk)``, ``clear``, ``cleanup``, ``close`` and ``fetched`` (what a restart
    read back from other nodes: nothing, on one node)."""

    write = staticmethod(write_shards)
    fetched = None

    def __init__(self, out_dir: str | os.PathLike, node: int | None = None, *, leader: bool = True) -> None:
        """``node``: this node's index in a job of several (its snapshots are parts, see
        ``checkpoint/node_tier.py``). The directory is under ``ODCFN_SNAPSHOT_DIR`` if set
        (e.g. another memory file system), else the shared-memory directory. ``leader``: this
        rank is the one that publishes, clears and cleans up (rank 0)."""
        key = hashlib.sha256(os.fsencode(os.path.abspath(out_dir))).hexdigest()[:16]
        base = os.environ.get("ODCFN_SNAPSHOT_DIR") or shm_dir()
        self.parts, self.leader = node is not None, leader
        self.root = Path(base) / (f"odcfn-snap-{key}" if node is None else f"odcfn-snap-{key}-node{node}")

    def resume(self, disk: Path) -> Path | None:
        """The newest verified snapshot of this tier or of the ``disk`` tier (this one on a tie)."""
        return newest_verified([self.root, disk])

    def clear(self, newer_than: int) -> None:
        """The leader, before the first step: drop snapshots past ``newer_than`` and leftovers."""
        remove_stale(self.root, newer_than)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def current(self) -> Path | None:
        try:
            name = (self.root / POINTER).read_text().strip()
        except OSError:
            return None
        return self.root / name if name.startswith("step-") and "/" not in name else None

    def publish(self, path: Path) -> None:
        """Rank 0, after ``path`` committed: verify it, point ``CURRENT`` at it, then remove the
        snapshots older than the one the pointer named before (that one stays until the next
        switch, so a torn ``CURRENT`` target is never the only copy)."""
        verify_all(path, part_ok=self.parts)
        before = self.current()
        tmp = self.root / f".{POINTER}.{os.getpid()}"
        tmp.write_text(path.name)
        os.replace(tmp, self.root / POINTER)
        fsync_path(self.root)
        keep = {path.name} | ({before.name} if before is not None else set())
        for _step, d in committed(self.root):
            if d.name not in keep and d.name < path.name:
                shutil.rmtree(d, ignore_errors=True)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def close(self) -> None:
        """Nothing to release on one node (``NodeTier`` closes its inbox)."""

