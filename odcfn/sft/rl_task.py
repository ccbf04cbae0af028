"""``odcfn train`` with ``train.task = "rl"``: iterations of ``odcfn.rl.step`` on one rank.

Each rank builds the run's state as SFT does (``odcfn.sft.setup.setup``: fresh or resumed,
LoRA, MoE, staleness, the policy-gradient loss), its own rollout engine (``[rollout]``) loaded
from that state (``update_weights``: every rank, no file in between), and for a KL term with
full fine-tuning a frozen reference state holding the initial weights (LoRA's reference is its
base, which the loop takes itself). Iteration ``k`` trains on ``data.batch_size`` prompts, a
pure function of ``k`` (``odcfn.sft.rl_data``); rank 0 writes one metrics line per iteration
(verl's names, what ``RLMetrics.extra`` holds) and a progress line.

**Iterations and trainer steps.** One iteration runs ``ppo_epochs`` x ``ppo_mini_batches``
``train_step`` calls (fewer when dynamic sampling drops groups), so ``train.steps`` counts
iterations while the state counts updates. Checkpoints stay keyed by the state's step (what the
checkpoint tiers, pruning and the resume point already order by) and record the iteration as
``data_step``; they fall due by iteration (``checkpoint.every``, the last one). A resume reads
both: the prompts continue at the iteration, and the sampling seeds, which the loop derives
from ``rl.seed`` and the state's step, continue with the step, so a killed and resumed run
draws what the uninterrupted one would have. The engine is loaded from the resumed state, so
its weight version is the resumed step. An iteration that made no update (every group dropped)
changes nothing a checkpoint holds: its save is left out, and a resume from the one before
replays it exactly.

Asynchronous mode: the next iteration's prompts go to ``odcfn.rl.step`` as ``next_prompts``;
a resumed run's first iteration generates synchronously (the generation in flight at the kill
is gone), with weights one version newer than the uninterrupted run's.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from odcfn.sft.config import SFTConfig, model_config
from odcfn.sft.record import Logger
from odcfn.sft.restart import Snapshots
from odcfn.sft.setup import build_model, lr_now, setup
from odcfn.sft.stale_train import active

__all__ = ["RLLogger", "RLSnapshots", "train_rl_rank"]


class RLLogger(Logger):
    """Rank 0's metrics sink for iterations: one JSON line each (``step`` is the iteration,
    1-based; ``trainer_step`` the updates done), and ``odcfn.rl.metrics.progress_line``."""

    def __init__(self, cfg: SFTConfig, start: int) -> None:
        super().__init__(cfg, start)
        self.start = start

    def log(self, rec: dict[str, Any]) -> None:
        from odcfn.rl.metrics import progress_line

        t0 = time.perf_counter()
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        self.trackers.log(rec)  # [log] backends, under the same names as metrics.jsonl
        self.spent += time.perf_counter() - t0
        self.step_time += rec.get("timing_s/step", 0.0)
        self.n += 1
        it, total = rec["step"], self.cfg.train.steps
        if self.cfg.log.progress and (it % self.cfg.log.every == 0 or it == total):
            # progress_line's ETA assumes `it` iterations took `elapsed`: this run did it - start
            elapsed = (time.perf_counter() - self.t0) * it / max(1, it - self.start)
            print(progress_line(it, total, rec, elapsed), flush=True)


class RLSnapshots(Snapshots):
    """The saving schedule by iteration, with checkpoints keyed by the trainer step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.it, self.saved = 0, -1

    def _extra(self, done: int) -> dict[str, Any]:
        return {**super()._extra(done), "data_step": self.it, "trainer_step": done}

    def _disk_due(self, done: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every and self.it % every == 0) or self.it == self.cfg.train.steps

    def _memory_due(self, done: int) -> bool:
        return self.tier is not None and self.it % self.cfg.checkpoint.memory_every == 0 \
            and self.it != self.cfg.train.steps

    def after_iteration(self, state: Any, it: int) -> Any:
        """Save after iteration ``it`` (1-based) if one is due; returns the state to go on with
        (under staleness the drained one)."""
        self.it = it
        if not self.due(state.step) or state.step == self.saved:
            return state
        if active(self.cfg.train):  # every rank: what is saved is exactly state.step updates
            from odcfn.step import stale

            state, _ = stale.drain(state)
        self.after_step(state, state.step)
        self.saved = state.step
        return state


def _resumed_iteration(resumed: str | None) -> int:
    if resumed is None:
        return 0
    from odcfn.checkpoint.sharded import read_manifest

    extra = read_manifest(Path(resumed)).get("extra", {})
    it = extra.get("data_step")
    if not isinstance(it, int) or "trainer_step" not in extra:
        raise ValueError(f"odcfn train: {resumed} is not an RL run's checkpoint (it records no iteration); "
                         "use another out_dir, or --no-resume to start over")
    return it


def _reference(cfg: SFTConfig, state: Any) -> Any:
    """The KL term's reference: None without one, or with LoRA (the loop takes the base); for
    full fine-tuning a frozen state of the initial weights (plain SGD: no optimizer state)."""
    import odcfn

    if not cfg.rl.kl_loss_coef or cfg.lora.rank:
        return None
    initial = build_model(cfg, state.mesh)[2]  # the same initial weights, resumed or not
    return odcfn.TrainState.create(params=initial, model=state.model, optimizer=odcfn.sgd(0.0),
                                   transport=state.transport, config=replace(state.config, donate=False))


def train_rl_rank(cfg: SFTConfig, rank: int, transport: Any, data: Any = None) -> dict[str, Any]:
    """The RL loop for one rank; returns a summary (and the rank's final shards for export)."""
    import odcfn.rl.loop as rl_loop
    from odcfn.checkpoint.kill_point import kill_point
    from odcfn.data.chat import load_tokenizer
    from odcfn.sft.config_rl import make_engine, resolve_reward, rl_config

    run = setup(cfg, rank, transport, data)
    start = _resumed_iteration(run.resumed)
    tok = load_tokenizer(cfg.data.tokenizer)
    config = rl_config(cfg, resolve_reward(cfg), tok.eos_token_id)
    engine = make_engine(cfg, run.state.model, model_config(cfg), tok)
    logger = RLLogger(cfg, start) if rank == 0 else None
    snaps = RLSnapshots(cfg, run.data_sha, run.state.mesh, run.tier, base=cfg.model.hf_path)
    snaps.saved = run.state.step if run.resumed else -1  # the resumed checkpoint is this state
    last: dict[str, float] = {}
    try:
        engine.update_weights(run.state)  # every rank: version = the (resumed) trainer step
        ref = _reference(cfg, run.state)
        steps, d = cfg.train.steps, cfg.data
        for it in range(start, steps):
            prompts = run.data.batch(it, d)
            ahead = config.async_rollouts and it + 1 < steps
            kill_point("step", it + 1, rank)  # tests only (ODCFN_TEST_KILL_AT)
            run.state, m = rl_loop.step(run.state, engine, prompts, config, ref,
                                        next_prompts=run.data.batch(it + 1, d) if ahead else None)
            last = m.extra
            if logger is not None:
                logger.log({"step": it + 1, "epoch": it // run.data.per_epoch, "trainer_step": run.state.step,
                            "lr": lr_now(run, max(0, run.state.step - 1)), **m.extra})
            run.state = snaps.after_iteration(run.state, it + 1)
        snaps.finish(run.state)
    finally:
        engine.close()
        if logger is not None:
            logger.close()
        run.tier.close()
    out: dict[str, Any] = {
        "rank": rank, "start_step": start, "steps": cfg.train.steps, "trainer_step": run.state.step,
        "final_loss": last.get("actor/loss"), "final_reward": last.get("critic/score/mean"),
        "resumed_from": run.resumed, "snapshot_fetch": run.tier.fetched, "data": run.data.report(),
        "reference": None,
    }
    if cfg.checkpoint.export_hf:  # numpy: see train_rank
        out["shards"] = {k: v.detach().numpy().copy() for k, v in run.state.params.items()}
    return out
