"""``odcfn train --config run.toml``: a supervised fine-tuning loop on W local ranks.

Each rank reads the same token file, computes the same minibatch for every step
(``odcfn.data.records.batch_at``), runs ``train_step`` (ODC or collective), and rank 0 writes one JSON
line of metrics per step (``<out_dir>/metrics.jsonl``; TensorBoard too when installed and
asked for). Checkpoints go to ``<out_dir>/checkpoints/step-XXXXXXXX`` every ``every`` steps;
a rerun resumes from the newest committed one, and because minibatches are a pure function of
the step, the resumed run continues exactly where the interrupted one would have (metrics lines
past the resumed step are dropped and rewritten, so the log reads like one uninterrupted run).

Config (TOML or JSON), every key optional except ``data.path`` and ``train.steps``::

    out_dir = "runs/sft"                  # relative paths are relative to the config file
    [model]       # either a local HF checkpoint ...
    hf_path = "path/to/qwen2"             # ... or a fresh model:
    vocab_size = 256, d_model = 64, n_layers = 2, n_heads = 4, n_kv_heads = 2, d_ff = 128, seed = 0
    head_dim, qk_norm, o_bias, tie_embeddings, qkv_bias, rope_theta   # QwenConfig's other fields
    [data]
    path = "train.jsonl", batch_size = 8, seed = 0, shuffle = true, max_length = 4096
    tokenizer = "path/to/tokenizer"       # optional: path holds {"messages": [...]} chat lines
    cache_dir = "path"                    # tokenized chat shards (default: <path>.odcfn-cache)
    [train]
    steps = 100, lr = 1e-3, warmup_steps = 0, schedule = "constant" | "cosine",
    optimizer = "adamw" | "sgd", weight_decay = 0.0, max_grad_norm = 1.0,
    weight_decay_mask = "no_norms_biases" | "no_norms_biases_embeddings" | "all",
    comm = "odc" | "collective", balance = "round_robin", max_tokens_per_microbatch = 4096,
    compute_dtype = "float32" | "bfloat16", world_size = 2, backend = "threads" | "processes"
    [checkpoint]
    every = 50, keep = 3, export_hf = "path"   # HF copy of the final weights
    resume = true          # false (or --no-resume): start over, deleting out_dir's checkpoints
    resume_anyway = false  # resuming with another config/dataset is refused unless true
    [log]
    every = 1, tensorboard = false        # progress line every N steps (JSONL gets every step)

``odcfn train --init DIR`` writes a runnable example (``DIR/run.toml`` + a generated
``DIR/train.jsonl``) to start from. The config dataclasses live in ``odcfn.sft.config``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from odcfn.sft.config import (
    SFTConfig,
    TrainSection,
    check_resume,
    config_from_dict,
    load_config,
    write_example,
)
from odcfn.sft.record import Logger, prune, step_record

__all__ = ["SFTConfig", "add_arguments", "config_from_dict", "load_config", "main", "run", "train_rank"]


# --- one rank ----------------------------------------------------------------------------------


def _lr_fn(t: TrainSection):
    def lr(step: int) -> float:  # step is 1-based (the optimizer's count after this update)
        if t.warmup_steps and step <= t.warmup_steps:
            return t.lr * step / t.warmup_steps
        if t.schedule == "cosine":
            span = max(1, t.steps - t.warmup_steps)
            return 0.5 * t.lr * (1 + math.cos(math.pi * min(1.0, (step - t.warmup_steps) / span)))
        return t.lr

    return lr


def _build_model(cfg: SFTConfig, mesh=None):
    """``(QwenConfig, Model, this rank's initial shards or None)``: shards only when ``mesh`` is
    given. An HF checkpoint is read shard-wise: no rank ever holds the full weights."""
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.sharding import shard

    m = cfg.model
    if m.hf_path:
        from odcfn.models.hf import config_from_hf, shard_from_hf

        if mesh is None:
            qcfg = config_from_hf(json.loads((Path(m.hf_path) / "config.json").read_text()))
            return qcfg, qwen_model(qcfg), None
        qcfg, shards = shard_from_hf(m.hf_path, mesh)
        return qcfg, qwen_model(qcfg), shards
    # [model] names QwenConfig's fields (plus hf_path and seed): pass over the ones it has
    qcfg = QwenConfig(**{f.name: getattr(m, f.name) for f in fields(QwenConfig) if hasattr(m, f.name)})
    if cfg.checkpoint.export_hf:  # refuse an unexportable model before training, not after
        from odcfn.models.hf_config import model_type

        model_type(qcfg)
    model = qwen_model(qcfg)
    return qcfg, model, None if mesh is None else shard(init_params(qcfg, seed=m.seed), model, mesh)


def _with_lora(cfg: SFTConfig, model, shards, mesh):
    """``[lora]``: the LoRA model over the base and this rank's shards of it (None stays None)."""
    if not cfg.lora.rank:
        return model, shards
    from odcfn import lora

    c = cfg.lora
    kw = dict(rank=c.rank, alpha=c.alpha, targets=tuple(c.targets), use_rslora=c.use_rslora, seed=c.seed)
    if shards is None:
        return lora.apply(model, {}, **kw)[0], None
    return lora.apply_to_shards(model, shards, mesh, **kw)


@dataclass
class _Run:
    """What one rank's loop runs with, built once by ``_setup``."""

    state: Any  # odcfn.TrainState
    data: Any  # odcfn.data.dataset.TokenDataset
    per_epoch: int
    lr: Any  # step -> learning rate
    data_sha: str
    start: int
    resumed: str | None


def _setup(cfg: SFTConfig, rank: int, transport) -> _Run:
    """The rank's state (fresh, or resumed from the newest verified checkpoint), its data and
    schedule; refuses a resume whose config or data differ from the checkpoint's."""
    import torch

    import odcfn
    from odcfn.checkpoint.frozen import load_parts
    from odcfn.checkpoint.sharded import latest, read_manifest
    from odcfn.checkpoint.verify import sha256
    from odcfn.data.records import read_dataset, steps_per_epoch

    t = cfg.train
    mesh = transport.mesh  # the transport's view of the job (ranks_per_node, sharding) wins
    if mesh.world_size != t.world_size or mesh.rank != rank:
        raise ValueError(f"transport serves {mesh}, but the config asks for rank {rank} of {t.world_size}")
    ck = latest(cfg.checkpoint_dir) if cfg.checkpoint.resume else None
    # LoRA: the frozen base comes from [model] whether or not a checkpoint holds the adapters
    qcfg, model, initial = _build_model(cfg, None if ck is not None and not cfg.lora.rank else mesh)
    model, initial = _with_lora(cfg, model, initial, mesh)
    d = cfg.data
    if d.tokenizer:  # chat transcripts, tokenized once and cached
        from odcfn.data.chat import read_chat_jsonl

        data = read_chat_jsonl(
            d.path, d.tokenizer, vocab_size=qcfg.vocab_size, max_length=d.max_length, cache_dir=d.cache_dir
        )
    else:
        data = read_dataset(d.path, vocab_size=qcfg.vocab_size, max_length=d.max_length)
    lr = _lr_fn(t)
    make_opt = odcfn.adamw if t.optimizer == "adamw" else odcfn.sgd
    optimizer = make_opt(lr, weight_decay=t.weight_decay, weight_decay_mask=t.weight_decay_mask)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[t.compute_dtype]
    step_config = odcfn.StepConfig(
        comm=t.comm, balance=t.balance, max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        compute_dtype=dtype, max_grad_norm=t.max_grad_norm,
    )
    start, resumed = 0, None
    data_sha = sha256(Path(cfg.data.path))
    if ck is not None:
        check_resume(cfg, read_manifest(ck).get("extra", {}), data_sha, str(ck))
        # the state is built from the checkpoint's shards: a resumed rank never initialises
        # (or holds) fresh weights
        params, opt_state, start = load_parts(ck, model, mesh, initial, cfg.model.hf_path)
        resumed = str(ck)
    else:
        params, opt_state = initial, None
    state = odcfn.TrainState.create(
        params=params, model=model, optimizer=optimizer, transport=transport, config=step_config,
        opt_state=opt_state, step=start,
    )
    if rank == 0 and cfg.checkpoint_dir.exists():
        # Everything past the step we start from is stale: a fresh run's predecessors, or the
        # uncommitted remains of an interrupted save (whose rank files would otherwise pass
        # for this run's). Safe without a barrier: no rank saves before the first step's sync.
        for d in cfg.checkpoint_dir.glob("step-*"):
            num = d.name.removeprefix("step-")
            if num.isdigit() and (not cfg.checkpoint.resume or int(num) > start):
                shutil.rmtree(d)
    return _Run(state, data, steps_per_epoch(data, cfg.data.batch_size), lr, data_sha, start, resumed)


def _checkpoint(cfg: SFTConfig, run: _Run, done: int) -> None:
    """Save after step ``done`` when the schedule says so (every rank calls it)."""
    import odcfn

    every = cfg.checkpoint.every
    if not every or (done % every and done != cfg.train.steps):
        return
    odcfn.save(
        cfg.checkpoint_dir / f"step-{done:08d}", run.state,
        extra={"config": asdict(cfg), "data_sha256": run.data_sha}, timeout=cfg.train.timeout,
        base=cfg.model.hf_path,  # with LoRA: the adapters are saved with a reference to the base
    )
    if run.state.mesh.rank == 0:
        prune(cfg.checkpoint_dir, cfg.checkpoint.keep, done)


def train_rank(cfg: SFTConfig, rank: int, transport) -> dict[str, Any]:
    """The SFT loop for one rank; returns a summary (and rank's final shards for export)."""
    import odcfn
    from odcfn.data.records import batch_at

    run = _setup(cfg, rank, transport)
    logger = Logger(cfg, run.start) if rank == 0 else None
    last = None
    try:
        for step in range(run.start, cfg.train.steps):
            d = cfg.data
            batch = batch_at(run.data, step, d.batch_size, seed=d.seed, shuffle=d.shuffle)
            run.state, m = odcfn.train_step(run.state, batch)
            last = m.loss
            if logger is not None:
                logger.log(step_record(m, step + 1, step // run.per_epoch, run.lr(step + 1)))
            _checkpoint(cfg, run, step + 1)
    finally:
        if logger is not None:
            logger.close()
    out: dict[str, Any] = {
        "rank": rank,
        "start_step": run.start,
        "steps": cfg.train.steps,
        "final_loss": last,
        "resumed_from": run.resumed,
    }
    if cfg.checkpoint.export_hf:
        # numpy: torch would send tensors to the launcher as shared-memory handles that die
        # with this rank's process
        out["shards"] = {k: v.detach().numpy().copy() for k, v in run.state.params.items()}
    return out


def _process_worker(cfg: SFTConfig) -> dict[str, Any]:
    """Entry point of one rank under ``odcfn.launch`` or ``torchrun``."""
    import torch

    import odcfn
    from odcfn.kernels.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    if mesh.world_size != cfg.train.world_size:
        cfg = replace(cfg, train=replace(cfg.train, world_size=mesh.world_size))
    with ShmTransport(mesh, timeout=cfg.train.timeout) as tr:
        return train_rank(cfg, mesh.rank, tr)


def run(cfg: SFTConfig) -> list[dict[str, Any]]:
    """Run the whole job on ``cfg.train.world_size`` local ranks; per-rank summaries."""
    import odcfn

    W = cfg.train.world_size
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # already one rank of torchrun
        results = [_process_worker(cfg)]
    elif cfg.train.backend == "processes":
        from odcfn.launch import launch

        results = launch(_process_worker, W, args=(cfg,), timeout=cfg.train.timeout)
    else:
        results = odcfn.run_local(lambda rank, tr: train_rank(cfg, rank, tr), W, timeout=cfg.train.timeout)
    if cfg.checkpoint.export_hf and len(results) != W:  # one rank of torchrun: no launcher
        if results[0]["rank"] == 0:
            print(
                "odcfn train: export_hf is written by the launcher (backend threads/processes); "
                "under torchrun, export from the last checkpoint",
                file=sys.stderr,
            )
    elif cfg.checkpoint.export_hf:
        import torch

        from odcfn.models.hf import to_hf

        qcfg, model, _ = _build_model(cfg)
        model = _with_lora(cfg, model, None, None)[0]
        shards = [{k: torch.from_numpy(v) for k, v in r.pop("shards").items()} for r in results]
        full = odcfn.unshard(shards, model, odcfn.Mesh(W))
        to_hf(cfg.checkpoint.export_hf, odcfn.lora.merge(model, full) if cfg.lora.rank else full, qcfg)
    return results


# --- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="run config, .toml or .json")
    parser.add_argument(
        "--init", metavar="DIR", help="write an example run.toml + train.jsonl into DIR and exit"
    )
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--world-size", type=int, help="override train.world_size")
    parser.add_argument("--out-dir", help="override out_dir")
    parser.add_argument(
        "--no-resume",
        action="store_true",
        help="start from scratch: delete out_dir's checkpoints and restart its metrics log",
    )
    parser.add_argument("--resume-anyway", action="store_true", help="resume though config/data changed")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")


def main(args: argparse.Namespace) -> int:
    if args.init:
        path = write_example(args.init)
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
    where = f", resumed from {head['resumed_from']}" if head["resumed_from"] else ""
    print(
        f"odcfn train: steps {head['start_step']}..{head['steps']} on {cfg.train.world_size} rank(s) "
        f"({cfg.train.comm}){where}; final loss {head['final_loss']}; "
        f"metrics {cfg.metrics_path}; {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return 0
