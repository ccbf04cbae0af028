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
next with a warning naming the file. Given the job's collectives, each rank checks only the
files it reads and the ranks agree on the verdict through an all-reduce (one when all is well);
alone, a process checks every file. A process hashes a file once (``verify.matches``), so
loading the chosen snapshot does not hash its files again.

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
from typing import Any

import torch

from odcfn.checkpoint.commit import CheckpointError, fsync_path, list_quietly
from odcfn.checkpoint.sharded import MANIFEST, read_manifest, write_shards
from odcfn.checkpoint.verify import check_files, files_read, matches
from odcfn.transport.base import world_group
from odcfn.transport.shm_sync import shm_dir

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
        if not matches(f, entry):
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


def newest_verified(roots: Sequence[Path], *, mesh: Any = None, collectives: Any = None) -> Path | None:
    """The verified snapshot with the highest step among ``roots`` (earlier roots win a tie:
    list the fastest tier first); failing ones are skipped with a warning naming the file.

    Alone (no ``collectives``, or one rank) every file is checked. Given the job's ``mesh`` and
    ``collectives`` (every rank calls, in the same order) each rank checks only the files it
    will read (``files_read``) and the ranks agree on the newest snapshot that every rank found
    good, through one all-reduce when all is well (one more per snapshot some rank rejected):
    a corrupt file read by one rank makes every rank skip that snapshot alike."""
    found = [(step, -i, d) for i, root in enumerate(roots) for step, d in committed(Path(root))]
    order = [(step, d) for step, _, d in sorted(found, reverse=True)]
    if collectives is None or mesh is None or mesh.world_size == 1:
        for step, d in order:
            if (why := _problem(d, mesh)) is None:
                return d
            warnings.warn(f"skipping snapshot {d} (step {step}) for an older one: {why}", stacklevel=2)
        return None
    return _agreed(order[:_CANDIDATES], mesh, collectives)


_CANDIDATES = 16  # snapshots a collective restart considers, newest first (every rank alike)


def _problem(d: Path, mesh: Any, reads: bool = False) -> str | None:
    """Why snapshot ``d`` is unusable (None: it verifies). ``reads``: check only the files
    ``mesh``'s rank reads (its own part of a collective verdict)."""
    try:
        doc = read_manifest(d)
        if "part" in doc:
            raise CheckpointError(f"checkpoint {d} is one node's part of a snapshot, not a whole checkpoint")
        files = check_files(doc, d)
        mine = files_read(doc, mesh.shard_index, mesh.shard_count) if reads else range(len(files))
    except (CheckpointError, FileNotFoundError) as e:
        return str(e)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"checkpoint {d}: {e}"
    for i in sorted(mine):
        if not files[i].is_file():
            return f"{files[i]} is missing"
        if not matches(files[i], doc["files"][i]):
            return f"{files[i]} does not match the sha256 in its manifest"
    return None


def _agreed(order: list[tuple[int, Path]], mesh: Any, collectives: Any) -> Path | None:
    """Rounds of one all-reduce: each rank names the first snapshot (from the agreed lower
    bound on) whose files it reads all verify; once every rank names the same one, that is it.
    Otherwise the largest name is the next lower bound (whoever named it rejected every snapshot
    before it), so each round moves on or ends. The listing's steps ride along: a position at
    which the ranks list different snapshots is skipped by all."""
    K, W = _CANDIDATES, mesh.world_size
    lb, failed, good = 0, set(), set()  # failed: rejected here or, after a round, by any rank

    def skip(k: int, why: str) -> None:
        failed.add(k)
        step, d = order[k] if k < len(order) else (None, f"#{k}")
        warnings.warn(f"skipping snapshot {d} (step {step}) for an older one: {why}", stacklevel=4)

    while True:
        first = K  # slot K: nothing left
        for k in range(lb, len(order)):
            if k in failed:
                continue
            why = None if k in good else _problem(order[k][1], mesh, reads=True)
            if why is None:
                good.add(k)
                first = k
                break
            skip(k, why)
        mine = [order[k][0] + 1 if k < len(order) else 0 for k in range(K)]
        v = torch.zeros(2 * K + 1, dtype=torch.int64)
        v[first] = 1
        v[K + 1:] = torch.tensor(mine)
        v = collectives.all_reduce(world_group(mesh), v).tolist()
        for k in range(K):
            if v[K + 1 + k] != W * mine[k] and k not in failed:
                skip(k, "the ranks list different snapshots at this position")
        chosen = max(k for k in range(K + 1) if v[k])
        if chosen == K:
            return None
        if v[chosen] == W and chosen not in failed:
            return order[chosen][1]
        for k in range(lb, chosen):
            if k not in failed and k < len(order):
                skip(k, "a file another rank reads fails verification")
        lb = chosen


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

    def __init__(
        self, out_dir: str | os.PathLike, node: int | None = None, *, leader: bool = True,
        mesh: Any = None, collectives: Any = None,
    ) -> None:
        """``node``: this node's index in a job of several (its snapshots are parts, see
        ``checkpoint/node_tier.py``). The directory is under ``ODCFN_SNAPSHOT_DIR`` if set
        (e.g. another memory file system), else the shared-memory directory. ``leader``: this
        rank is the one that publishes, clears and cleans up (rank 0). ``mesh`` and
        ``collectives``: the job's, so that ``resume`` (then a collective) has each rank verify
        only the files it reads (``newest_verified``)."""
        self.mesh, self.collectives = mesh, collectives
        key = hashlib.sha256(os.fsencode(os.path.abspath(out_dir))).hexdigest()[:16]
        base = os.environ.get("ODCFN_SNAPSHOT_DIR") or shm_dir()
        self.parts, self.leader = node is not None, leader
        self.root = Path(base) / (f"odcfn-snap-{key}" if node is None else f"odcfn-snap-{key}-node{node}")

    def resume(self, disk: Path) -> Path | None:
        """The newest verified snapshot of this tier or of the ``disk`` tier (this one on a tie)."""
        return newest_verified([self.root, disk], mesh=self.mesh, collectives=self.collectives)

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

