"""Rank 0's metrics lines and every rank's saving schedule in ``odcfn train``, synchronous or
under bounded staleness (``odcfn.sft.stale_train`` has the why)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from odcfn.sft.evaluate import Evaluator
from odcfn.sft.record import LOSS_FIGURES, moe_figures
from odcfn.sft.stale_train import active
from odcfn.step import stale

__all__ = ["StepLog"]


class StepLog:
    """Rank 0's metrics lines and every rank's saving schedule, step by step.

    Synchronous: each line is written at once and the snapshots follow. Stale: a line waits for
    its step's figures (``reports``), and every rank drains before a step that saves."""

    def __init__(self, cfg: Any, logger: Any, snaps: Any, data: Any = None) -> None:
        self.stale, self.logger, self.snaps = active(cfg.train), logger, snaps
        # [eval] of data's held-out set (odcfn.sft.evaluate): synchronous runs only (config_eval)
        self.evaluator = Evaluator(cfg, data) if data is not None and cfg.eval.every else None
        self.figures = LOSS_FIGURES  # the loss's own figures a line has (not a mixture's expert loads)
        self.pending: dict[int, dict[str, Any]] = {}  # done step -> its line, waiting for its loss
        self.final_loss: float | None = None

    def after_step(self, state: Any, m: Any, rec: dict[str, Any]) -> Any:
        """Log step ``rec["step"]`` (1-based: the updates done) and save if it is due; returns the
        state to go on with (under staleness the drained one after a save)."""
        done = rec["step"]
        if not self.stale:
            self.final_loss = m.loss
            if self.evaluator is not None:  # every rank: the passes are collective
                rec.update(self.evaluator.at(state, done))
            if self.logger is not None:
                self.logger.log(rec)
            self.snaps.after_step(state, done)
            return state
        self.pending[done] = rec
        self._fill(m.extra["reports"])
        if self.snaps.due(done):
            state, late = stale.drain(state)  # every rank: the params of exactly `done` updates
            self._fill(late)
            if self.pending:  # drain reports every step below `done`: a protocol bug otherwise
                missing = sorted(self.pending)
                raise RuntimeError(f"odcfn train: steps {missing} have no figures after the drain")
        self.snaps.after_step(state, done)
        return state

    def _fill(self, reports: Mapping[int, Mapping[str, float]]) -> None:
        """Complete the waiting lines with their figures (report ``k`` is of 0-based step ``k``:
        the line of step ``k + 1``) and write every line whose predecessors are written."""
        for k, fig in reports.items():
            rec = self.pending[k + 1]
            rec["loss"], rec["grad_norm"] = fig["loss"], fig["grad_norm"]
            rec.update({n: float(v) for n, v in fig.items() if n in self.figures})
            rec.update(moe_figures(fig))  # a mixture's loads arrive with the step's figures too
            rec["complete"] = True
        while self.pending:
            first = min(self.pending)
            if not self.pending[first].pop("complete", False):
                break
            rec = self.pending.pop(first)
            self.final_loss = rec["loss"] if math.isfinite(rec["loss"]) else self.final_loss
            if self.logger is not None:
                self.logger.log(rec)
