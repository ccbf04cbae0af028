"""The error-feedback residuals of quantized pushes in a checkpoint.

With ``StepConfig(push_format=..., push_error_feedback=True)`` each rank carries the rounding
error of its last push of every unit into its next one (``odcfn.kernels.quant.WireState``, held
by the transport). That residual is training state: a run resumed without it differs from the
uninterrupted run. So a checkpoint of such a state holds it, per rank:

- each rank's file holds its residuals as ``feedback/<unit>`` (fp32, the unit's padded full
  gradient: what the rank pushes), with the file's metadata ``push_feedback``; the file's
  sha256 in the manifest covers them, and every tier (disk, memory, across nodes) writes,
  verifies and commits them with the rest of the file, atomically;
- the manifest's ``extra["push_feedback"]`` records the push format, block and mesh they
  belong to.

The residuals are per rank, not per shard, so they load only into the same world size and
sharding, push format and block. On load (``odcfn.load(..., feedback=)``):

- ``"strict"`` (the default): the checkpoint and the state must agree. Residuals into a state
  without error feedback, a state with error feedback from a checkpoint without them, or
  another push format, block or world size: a ``ValueError`` naming what differs, before the
  state changes;
- ``"reset"``: the state's residuals start at zero whatever the checkpoint holds (an explicit
  choice: e.g. switching error feedback on for a run that had it off).

Only full sharding (every rank writes a file) can hold them: under hybrid sharding across
nodes only node 0's ranks write, so saving such a state is refused (a ``ValueError``, alike on
every rank, before any file is written).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from odcfn.checkpoint.verify import check_files, open_verified
from odcfn.sharding import make_layout

__all__ = [
    "KEY", "MODES", "PREFIX", "Feedback", "check_mode", "check_savable", "mismatch", "restore", "saved",
    "with_feedback",
]

KEY = "push_feedback"  # the manifest's extra entry, and the rank file's metadata key
PREFIX = "feedback/"  # the residuals' names in a rank file
MODES = ("strict", "reset")


class Feedback(NamedTuple):
    """A rank's residuals for its file: what the manifest records about them (``extra[KEY]``)
    and the tensors, unit -> fp32 (``sharded.write_rank_file`` writes them)."""

    record: dict
    residuals: Mapping[str, torch.Tensor]


def with_feedback(extra: Mapping[str, Any] | None, feedback: Feedback | None) -> dict:
    """A manifest's ``extra`` with the residuals' record, if any."""
    extra = dict(extra or {})
    if feedback is not None:
        extra[KEY] = dict(feedback.record)
    return extra


def _wire_state(state: Any, what: str) -> Any:
    get = getattr(state.transport, "wire_state", None)
    ws = get() if callable(get) else None
    if ws is None:
        raise ValueError(
            f"{what}: StepConfig.push_error_feedback=True but {type(state.transport).__name__} holds "
            "no wire state (a transport without wire formats cannot carry residuals)"
        )
    return ws


def check_savable(cfg: Any, mesh: Any, what: str = "odcfn.save") -> None:
    """Refuse error feedback where a checkpoint cannot hold every rank's residuals: hybrid
    sharding across nodes (only node 0's ranks write files). Alike on every rank."""
    if cfg.push_error_feedback and mesh.shard_count != mesh.world_size:
        raise ValueError(
            f"{what}: StepConfig.push_error_feedback=True under hybrid sharding across nodes "
            f"(world {mesh.world_size}, shard groups of {mesh.shard_count}): each rank's residuals "
            "are its own, but only node 0's ranks write checkpoint files (use full sharding, or "
            "push_error_feedback=False)"
        )


def saved(state: Any) -> Feedback | None:
    """What a checkpoint of ``state`` holds of its residuals (None: no error feedback): the
    manifest's record and this rank's residuals, unit -> fp32, only the units pushed so far (a
    residual made in another push format or block belongs to it, not to this state). Refuses a
    state whose ranks do not all write a file (hybrid sharding across nodes), alike on every rank."""
    cfg, mesh = state.config, state.mesh
    if not cfg.push_error_feedback:
        return None
    check_savable(cfg, mesh)
    record = {"push_format": cfg.push_format, "quant_block": cfg.quant_block,
              "world_size": mesh.world_size, "sharding": mesh.sharding}
    ws = _wire_state(state, "odcfn.save")
    if ws.key != (cfg.push_format, cfg.quant_block):
        return Feedback(record, {})
    return Feedback(record, {u: t.detach() for u, t in sorted(ws.residual.items())})


def check_mode(mode: Any, what: str = "odcfn.load") -> None:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"{what}: feedback must be one of {list(MODES)}, got {mode!r}")


def mismatch(saved: Any, state: Any) -> str | None:
    """Why the residuals a checkpoint records (its manifest's ``extra[KEY]``, or None) cannot
    continue in ``state`` (None: they can, or neither has any)."""
    cfg = state.config
    want = cfg.push_error_feedback
    if saved is None:
        if not want:
            return None
        return ("it holds no error-feedback residuals, but the state has "
                "StepConfig.push_error_feedback=True (its pushes would restart from a zero residual)")
    if not isinstance(saved, dict):
        return f"its {KEY!r} record is malformed: {saved!r}"
    if not want:
        return (f"it holds error-feedback residuals (push_format={saved.get('push_format')!r}), but the "
                "state has StepConfig.push_error_feedback=False (they would be dropped)")
    mesh = state.mesh
    for key, have in (("push_format", cfg.push_format), ("quant_block", cfg.quant_block),
                      ("world_size", mesh.world_size), ("sharding", mesh.sharding)):
        if saved.get(key) != have:
            where = "Mesh" if key in ("world_size", "sharding") else "StepConfig"
            return (f"its error-feedback residuals were saved with {key}={saved.get(key)!r}, the state has "
                    f"{where}.{key}={have!r} (each rank's residual belongs to its rank and format)")
    return None


def restore(
    path: str | os.PathLike, doc: dict, state: Any, mode: str = "strict", device: Any = None
) -> None:
    """Put the residuals of checkpoint ``path`` (``doc``: its manifest) into ``state``'s
    transport (``mode``: see the module docstring); ``device``: where the pushes run (default
    the CPU). Every check comes before the transport changes; the rank file is verified
    against the manifest first."""
    check_mode(mode)
    root = Path(path)
    saved = doc.get("extra", {}).get(KEY)
    if mode == "reset":
        if state.config.push_error_feedback:
            ws = _wire_state(state, "odcfn.load")
            ws.residual, ws.key = {}, ()
        return
    why = mismatch(saved, state)
    if why is not None:
        raise ValueError(f"odcfn.load: checkpoint {root}: {why}; pass feedback='reset' to start the "
                         "residuals at zero instead")
    if saved is None:
        return
    ws = _wire_state(state, "odcfn.load")
    got = _read(root, doc, state)
    ws.residual = {u: t.to(device or "cpu", torch.float32) for u, t in got.items()}
    ws.key = (state.config.push_format, state.config.quant_block)


def _read(root: Path, doc: dict, state: Any) -> dict[str, torch.Tensor]:
    """This rank's residuals from its own file (sha256, step and rank checked first)."""
    rank = state.mesh.rank
    try:
        files = check_files(doc, root)
        h = open_verified(files[rank], doc["files"][rank], doc)
    except (ValueError, KeyError, IndexError, TypeError, OSError) as e:
        raise ValueError(f"odcfn.load: checkpoint {root}: the residuals of rank {rank}: {e}") from e
    meta = h.metadata() or {}
    if meta.get(KEY) is None:
        raise ValueError(f"odcfn.load: checkpoint {root}: {files[rank].name} holds no error-feedback "
                         "residuals though the manifest records them")
    if json.loads(meta[KEY]) != doc["extra"][KEY]:
        raise ValueError(f"odcfn.load: checkpoint {root}: {files[rank].name} records residuals of "
                         f"{meta[KEY]}, the manifest {doc['extra'][KEY]}")
    layout = make_layout(state.model, state.mesh)
    out = {}
    for key in h.keys():
        if not key.startswith(PREFIX):
            continue
        unit = key[len(PREFIX):]
        if unit not in layout.names or layout[unit].frozen:
            raise ValueError(f"odcfn.load: checkpoint {root}: {files[rank].name} holds a residual of "
                             f"{unit!r}, which is not a trained unit of this model")
        t = h.get_tensor(key)
        want = layout[unit].padded_numel
        if t.shape != (want,) or t.dtype != torch.float32:
            raise ValueError(f"odcfn.load: checkpoint {root}: the residual of {unit!r} in {files[rank].name} "
                             f"is {t.dtype} {tuple(t.shape)}, expected float32 ({want},)")
        out[unit] = t
    return out
