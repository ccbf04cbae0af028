"""``odcfn train --config run.toml``: a supervised fine-tuning loop on W local ranks.

The launcher locks ``out_dir`` (``odcfn.sft.lock``: one run per directory) and reads and checks
the whole dataset once before any rank starts (``odcfn.sft.prepare``: problems are named by
``file:line`` up front). Each rank holds the same samples, computes the same minibatch for every step
(``odcfn.data.records.batch_at``), runs ``train_step`` (ODC or collective), and rank 0 writes one JSON
line of metrics per step (``<out_dir>/metrics.jsonl``; TensorBoard too when installed and
asked for). Checkpoints go to ``<out_dir>/checkpoints/step-XXXXXXXX`` every ``every`` steps;
a rerun resumes from the newest committed one, and because minibatches are a pure function of
the step, the resumed run continues exactly where the interrupted one would have (metrics lines
past the resumed step are dropped and rewritten, so the log reads like one uninterrupted run).

The config (TOML or JSON; every key optional except ``data.path`` and ``train.steps``) is
listed, key by key with allowed values and defaults, in docs/config.md, generated from
``odcfn.sft.keys`` and ``odcfn.sft.config`` (one source of truth: a test keeps them equal).
``train.task = "dpo"`` trains on preference pairs (``odcfn.sft.preference``) with a reference
pass before the first step (``odcfn.sft.ref_logprobs``).

``odcfn train --init DIR`` writes a runnable example (``DIR/run.toml`` + a generated
``DIR/train.jsonl``) to start from. The config dataclasses live in ``odcfn.sft.config``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any

from odcfn.sft.config import SFTConfig, config_from_dict, load_config
from odcfn.sft.example import write_example
from odcfn.sft.prepare import PreparedData, prepare_data
from odcfn.sft.record import Logger, already_done, data_summary, step_record
from odcfn.sft.restart import Snapshots
from odcfn.sft.setup import build_model, lr_now, setup, with_lora
from odcfn.sft.stale_train import check_model
from odcfn.sft.steplog import StepLog

__all__ = [
    "SFTConfig", "add_arguments", "config_from_dict", "load_config", "main", "process_worker", "run",
    "train_rank",
]


# --- one rank ----------------------------------------------------------------------------------


def train_rank(cfg: SFTConfig, rank: int, transport, data: PreparedData | None = None) -> dict[str, Any]:
    """The SFT loop for one rank; returns a summary (and rank's final shards for export).
    ``data``: the launcher's checked dataset (else this rank reads and checks it)."""
    if cfg.train.task == "rl":  # iterations of rollouts and updates: odcfn.sft.rl_task
        from odcfn.sft.rl_task import train_rl_rank

        return train_rl_rank(cfg, rank, transport, data)
    import odcfn
    from odcfn.checkpoint.kill_point import kill_point

    run = setup(cfg, rank, transport, data)
    logger = Logger(cfg, run.start) if rank == 0 else None
    # disk and memory tiers (sft/restart.py); under torchrun the HF export is written from the
    # last step's checkpoint, so that one is saved whatever the schedule
    snaps = Snapshots(cfg, run.data_sha, run.state.mesh, run.tier, base=cfg.model.hf_path,
                      save_last=bool(cfg.checkpoint.export_hf) and _under_torchrun(),
                      reference=(run.reference or {}).get("sha256"))
    log = StepLog(cfg, logger, snaps, run.data)  # + [eval]; under staleness: late losses, drains
    try:
        for step in range(run.start, cfg.train.steps):
            if step in run.data.skip_steps:  # no loss tokens: a step without an update
                run.state = run.state.replace(step=step + 1)
                snaps.after_step(run.state, step + 1)
                continue
            batch = run.data.batch(step, cfg.data)  # a pure function of the step (pairs too)
            kill_point("step", step + 1, rank)  # tests only (ODCFN_TEST_KILL_AT)
            run.state, m = odcfn.train_step(run.state, batch)
            rec = step_record(m, step + 1, step // run.data.per_epoch, lr_now(run, step),
                              run.state.router_bias)
            run.state = log.after_step(run.state, m, rec)
        snaps.finish(run.state)
    finally:
        if logger is not None:
            logger.close()
        run.tier.close()
    out: dict[str, Any] = {
        "rank": rank,
        "start_step": run.start,
        "steps": cfg.train.steps,
        "final_loss": log.final_loss,
        "resumed_from": run.resumed,
        "snapshot_fetch": run.tier.fetched,  # files read back from other nodes
        "data": run.data.report(),
        "reference": run.reference,
    }
    if cfg.checkpoint.export_hf:
        # numpy: torch would send tensors to the launcher as shared-memory handles that die
        # with this rank's process
        out["shards"] = {k: v.detach().numpy().copy() for k, v in run.state.params.items()}
        bias = run.state.router_bias  # not exportable: named by the export (note_router_bias)
        out["router_bias"] = None if bias is None else bias.detach().cpu().double().tolist()
    return out


def process_worker(cfg: SFTConfig) -> dict[str, Any]:
    """Entry point of one rank under ``odcfn.launch`` or ``torchrun``."""
    import torch

    from odcfn.sft.lock import RankLock
    from odcfn.sft.multinode import job_mesh, job_transport

    torch.set_num_threads(1)
    mesh = job_mesh()  # one node: full sharding on /dev/shm; several: hybrid (docs/multinode.md)
    if mesh.world_size != cfg.train.world_size:
        cfg = replace(cfg, train=replace(cfg.train, world_size=mesh.world_size))
    with RankLock(cfg.out_dir, mesh.rank), job_transport(mesh, cfg.train.timeout) as tr:
        return train_rank(cfg, mesh.rank, tr)  # RankLock: out_dir stays in use while this rank lives


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(cfg: SFTConfig) -> list[dict[str, Any]]:
    """Run the whole job on ``cfg.train.world_size`` local ranks; per-rank summaries. The
    output directory is locked for the run (``odcfn.sft.lock``); the data is read and checked
    once, before any rank starts (``odcfn.sft.prepare``)."""
    from odcfn.sft.lock import RunLock

    if _under_torchrun() and os.environ["RANK"] != "0":  # rank 0 holds the lock for the job
        return [process_worker(cfg)]
    with RunLock(cfg.out_dir):
        return _run_locked(cfg)


def _run_locked(cfg: SFTConfig) -> list[dict[str, Any]]:
    import odcfn
    from odcfn.sft.export import export_checkpoint, export_params

    W = cfg.train.world_size
    if _under_torchrun():  # one rank of torchrun: no launcher to collect the weights
        results = [process_worker(cfg)]
        if cfg.checkpoint.export_hf:  # this rank saved the last step's checkpoint with the others
            export_checkpoint(cfg.checkpoint_dir / f"step-{cfg.train.steps:08d}", cfg.checkpoint.export_hf)
        return results
    qcfg, model, _ = build_model(cfg)
    model = with_lora(cfg, model, None, None)[0]
    check_model(cfg, model)  # a config built without load_config: named before any rank starts
    data = prepare_data(cfg, qcfg.vocab_size)  # every problem named before a rank starts
    from odcfn.sft.announce import run_lines

    for line in run_lines(cfg, qcfg, model, data):  # what will run, before it runs
        print(f"odcfn train: {line}", flush=True)
    if cfg.train.backend == "processes":
        from odcfn.launch import launch

        results = launch(
            process_worker, W, args=(cfg,), timeout=cfg.train.timeout, max_restarts=cfg.train.max_restarts
        )
    else:
        results = odcfn.run_local(
            lambda rank, tr: train_rank(cfg, rank, tr, data), W, timeout=cfg.train.timeout
        )
    if cfg.checkpoint.export_hf:
        import torch

        shards = [{k: torch.from_numpy(v) for k, v in r.pop("shards").items()} for r in results]
        full = odcfn.unshard(shards, model, odcfn.Mesh(W))
        full = odcfn.lora.merge(model, full) if cfg.lora.rank else full
        export_params(cfg.checkpoint.export_hf, full, qcfg, cfg, router_bias=results[0].get("router_bias"))
    return results


# --- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config, .toml or .json")
    parser.add_argument(
        "--init", metavar="DIR", help="write an example run.toml + train.jsonl into DIR and exit"
    )
    parser.add_argument("--steps", type=int, help="optimizer steps (minibatches) of the whole run; overrides "
                        "train.steps (on resume: a decaying schedule is stretched to the new length)")
    parser.add_argument("--world-size", type=int, help="local ranks; overrides train.world_size")
    parser.add_argument("--out-dir", help="override out_dir")
    parser.add_argument("--no-resume", action="store_true",
                        help="start from scratch: delete out_dir's checkpoints and restart its metrics log")
    parser.add_argument("--resume-anyway", action="store_true", help="resume though hyperparameters or "
                        "data changed (each change is printed); another model is refused still")
    parser.add_argument("--recompute-reference", action="store_true", help="train.task = \"dpo\": resume "
                        "although the reference weights at model.hf_path changed since the run started "
                        "(the reference log-probs are recomputed from them; refused otherwise)")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    parser.add_argument("--force", action="store_true", help="--init: overwrite DIR's run.toml/train.jsonl")


def main(args: argparse.Namespace) -> int:
    if args.init:
        path = write_example(args.init, force=args.force)
        print(
            f"odcfn train: wrote {path} and {path.parent / 'train.jsonl'}; run: odcfn train --config {path}"
        )
        return 0
    if not args.config:
        print("odcfn train: give --config FILE (or --init DIR for an example)", file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    train, ckpt, log = cfg.train, cfg.checkpoint, cfg.log
    if args.steps is not None:
        train = replace(train, steps=args.steps)
    if args.world_size is not None:
        train = replace(train, world_size=args.world_size)
    if args.no_resume or args.resume_anyway:
        ckpt = replace(ckpt, resume=ckpt.resume and not args.no_resume,
                       resume_anyway=ckpt.resume_anyway or args.resume_anyway)
    if getattr(args, "recompute_reference", False):
        ckpt = replace(ckpt, recompute_reference=True)
    if args.quiet:
        log = replace(log, progress=False)
    cfg = replace(
        cfg, train=train, checkpoint=ckpt, log=log, out_dir=args.out_dir if args.out_dir else cfg.out_dir
    )
    t0 = time.perf_counter()
    results = run(cfg)
    head = results[0]
    if head["rank"] != 0:  # under torchrun every rank runs main: one summary is enough
        return 0
    if head["start_step"] >= head["steps"]:  # exit 0: what was asked for exists (see already_done)
        print(already_done(head, cfg), flush=True)
        return 0
    where = f", resumed from {head['resumed_from']}" if head["resumed_from"] else ""
    print(
        f"odcfn train: steps {head['start_step']}..{head['steps']} on {cfg.train.world_size} rank(s) "
        f"({cfg.train.comm}+{cfg.train.balance}){where}; final loss {head['final_loss']}; "
        f"metrics {cfg.metrics_path}; {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    for line in data_summary(head.get("data", {}), cfg):
        print(f"odcfn train: {line}", flush=True)
    if cfg.checkpoint.export_hf:
        print(f"odcfn train: Hugging Face model written to {cfg.checkpoint.export_hf}", flush=True)
    return 0
