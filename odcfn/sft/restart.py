"""How ``odcfn train`` survives a crash: where it saves, when, and where a restart resumes.

- Disk tier: ``<out_dir>/checkpoints/step-XXXXXXXX`` every ``checkpoint.every`` steps (and at
  the last step), written in the background when ``checkpoint.async_save`` (the default): the
  step only waits for the host-memory snapshot, then trains on while a thread writes, commits
  and prunes (``odcfn.checkpoint.async_save``).
- Memory tier: with ``checkpoint.memory_every = N``, a snapshot every N steps in /dev/shm
  (``odcfn.checkpoint.memory_tier``), always in the background; it outlives a killed rank on the
  same node, so a restart loses at most N steps and reads at memory speed. On several nodes each
  node keeps its own files and a copy of its neighbour's (``odcfn.checkpoint.node_tier``), so a
  node that lost its memory reads its files back from its neighbour. Removed at the run's
  normal end (after the final disk checkpoint is committed).
- A (re)start resumes from the newest snapshot of either tier whose files all verify; the
  others are skipped with a warning naming the file. Snapshots past it and staging leftovers of
  an interrupted save are removed before the first step.

The data position is the step (minibatches are a pure function of it, ``batch_at``) and the
loop draws no other random numbers, so params, optimizer state and step are the whole state,
with each rank's error-feedback residuals under ``train.push_error_feedback``
(``odcfn.checkpoint.feedback``); the manifest's ``extra`` records the step as ``data_step`` too.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from odcfn.checkpoint import feedback
from odcfn.checkpoint.async_save import AsyncSaver
from odcfn.checkpoint.memory_tier import MemoryTier, remove_stale
from odcfn.checkpoint.node_tier import NodeTier
from odcfn.checkpoint.sharded import read_manifest
from odcfn.checkpoint.state_io import savable
from odcfn.sft.config import SFTConfig
from odcfn.sft.record import prune
from odcfn.sft.resume_check import path_digests, stored_config
from odcfn.step.devices import state_device

__all__ = ["Snapshots", "clear_for_fresh_start", "open_memory_tier", "resume_feedback", "resume_point"]


def open_memory_tier(cfg: SFTConfig, mesh: Any, collectives: Any) -> MemoryTier | NodeTier:
    """The run's memory tier on this rank: one directory on one node, or (``memory_every`` set,
    several nodes) this node's part of the cross-node tier, which is a collective to open."""
    if cfg.checkpoint.memory_every and mesh.num_nodes > 1:
        return NodeTier(cfg.out_dir, mesh, collectives, timeout=cfg.train.timeout)
    return MemoryTier(cfg.out_dir, leader=mesh.rank == 0, mesh=mesh, collectives=collectives)


def resume_point(cfg: SFTConfig, tier: MemoryTier | NodeTier) -> Path | None:
    """The newest verified snapshot of the run in ``cfg.out_dir`` (memory tier first on a tie);
    across nodes a collective that may fetch this node's files from its neighbour."""
    return tier.resume(Path(cfg.checkpoint_dir)) if cfg.checkpoint.resume else None


def resume_feedback(ck: Path, state: Any, anyway: bool, rank: int) -> None:
    """The checkpoint's error-feedback residuals into ``state``'s transport. A checkpoint whose
    residuals do not fit the run (``train.push_error_feedback``, ``push_format``,
    ``quant_block`` or the world changed) is refused, unless ``checkpoint.resume_anyway``: then
    the residuals start at zero, and rank 0 says so."""
    doc = read_manifest(ck)
    why = feedback.mismatch(doc.get("extra", {}).get(feedback.KEY), state)
    if why is not None and anyway:
        if rank == 0:
            print(f"odcfn train: resuming {ck} anyway (checkpoint.resume_anyway): {why}; the error-feedback "
                  "residuals start at zero", file=sys.stderr, flush=True)
        feedback.restore(ck, doc, state, "reset")
        return
    if why is not None:
        raise ValueError(f"odcfn train: cannot resume from {ck}: {why} (checkpoint.resume_anyway, or "
                         "--resume-anyway, resumes with the residuals at zero)")
    feedback.restore(ck, doc, state, "strict", state_device(state))


def clear_for_fresh_start(cfg: SFTConfig, start: int, tier: MemoryTier | NodeTier, rank: int) -> None:
    """Before the first step (no save of this job in flight): drop every snapshot past
    ``start`` (a fresh run's predecessors, the ones that failed verification) and the staging
    leftovers of saves a crash interrupted, in both tiers (rank 0 the disk's and a one-node
    tier's, each node leader its node's part of a cross-node tier)."""
    newer_than = start if cfg.checkpoint.resume else -1
    if rank == 0:
        remove_stale(Path(cfg.checkpoint_dir), newer_than)
    if tier.leader:
        tier.clear(newer_than)


class Snapshots:
    """One rank's saving schedule: ``after_step(state, done)`` after every step, ``finish``
    once at the end (waits for the background writes, surfacing their errors)."""

    def __init__(
        self, cfg: SFTConfig, data_sha: str, mesh: Any, tier: MemoryTier | NodeTier, *,
        base: str | None = None, save_last: bool = False, reference: str | None = None,
    ) -> None:
        """``tier``: the run's memory tier (``open_memory_tier``); ``base``: where a LoRA run's
        frozen base comes from (recorded, verified on resume); ``save_last``: write a disk
        checkpoint after the last step whatever ``every`` says; ``reference``: a preference run's
        reference digest, recorded so that a resume can tell whether its base changed."""
        self.cfg, self.data_sha, self.rank = cfg, data_sha, mesh.rank
        self.base, self.save_last, self.reference = base, save_last, reference
        self.disk, self.memory = AsyncSaver(), AsyncSaver()
        self.tier = tier if cfg.checkpoint.memory_every else None
        # absolute paths and what they hold: a resume from another directory compares contents
        self.config, self.digests = stored_config(cfg), path_digests(cfg)

    def _extra(self, done: int) -> dict[str, Any]:
        extra = {"config": self.config, "data_sha256": self.data_sha, "data_step": done,
                 "path_digests": self.digests}
        if self.reference is not None:
            extra["reference_sha256"] = self.reference  # odcfn.sft.ref_logprobs.REFERENCE_SHA
        return extra

    def _disk_due(self, done: int) -> bool:
        # the last step is always saved (every = 0: only it), so a finished run can be exported
        every = self.cfg.checkpoint.every
        return bool(every and done % every == 0) or done == self.cfg.train.steps

    def _memory_due(self, done: int) -> bool:
        return self.tier is not None and done % self.cfg.checkpoint.memory_every == 0 \
            and done != self.cfg.train.steps

    def due(self, done: int) -> bool:
        """Whether ``after_step(state, done)`` saves (to disk or to the memory tier): under
        bounded staleness the loop drains first, so that what is saved is one consistent version."""
        return self._disk_due(done) or self._memory_due(done)

    def after_step(self, state: Any, done: int) -> None:
        c, last = self.cfg.checkpoint, done == self.cfg.train.steps
        t = self.cfg.train.timeout
        if last:
            self.memory.wait()  # its errors surface before the final save
        if self._disk_due(done):
            path = Path(self.cfg.checkpoint_dir) / f"step-{done:08d}"
            root = Path(self.cfg.checkpoint_dir)

            def pruned(_: Path, done: int = done) -> None:
                if self.rank == 0:
                    prune(root, c.keep, done)

            params, model, extra = savable(state, self._extra(done), self.base)
            self.disk.save(path, params, state.opt_state, state.step, model=model,
                           mesh=state.mesh, extra=extra, timeout=t, after=pruned,
                           feedback=feedback.saved(state))
            if not c.async_save or last:
                self.disk.wait()
        if self._memory_due(done):
            publish = self.tier.publish if self.tier.leader else None
            params, model, extra = savable(state, self._extra(done), self.base)
            self.memory.save(self.tier.path(done), params, state.opt_state, state.step,
                             model=model, mesh=state.mesh, extra=extra, timeout=t, after=publish,
                             writer=self.tier.write, feedback=feedback.saved(state))

    def finish(self, state: Any) -> None:
        """Normal end: every background write committed (or its error raised here); then, once
        every rank got that far (a barrier: a peer may still be reading a manifest), rank 0
        removes the memory tier: the run is complete, its final step is on disk."""
        self.memory.wait()
        self.disk.wait()
        if self.tier is not None:
            state.transport.collectives.barrier()
            if self.tier.leader:  # rank 0, or each node leader its node's
                self.tier.cleanup()
