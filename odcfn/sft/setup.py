"""Building one rank's run of ``odcfn train``: the model (fresh, from Hugging Face, or LoRA on
it), its shards, the optimizer and learning-rate schedule, and a fresh or resumed state with its
data (``setup``). The SFT/DPO loop (``odcfn.sft.loop``) and the RL loop (``odcfn.sft.rl_task``)
both start here."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from odcfn.sft.config import SFTConfig, TrainSection, model_config
from odcfn.sft.config_offload import step_offload
from odcfn.sft.config_rl import task_loss
from odcfn.sft.prepare import PreparedData, prepare_data, prepare_quietly
from odcfn.sft.restart import clear_for_fresh_start, open_memory_tier, resume_feedback, resume_point
from odcfn.sft.resume_check import check_resume
from odcfn.sft.stale_train import active, check_model
from odcfn.step.stale_config import max_staleness

__all__ = ["Run", "build_model", "lr_fn", "lr_now", "setup", "with_lora"]


def lr_fn(t: TrainSection):
    def lr(step: int) -> float:  # step is 1-based (the optimizer's count after this update)
        if t.warmup_steps and step <= t.warmup_steps:
            return t.lr * step / t.warmup_steps
        if t.schedule == "cosine":
            span = max(1, t.steps - t.warmup_steps)
            return 0.5 * t.lr * (1 + math.cos(math.pi * min(1.0, (step - t.warmup_steps) / span)))
        return t.lr

    return lr


def build_model(cfg: SFTConfig, mesh=None):
    """``(QwenConfig, Model, this rank's initial shards or None)``: shards only when ``mesh`` is
    given. An HF checkpoint is read shard-wise: no rank ever holds the full weights."""
    from odcfn.models import init_params, qwen_model
    from odcfn.sharding import shard

    if cfg.model.hf_path and mesh is not None:
        from odcfn.models.hf import shard_from_hf

        qcfg, shards = shard_from_hf(cfg.model.hf_path, mesh)
        return qcfg, qwen_model(qcfg), shards
    qcfg = model_config(cfg)
    if cfg.checkpoint.export_hf:  # refuse an unexportable model before training, not after
        from odcfn.models.hf_config import model_type

        model_type(qcfg)
    model = qwen_model(qcfg)
    return qcfg, model, None if mesh is None else shard(init_params(qcfg, seed=cfg.model.seed), model, mesh)


def with_lora(cfg: SFTConfig, model, shards, mesh):
    """``[lora]``: the LoRA model over the base and this rank's shards of it (None stays None)."""
    if not cfg.lora.rank:
        return model, shards
    from odcfn import lora

    c = cfg.lora
    kw = dict(rank=c.rank, alpha=c.alpha, targets=tuple(c.targets), dropout=c.dropout,
              use_rslora=c.use_rslora, seed=c.seed)
    if shards is None:
        return lora.apply(model, {}, **kw)[0], None
    return lora.apply_to_shards(model, shards, mesh, **kw)


@dataclass
class Run:
    """What one rank's loop runs with, built once by ``setup``."""

    state: Any  # odcfn.TrainState
    data: PreparedData
    lr: Any  # step -> learning rate
    data_sha: str
    start: int
    resumed: str | None
    tier: Any  # the memory tier (sft/restart.py)
    reference: dict[str, Any] | None = None  # train.task = "dpo": where its reference log-probs came from


def setup(cfg: SFTConfig, rank: int, transport, data: PreparedData | None = None) -> Run:
    """The rank's state (fresh, or resumed from the newest verified checkpoint), its data and
    schedule; refuses a resume whose config or data differ from the checkpoint's."""
    import torch

    import odcfn
    from odcfn.checkpoint.feedback import check_savable
    from odcfn.checkpoint.frozen import load_parts
    from odcfn.checkpoint.sharded import read_manifest
    from odcfn.checkpoint.state_io import ROUTER_BIAS
    from odcfn.sft.config_data import data_sha256
    from odcfn.sft.ref_logprobs import REFERENCE_SHA

    t = cfg.train
    mesh = transport.mesh  # the transport's view of the job (ranks_per_node, sharding) wins
    if mesh.world_size != t.world_size or mesh.rank != rank:
        raise ValueError(f"transport serves {mesh}, but the config asks for rank {rank} of {t.world_size}")
    tier = open_memory_tier(cfg, mesh, getattr(transport, "collectives", None))
    ck = resume_point(cfg, tier)  # the newest verified snapshot, memory tier or disk
    # LoRA: the frozen base comes from [model] whether or not a checkpoint holds the adapters
    qcfg, model, initial = build_model(cfg, None if ck is not None and not cfg.lora.rank else mesh)
    model, initial = with_lora(cfg, model, initial, mesh)
    check_model(cfg, model)  # staleness patterns, expert_bias_rate: before any step communicates
    if data is None:  # a rank of torchrun or of the processes backend: its own (cached) read
        # its warnings (fields not read, ...) are given once: by odcfn's launcher (which sets
        # ODCFN_LAUNCHER_PID in its ranks), or by torchrun's rank 0
        loud = rank == 0 and "ODCFN_LAUNCHER_PID" not in os.environ
        data = (prepare_data if loud else prepare_quietly)(cfg, qcfg.vocab_size)
    lr = lr_fn(t)
    make_opt = odcfn.adamw if t.optimizer == "adamw" else odcfn.sgd
    optimizer = make_opt(lr, weight_decay=t.weight_decay, weight_decay_mask=t.weight_decay_mask)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[t.compute_dtype]
    step_config = odcfn.StepConfig(
        comm=t.comm, balance=t.balance, max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        compute_dtype=dtype, max_grad_norm=t.max_grad_norm, deterministic=t.deterministic, remat=t.remat,
        staleness=t.staleness, expert_bias_rate=t.expert_bias_rate, offload=step_offload(cfg.offload),
        gather_format=t.gather_format, push_format=t.push_format, push_error_feedback=t.push_error_feedback,
        quant_block=t.quant_block, quantize_frozen=t.quantize_frozen,
        # the loop never reuses a state: update in place (no second copy of it); stale owners
        # keep older versions readable by peers, so never in place there
        donate=not active(t),
        loss=task_loss(cfg),  # None: cross-entropy (SFT); [dpo]'s or [rl]'s
    )
    # its checkpoints must hold each rank's error-feedback residuals: refused now, not at the first save
    check_savable(step_config, mesh, "odcfn train")
    start, resumed, bias, recorded = 0, None, None, None
    data_sha = data_sha256(cfg)  # data.path's bytes, or the mixture's sources (sft/config_data.py)
    if ck is not None:
        extra = read_manifest(ck).get("extra", {})
        check_resume(cfg, extra, data_sha, str(ck))
        recorded = (str(ck), extra.get(REFERENCE_SHA))  # the DPO reference the run started with
        # the state is built from the checkpoint's shards: a resumed rank never initialises
        # (or holds) fresh weights
        t_load = time.perf_counter()
        params, opt_state, start = load_parts(ck, model, mesh, initial, cfg.model.hf_path)
        resumed = str(ck)
        if t.expert_bias_rate and extra.get(ROUTER_BIAS) is not None:  # balancing continues where it was
            bias = torch.tensor(extra[ROUTER_BIAS], dtype=torch.float32)
        if rank == 0:  # a restart's trace in the job's log (recovery time, lost work)
            print(f"odcfn train: resuming at step {start} from {ck} (read in "
                  f"{time.perf_counter() - t_load:.2f}s)", file=sys.stderr, flush=True)
            _say_schedule_change(extra.get("config", {}), cfg, start)
    else:
        params, opt_state = initial, None
    state = odcfn.TrainState.create(
        params=params, model=model, optimizer=optimizer, transport=transport, config=step_config,
        opt_state=opt_state, step=start, router_bias=bias,
    )
    if ck is not None:  # each rank's error-feedback residuals continue where they were
        resume_feedback(ck, state, cfg.checkpoint.resume_anyway, rank)
    # Everything past the step we start from is stale: a fresh run's predecessors, or the
    # uncommitted remains of an interrupted save (whose rank files would otherwise pass for
    # this run's), in both tiers. Safe without a barrier: no rank saves before the first
    # step's sync.
    clear_for_fresh_start(cfg, start, tier, rank)
    reference = None  # train.task = "dpo": the reference pass, or its cache (sft/ref_logprobs.py)
    if t.task == "dpo":
        from odcfn.sft.ref_logprobs import attach_reference

        data, reference = attach_reference(cfg, state, data, data_sha, qcfg, resumed=ck is not None,
                                           initial=lambda: build_model(cfg, mesh)[2], recorded=recorded)
    return Run(state, data, lr, data_sha, start, resumed, tier, reference)


def _say_schedule_change(stored: dict[str, Any], cfg: SFTConfig, start: int) -> None:
    """A resume with another ``train.steps`` stretches (or shrinks) a decaying schedule: say so."""
    was = stored.get("train", {}).get("steps")
    t = cfg.train
    if not isinstance(was, int) or was == t.steps:
        return
    if t.schedule == "constant":
        what = "the learning rate stays constant, so only the run's length changes"
    else:
        old = lr_fn(replace(t, steps=was))(start + 1)
        what = (
            f"the {t.schedule} schedule now decays over {t.steps} steps instead of {was}: the "
            f"learning rate at step {start + 1} is {lr_fn(t)(start + 1):.3g} (it would have been {old:.3g})"
        )
    print(f"odcfn train: train.steps {was} -> {t.steps} on resume from step {start}; {what}", flush=True)


def lr_now(run: Run, step: int) -> float:
    """The rate of the update just made: the optimizer counts updates, skipped steps are none."""
    # a stale owner's optimizer state may trail the step (and no step is skipped there)
    count = run.state.opt_state.get("count") if isinstance(run.state.opt_state, dict) else None
    count = None if max_staleness(run.state.config.staleness) else count
    return run.lr(count if isinstance(count, int) else step + 1)
