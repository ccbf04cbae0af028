"""What ``odcfn train`` records: rank 0's per-step metrics line (JSONL, optional TensorBoard,
a progress line) and the pruning of old checkpoints."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from odcfn.checkpoint.commit import CheckpointError, list_quietly
from odcfn.checkpoint.sharded import read_manifest
from odcfn.sft.config import SFTConfig
from odcfn.step.state import StepMetrics
from odcfn.trace import COMPUTE_KINDS

__all__ = ["LOSS_FIGURES", "Logger", "already_done", "data_summary", "moe_figures", "prune", "step_record"]

LOSS_FIGURES = frozenset(("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                           "logps/chosen", "logps/rejected", "nll_loss"))
# bounded staleness (train.staleness): how far behind this rank read, and how long it waited
_STALE_FIGURES = ("staleness_max", "staleness_mean", "version_wait_s")


def moe_figures(extra: Any, router_bias: Any = None) -> dict[str, float]:
    """A mixture's figures of a step, as JSON numbers: each sparse layer's expert load as max over
    mean of its tokens per expert (``moe/load_max_over_mean/<unit>``, 1.0 is even), the aux loss
    (``moe/aux_loss``, part of ``loss``; when on) and the range of the aux-loss-free balancing
    bias after the step (``moe/router_bias_min`` / ``_max``; with ``train.expert_bias_rate``)."""
    out = {k: float(v) for k, v in extra.items()
           if k.startswith("moe/load_max_over_mean/") or k == "moe/aux_loss"}
    if router_bias is not None:
        out["moe/router_bias_min"] = float(router_bias.min())
        out["moe/router_bias_max"] = float(router_bias.max())
    return out


def step_record(m: StepMetrics, step: int, epoch: int, lr: float, router_bias: Any = None) -> dict[str, Any]:
    """One metrics line: ``step`` is 1-based (the number of updates done); ``router_bias``: the
    state's after the step (a mixture with aux-loss-free balancing)."""
    busy = sum(e.duration for e in m.events if e.kind in COMPUTE_KINDS)
    return {
        "step": step,
        "epoch": epoch,
        "loss": m.loss,
        "grad_norm": m.grad_norm,
        "lr": lr,
        "samples": m.num_samples,
        "tokens": m.num_tokens,
        "loss_tokens": m.num_loss_tokens,
        "step_time": m.step_time,
        "samples_per_s": m.samples_per_s,
        "tokens_per_s": m.tokens_per_s,
        "microbatches": len(m.plan.microbatches),
        "syncs": m.counters.syncs,
        "gather_bytes": m.counters.gather_bytes,
        "collective_bytes": m.counters.collective_bytes,
        # rank 0's forward+backward share of its step (1 - its own bubble)
        "busy_fraction": busy / m.step_time if m.step_time > 0 else 0.0,
        "time": time.time(),
        # a preference loss's figures as TRL names them (rewards/..., logps/..., nll_loss)
        **{k: float(v) for k, v in m.extra.items() if k in LOSS_FIGURES},
        **{k: m.extra[k] for k in _STALE_FIGURES if k in m.extra},
        **moe_figures(m.extra, router_bias),  # a mixture of experts: its loads, aux loss and bias
    }


class Logger:
    """Rank 0's metrics sink: JSONL every step (appended across resumes), the ``[log] backends``
    (``odcfn.sft.trackers``), a progress line on stdout every ``log.every`` steps."""

    def __init__(self, cfg: SFTConfig, start: int) -> None:
        self.cfg = cfg
        self.t0, self.n = time.perf_counter(), 0
        path = cfg.metrics_path
        path.parent.mkdir(parents=True, exist_ok=True)
        # keep the history up to the step we resume from: lines logged after the last
        # checkpoint by an interrupted run (or by a run we do not resume) are rerun, not repeated
        kept = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= start:
                        kept.append(line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue
        path.write_text("".join(kept))
        self.file = open(path, "a")
        from odcfn.sft.trackers import Trackers

        self.trackers = Trackers(cfg, start)  # [log] backends: TensorBoard, wandb, trackio, MLflow
        self.spent, self.step_time = 0.0, 0.0  # the training thread's logging time, and the steps'

    def log(self, rec: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        self.trackers.log(rec)
        self.spent += time.perf_counter() - t0
        self.step_time += rec.get("step_time", 0.0)
        self.n += 1
        total = self.cfg.train.steps
        if self.cfg.log.progress and (rec["step"] % self.cfg.log.every == 0 or rec["step"] == total):
            eta = (time.perf_counter() - self.t0) / self.n * (total - rec["step"])
            print(
                f"step {rec['step']:>6}/{total}  loss {rec['loss']:.4f}  "
                f"grad_norm {rec['grad_norm']:.3f}  lr {rec['lr']:.2e}  "
                + (f"acc {rec['rewards/accuracies']:.2f}  " if "rewards/accuracies" in rec else "")
                + (f"eval/loss {rec['eval/loss']:.4f}  " if "eval/loss" in rec else "")
                + (f"eval/acc {rec['eval/rewards/accuracies']:.2f}  " if "eval/rewards/accuracies" in rec
                   else "") +
                f"{rec['tokens_per_s']:.0f} tok/s  {rec['step_time']:.2f}s/step  eta {eta:.0f}s",
                flush=True,
            )

    def close(self) -> None:
        self.file.close()
        self.trackers.close()
        if self.trackers.names and self.n:  # what logging cost, against the steps it logged
            t, sec = self.step_time, self.trackers.seconds
            print(f"odcfn train: logging ({', '.join(['jsonl', *self.trackers.names])}): "
                  f"{1e3 * self.spent / self.n:.3f} ms per step on the training thread "
                  f"({100 * self.spent / t if t else 0:.3f}% of step time); backends "
                  f"{1e3 * sec['backends'] / self.n:.2f} ms CPU per step in the background ("
                  + ", ".join(f"{k} {1e3 * sec.get(k, 0.0) / self.n:.2f}" for k in self.trackers.names)
                  + f"), opened in "
                  f"{sec['open']:.1f}s, closed in {sec['close']:.1f}s", file=sys.stderr, flush=True)


def prune(root: Path, keep: int | None, current: int) -> None:
    """Keep the ``keep`` newest committed checkpoints up to ``current``. Only older ones go:
    a peer may still be polling for the manifest of ``current``."""
    if not keep:
        return
    done = []
    for d in list_quietly(root, "step-*"):
        try:  # listed, then gone (a restart's cleanup): nothing to prune
            step = int(read_manifest(d)["step"])
        except (OSError, CheckpointError, KeyError, TypeError, ValueError):
            continue
        if step < current:
            done.append((step, d))
    for _, d in sorted(done)[: max(0, len(done) - (keep - 1))]:
        shutil.rmtree(d, ignore_errors=True)


def data_summary(rep: dict[str, Any], cfg: SFTConfig) -> list[str]:
    """What the run did to its data (``PreparedData.report``), one line per kind."""
    from odcfn.sft.prepare import length_limit

    out = []
    limit, key = length_limit(cfg)
    for kind in ("truncated", "dropped"):
        lines = rep.get(kind) or []
        if lines:
            more = f" and {len(lines) - 3} more" if len(lines) > 3 else ""
            shown = ", ".join(lines[:3])
            # a pair is too long by a member (data.max_length) or by its sum (the microbatch cap)
            what = "pair(s) too long for one microbatch or data.max_length" if "pairs" in rep else (
                "prompt(s) too long for the engine or a microbatch" if "prompts" in rep else
                f"sample(s) longer than {key}={limit}")
            out.append(f"{kind} {len(lines)} {what}: {shown}{more}")
    skipped = rep.get("skipped_steps") or []
    if skipped:
        out.append(f"skipped {len(skipped)} step(s) whose minibatch has no loss tokens: {skipped[:10]}")
    return out


def already_done(head: dict[str, Any], cfg: SFTConfig) -> str:
    """What a rerun says when its checkpoint is at or past ``train.steps`` (rank 0's summary
    ``head``): nothing was trained, and how to train on.

    The exit status stays 0: the state the command asks for (a run trained to ``train.steps``
    or beyond) exists, so a rerun is idempotent and ``odcfn train && odcfn export`` still works;
    the message, not the status, says that no step ran."""
    start, steps = head["start_step"], head["steps"]
    where = "past" if start > steps else "at"
    return (f"odcfn train: nothing to train: {cfg.out_dir} is already at step {start} "
            f"({head['resumed_from']}), {where} the requested train.steps = {steps}; "
            f"--steps N with N > {start} trains further, --no-resume starts over")
