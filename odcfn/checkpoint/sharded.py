"""Sharded checkpoints: one safetensors file per rank plus a JSON manifest, resharded on load.

Layout of a checkpoint directory::

    manifest.json            written last (temp + rename): its presence means "committed"
    rank-00000.safetensors   rank 0's parameter shards, optimizer-state shards, replicated tensors
    rank-00001.safetensors   ...

Every rank of one shard group calls ``write_shards`` (under hybrid sharding the replicas on other nodes
hold identical shards, so only node 0 writes). Each rank writes its own file atomically and
leaves its sha256 beside it; rank 0 waits until every file of this step is there and commits
the manifest with those digests (no rank hashes another's file). There is no
communication: the file system is the barrier, so ``write_shards`` works the same on any transport.

``read_shards`` reads the manifest and cuts the saved flat units into the shards of *any* mesh: each
rank reads only the byte ranges of the old shards that overlap its new one. Optimizer states
are pytrees of dicts/lists/tuples whose tensors are either per-unit shards (a dict keyed by
exactly the model's unit names, like the params) or replicated; scalars go into the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from odcfn._check import check_int
from odcfn.checkpoint.commit import CheckpointError, Staging, fsync_path
from odcfn.checkpoint.feedback import KEY as FEEDBACK_KEY
from odcfn.checkpoint.feedback import PREFIX as FEEDBACK_PREFIX
from odcfn.checkpoint.feedback import Feedback, with_feedback
from odcfn.checkpoint.kill_point import kill_point
from odcfn.checkpoint.skeleton import decode, encode
from odcfn.checkpoint.verify import check_files, check_units, open_verified, rank_file, sha256
from odcfn.model import Model
from odcfn.sharding import Layout, Mesh, make_layout
from odcfn.sharding.layout import check_shards

__all__ = [
    "CheckpointError", "attempt_id", "commit_manifest", "give_up", "latest", "manifest_for", "read_manifest",
    "read_shards", "wait_for_commit", "wait_for_files", "write_rank_file", "write_shards",
]

FORMAT = "odcfn-checkpoint"
VERSION = 2  # 2: per-file sha256/rank/bytes, the save's attempt id
MANIFEST = "manifest.json"


# --- save --------------------------------------------------------------------------------


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = _tmp_name(path)
    tmp.write_text(text)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)  # the rename itself


def _digest_name(rank: int) -> str:
    return f".{rank_file(rank)}.sha256"


def _digest(stage: Staging, rank: int, step: int) -> str | None:
    """The sha256 ``rank`` recorded for its file of this save (None until it has)."""
    try:
        d = json.loads((stage.dir / _digest_name(rank)).read_text())
    except (OSError, ValueError):
        return None  # not written yet (it is renamed into place whole)
    ok = isinstance(d, dict) and d.get("step") == step and d.get("attempt") == stage.attempt
    return d.get("sha256") if ok and isinstance(d.get("sha256"), str) else None


def _writers(mesh: Mesh) -> tuple[int, ...]:
    """The ranks whose files make up a checkpoint: node 0's shard group (all ranks if full)."""
    return mesh.with_rank(0).shard_group


_SAVES: dict[tuple[str, int], int] = {}  # (path, rank) -> saves of it by this process so far


def attempt_id(root: Path, rank: int, step: int) -> str:
    """A name for this save that every rank computes alike without communication: the job's
    identity (launcher/torchrun variables), the path, the step and the how-manieth save of the
    path this is. A leftover of an earlier, interrupted save never has this name."""
    k = (str(root.resolve()), rank)
    n = _SAVES[k] = _SAVES.get(k, 0) + 1
    env = "|".join(os.environ.get(v, "") for v in _JOB_VARS)
    return hashlib.sha256(f"{env}|{k[0]}|{step}|{n}".encode()).hexdigest()[:16]


# the restart count too: a restarted job re-saving a path its previous incarnation was killed
# while saving must not meet that save's staging directory (its dead ranks' pids, its aborts)
_JOB_VARS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
             "ODCFN_JOB_SECRET", "ODCFN_SHM_PREFIX")


def write_shards(
    path: str | os.PathLike,
    params: Mapping[str, torch.Tensor],
    opt_state: Any,
    step: int,
    *,
    model: Model,
    mesh: Mesh,
    extra: Mapping[str, Any] | None = None,
    timeout: float = 60.0,
    overwrite: bool = False,
    feedback: Feedback | None = None,
) -> Path:
    """Write this rank's part of a checkpoint of ``(params, opt_state, step)`` as ``path``.

    Called by every rank. Returns once the checkpoint is committed, on every rank. ``extra`` is
    JSON metadata stored in the manifest (e.g. the data position). The ranks write into a fresh
    hidden directory next to ``path`` that rank 0 renames into place once complete, so ``path``
    is either absent, the old checkpoint or the new one, never a mix. An existing checkpoint
    at ``path`` is replaced only with ``overwrite=True`` (atomically: the two are exchanged).
    A rank that dies or fails while the others wait ends the save on every rank (its liveness is
    watched), and the half-written directory is removed. ``feedback``: this rank's error-feedback
    residuals, kept in its own file (every rank must then be a writer: full sharding).
    """
    root = Path(path)
    attempt = attempt_id(root, mesh.rank, step)
    if root.exists() and not overwrite and (not root.is_dir() or any(root.iterdir())):
        if mesh.rank not in _writers(mesh) and _manifest_attempt(root / MANIFEST) == attempt:
            # a replica rank (hybrid sharding: not a writer) that came after rank 0 committed this
            # very save, which needs no file of it: the save is done, not a clash
            return root
        what = "a committed checkpoint" if (root / MANIFEST).exists() else "not an empty directory"
        raise FileExistsError(f"checkpoint: {root} exists and is {what}; pass overwrite=True to replace it")
    # staging first: a rank whose input is bad then tells the others instead of vanishing
    stage = Staging(root, attempt, mesh.rank, timeout, range(mesh.world_size))
    try:
        layout, skeleton, writers = write_rank_file(stage, params, opt_state, step, model=model, mesh=mesh,
                                                    feedback=feedback)
        if mesh.rank == 0:
            known = wait_for_files(stage, writers, step)
            doc = manifest_for(model, mesh, layout, step, attempt, skeleton, with_feedback(extra, feedback),
                               stage.dir, writers, known=known)
            commit_manifest(stage, doc, step, overwrite)
        else:
            wait_for_commit(stage, 0, step)
    except BaseException as e:
        stage.abort(f"{type(e).__name__}: {e}")
        raise
    return root


# the steps of a save, shared with the memory tier across nodes (checkpoint/node_tier.py), whose
# node leaders commit a part of each snapshot instead of rank 0 committing the whole


def write_rank_file(
    stage: Staging, params: Mapping[str, torch.Tensor], opt_state: Any, step: int, *, model: Model,
    mesh: Mesh, feedback: Feedback | None = None,
) -> tuple[Layout, dict, tuple[int, ...]]:
    """Check the input, write this rank's file into ``stage`` (if it is a writer); the layout,
    the manifest's tree skeleton and the writer ranks. ``feedback``: this rank's residuals."""
    check_int(step, "checkpoint step", at_least=0)
    layout = make_layout(model, mesh)
    check_shards(params, layout, model.dtype)
    writers = _writers(mesh)
    if feedback is not None and len(writers) != mesh.world_size:  # hybrid: refused by feedback.saved
        raise ValueError(f"checkpoint: residuals need every rank to write a file, not {list(writers)}")
    tensors: dict[str, torch.Tensor] = {}
    skeleton = {
        "params": encode(dict(params), "params", layout, tensors, mesh.rank == 0),
        "opt_state": encode(opt_state, "opt_state", layout, tensors, mesh.rank == 0),
    }
    if mesh.rank in writers:
        target = stage.dir / rank_file(mesh.rank)
        tmp = _tmp_name(target)
        meta = {"step": str(step), "rank": str(mesh.rank), "format": FORMAT, "attempt": stage.attempt}
        if feedback is not None:  # the file says it holds them (an empty set too), its sha256 covers them
            meta[FEEDBACK_KEY] = json.dumps(dict(feedback.record), sort_keys=True)
            tensors.update({FEEDBACK_PREFIX + u: t.detach().to("cpu", torch.float32).contiguous()
                            for u, t in feedback.residuals.items()})
        save_file(tensors, str(tmp), metadata=meta)
        fsync_path(tmp)
        os.replace(tmp, target)
        # each writer hashes its own file (in parallel), so the committer hashes none: at W
        # ranks it would otherwise read W files in a row before it could commit
        record = {"step": step, "attempt": stage.attempt, "sha256": sha256(target)}
        digest = stage.dir / _digest_name(mesh.rank)
        tmp = _tmp_name(digest)
        tmp.write_text(json.dumps(record))
        # renamed whole into place, not synced: it only tells the committer, whose manifest
        # (synced) keeps the digest; syncing the directory here would race the commit's rename
        os.replace(tmp, digest)
        kill_point("write", step, mesh.rank)  # tests only (ODCFN_TEST_KILL_AT)
    return layout, skeleton, writers


def wait_for_files(stage: Staging, ranks: Sequence[int], step: int) -> dict[str, str]:
    """Until the files of ``ranks`` for ``step`` are in ``stage`` (their writers watched);
    their sha256 by file name, as each writer recorded it."""
    stage.wait(
        lambda: [r for r in ranks if _digest(stage, r, step) is None],
        lambda m: f"the files of ranks {m} for step {step} in {stage.root} (did every rank call save?)",
        ranks,
    )
    return {rank_file(r): _digest(stage, r, step) for r in ranks}


def commit_manifest(stage: Staging, doc: dict, step: int, overwrite: bool) -> None:
    for e in doc["files"]:  # the writers' digests are in the manifest now
        (stage.dir / _digest_name(e["rank"])).unlink(missing_ok=True)
    _atomic_write_text(stage.dir / MANIFEST, json.dumps(doc, indent=1))
    kill_point("commit", step, stage.rank)
    stage.commit(overwrite)


def wait_for_commit(stage: Staging, committer: int, step: int) -> None:
    """A rank that is not the committer: until ``committer`` has committed this save."""
    stage.wait(
        lambda: [] if _manifest_attempt(stage.root / MANIFEST) == stage.attempt else [committer],
        lambda m: f"rank {committer} to commit {stage.root}",
        (committer,),
    )
    kill_point("commit", step, stage.rank)


def give_up(path: str | os.PathLike, step: int, mesh: Mesh, why: str, timeout: float = 60.0) -> None:
    """This rank will not make its part of the save of ``(path, step)`` that its peers are making
    (e.g. its previous background save failed): leave ``why`` where they wait, so they fail at
    once naming it instead of at the timeout."""
    root = Path(path)
    try:
        stage = Staging(root, attempt_id(root, mesh.rank, step), mesh.rank, timeout, range(mesh.world_size))
    except OSError:
        return  # nowhere to leave a note: the peers meet the timeout
    stage.abort(why)


def manifest_for(
    model, mesh, layout, step, attempt, skeleton, extra, where: Path, writers, held=None, known=None
) -> dict:
    """``held``: the writers whose files are in ``where`` (default all); the others' entries
    carry no size or sha256 (a part of a snapshot, see checkpoint/node_tier.py). ``known``:
    file name -> sha256 the caller already computed or checked (not hashed again)."""
    held = set(writers if held is None else held)
    known = dict(known or {})
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "attempt": attempt,
        "mesh": {
            "world_size": mesh.world_size,
            "ranks_per_node": mesh.ranks_per_node,
            "sharding": mesh.sharding,
            "shard_count": mesh.shard_count,
        },
        "files": [
            {"name": rank_file(r), "rank": r,
             "sha256": known.get(rank_file(r)) or sha256(where / rank_file(r)),
             "bytes": (where / rank_file(r)).stat().st_size} if r in held
            else {"name": rank_file(r), "rank": r, "sha256": None, "bytes": None}
            for r in writers
        ],
        "units": {
            u.name: {
                "numel": u.numel,
                "shard_size": u.shard_size,
                "paths": list(u.paths),
                "shapes": [list(s) for s in u.shapes],
            }
            for u in layout.units
        },
        "tree": skeleton,
        "model": {"config": model.config_key, "vocab_size": model.vocab_size},
        "extra": dict(extra or {}),
    }


def _manifest_attempt(manifest: Path) -> str | None:
    try:
        return json.loads(manifest.read_text()).get("attempt")
    except (OSError, ValueError, AttributeError):
        return None


def _manifest_step(manifest: Path) -> int | None:
    try:
        return int(json.loads(manifest.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- load --------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict:
    """The committed manifest of checkpoint ``path`` (raises if it is not committed)."""
    manifest = Path(path) / MANIFEST
    if not manifest.exists():
        raise FileNotFoundError(f"{manifest} does not exist: {path} is not a committed odcfn checkpoint")
    try:
        doc = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read {manifest.name}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise CheckpointError(f"{manifest} is not an odcfn checkpoint manifest (format={got!r})")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"{manifest} has version {doc.get('version')}, this odcfn reads {VERSION}")
    return doc


def latest(root: str | os.PathLike) -> Path | None:
    """The committed checkpoint with the highest step among ``root``'s subdirectories."""
    best: tuple[int, Path] | None = None
    root = Path(root)
    if not root.is_dir():
        return None
    for d in root.iterdir():
        step = _manifest_step(d / MANIFEST) if d.is_dir() and not d.name.startswith(".") else None
        if step is not None and (best is None or step > best[0]):
            best = (step, d)
    return None if best is None else best[1]


def read_shards(
    path: str | os.PathLike, *, model: Model, mesh: Mesh
) -> tuple[dict[str, torch.Tensor], Any, int]:
    """This rank's ``(params, opt_state, step)`` from checkpoint ``path``, resharded for ``mesh``
    (which may have a different world size or sharding than the one that saved it). Every file
    this rank reads is checked against the manifest (sha256, rank, step, shapes); any problem is
    a ``CheckpointError`` (a ``ValueError``) naming ``path``."""
    root = Path(path)
    doc = read_manifest(root)
    try:
        return _load(root, doc, model, mesh)
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, SafetensorError) as e:
        raise CheckpointError(e if str(root) in str(e) else f"checkpoint {root}: {e}") from e


def _load(root: Path, doc: dict, model: Model, mesh: Mesh) -> tuple[dict[str, torch.Tensor], Any, int]:
    layout = make_layout(model, mesh)
    check_units(doc, layout, root)
    saved = doc.get("model", {}).get("config", "")
    if saved and model.config_key and saved != model.config_key:
        raise CheckpointError(
            f"checkpoint {root} was saved from a model of another config ({saved}); this model is "
            f"{model.config_key} (the parameter shapes match, their meaning does not)"
        )
    files = check_files(doc, root)
    handles: dict[int, Any] = {}

    def handle(i: int):
        if i not in handles:
            handles[i] = open_verified(files[i], doc["files"][i], doc)
        return handles[i]

    def read_sharded(key: str) -> dict[str, torch.Tensor]:
        out = {}
        for u in layout.units:
            old = doc["units"][u.name]["shard_size"]
            lo, hi = u.shard_range(mesh.shard_index)
            pieces, end = [], min(hi, u.numel)  # beyond numel is padding: zeros
            pos = lo
            while pos < end:
                i = pos // old
                take = min(end, (i + 1) * old) - pos
                t = handle(i).get_slice(f"{key}/{u.name}")[pos - i * old : pos - i * old + take]
                pieces.append(t)
                pos += take
            dtype = pieces[0].dtype if pieces else _slice_dtype(handle(0), f"{key}/{u.name}")
            shard = torch.zeros(u.shard_size, dtype=dtype)
            if pieces:
                got = torch.cat(pieces)
                shard[: got.numel()] = got
            out[u.name] = shard
        return out

    def read_tensor(key: str) -> torch.Tensor:
        return handle(0).get_tensor(key)

    try:
        params = decode(doc["tree"]["params"], read_sharded, read_tensor)
        opt_state = decode(doc["tree"]["opt_state"], read_sharded, read_tensor)
    finally:
        handles.clear()
    check_shards(params, layout, model.dtype, what=f"params loaded from {root}")
    return params, opt_state, int(doc["step"])


def _slice_dtype(f: Any, key: str) -> torch.dtype:
    return f.get_slice(key)[0:0].dtype
