"""How ``odcfn train`` survives a crash: where it saves, when, and where a restart resumes.

- Disk tier: ``<out_dir>/checkpoints/step-XXXXXXXX`` every ``checkpoint.every`` steps (and at
  the last step), written in the background when ``checkpoint.async_save`` (the default): the
  step only waits for the host-memory snapshot, then trains on while a thread writes, commits
  and prunes (``odcfn.checkpoint.async_save``).
- Memory tier: with ``checkpoint.memory_every = N``, a snapshot every N steps in /dev/shm
  (``odcfn.checkpoint.memory_tier``), always in the background; it outlives a killed rank on the
  same node, so a restart loses at most N steps and reads at memory speed. Removed at the run's
  normal end (after the final disk checkpoint is committed).
- A (re)start resumes from the newest snapshot of either tier whose files all verify; the
  others are skipped with a warning naming the file. Snapshots past it and staging leftovers of
  an interrupted save are removed before the first step.

The data position is the step (minibatches are a pure function of it, ``batch_at``) and the
loop draws no other random numbers, so params, optimizer state and step are the whole state;
the manifest's ``extra`` records the step as ``data_step`` too.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from odcfn.checkpoint.async_save import AsyncSaver
from odcfn.checkpoint.memory_tier import MemoryTier, check_single_node, newest_verified, remove_stale
from odcfn.checkpoint.state_io import savable
from odcfn.sft.config import SFTConfig
from odcfn.sft.record import prune

__all__ = ["Snapshots", "clear_for_fresh_start", "resume_point"]


def _tier(cfg: SFTConfig) -> MemoryTier:
    return MemoryTier(cfg.out_dir)


def resume_point(cfg: SFTConfig) -> Path | None:
    """The newest verified snapshot of the run in ``cfg.out_dir`` (memory tier first on a tie)."""
    if not cfg.checkpoint.resume:
        return None
    return newest_verified([_tier(cfg).root, Path(cfg.checkpoint_dir)])


def clear_for_fresh_start(cfg: SFTConfig, start: int) -> None:
    """Rank 0, before the first step (no save of this job in flight): drop every snapshot
    past ``start`` (a fresh run's predecessors, the ones that failed verification) and the
    staging leftovers of saves a crash interrupted, in both tiers."""
    newer_than = start if cfg.checkpoint.resume else -1
    remove_stale(Path(cfg.checkpoint_dir), newer_than)
    remove_stale(_tier(cfg).root, newer_than)


class Snapshots:
    """One rank's saving schedule: ``after_step(state, done)`` after every step, ``finish``
    once at the end (waits for the background writes, surfacing their errors)."""

    def __init__(
        self, cfg: SFTConfig, data_sha: str, mesh: Any, *, base: str | None = None, save_last: bool = False
    ) -> None:
        """``base``: where a LoRA run's frozen base comes from (recorded, verified on resume);
        ``save_last``: write a disk checkpoint after the last step whatever ``every`` says."""
        self.cfg, self.data_sha, self.rank = cfg, data_sha, mesh.rank
        self.base, self.save_last = base, save_last
        self.disk, self.memory = AsyncSaver(), AsyncSaver()
        self.tier = _tier(cfg) if cfg.checkpoint.memory_every else None
        if self.tier is not None:
            check_single_node(mesh.world_size, mesh.ranks_per_node if mesh.sharding == "hybrid"
                              else int(os.environ.get("LOCAL_WORLD_SIZE", mesh.world_size)))
        self.config = asdict(cfg)

    def _extra(self, done: int) -> dict[str, Any]:
        return {"config": self.config, "data_sha256": self.data_sha, "data_step": done}

    def after_step(self, state: Any, done: int) -> None:
        c, last = self.cfg.checkpoint, done == self.cfg.train.steps
        t = self.cfg.train.timeout
        if last:
            self.memory.wait()  # its errors surface before the final save
        if (c.every and (done % c.every == 0 or last)) or (last and self.save_last):
            path = Path(self.cfg.checkpoint_dir) / f"step-{done:08d}"
            root = Path(self.cfg.checkpoint_dir)

            def pruned(_: Path, done: int = done) -> None:
                if self.rank == 0:
                    prune(root, c.keep, done)

            params, model, extra = savable(state, self._extra(done), self.base)
            self.disk.save(path, params, state.opt_state, state.step, model=model,
                           mesh=state.mesh, extra=extra, timeout=t, after=pruned)
            if not c.async_save or last:
                self.disk.wait()
        if self.tier is not None and done % c.memory_every == 0 and not last:
            publish = self.tier.publish if self.rank == 0 else None
            params, model, extra = savable(state, self._extra(done), self.base)
            self.memory.save(self.tier.path(done), params, state.opt_state, state.step,
                             model=model, mesh=state.mesh, extra=extra, timeout=t, after=publish)

    def finish(self, state: Any) -> None:
        """Normal end: every background write committed (or its error raised here); then, once
        every rank got that far (a barrier: a peer may still be reading a manifest), rank 0
        removes the memory tier: the run is complete, its final step is on disk."""
        self.memory.wait()
        self.disk.wait()
        if self.tier is not None:
            state.transport.collectives.barrier()
            if self.rank == 0:
                self.tier.cleanup()
