"""The first lines of every ``odcfn train`` run: what will run, before it runs. A user who left out
``lora.rank``, named the wrong data file or asked for 16 ranks on 2 cores sees it here, not after
an hour: the model (family, sizes, parameters, tied or not; a mixture's experts, routing and
balancing), what is trained (LoRA or every
parameter), the data (file, samples, tokens), ranks and backend, and checkpointing."""

from __future__ import annotations

import os
from typing import Any

from odcfn.sft.config import SFTConfig

__all__ = ["cores", "oversubscription", "run_lines"]


def cores() -> int:
    """CPU cores this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _numel(model: Any, names: set[str]) -> int:
    import math

    from odcfn.tree import tree_flatten_with_path

    total = 0
    for u in model.units:
        if u.name in names:
            total += sum(math.prod(s) for s in tree_flatten_with_path(u.shapes)[1])
    return total


def oversubscription(cfg: SFTConfig, threads_per_rank: int | None = None) -> str | None:
    """A warning when the ranks' compute threads outnumber the cores (each one then only
    time-slices: slower than fewer ranks, and every timing meaningless); None when they fit.
    Processes run one thread each; threads of one process share torch's pool."""
    import torch

    W, n = cfg.train.world_size, cores()
    per = threads_per_rank or (1 if cfg.train.backend == "processes" else torch.get_num_threads())
    busy = W * per if cfg.train.backend == "processes" else max(W, per)
    if busy <= n:
        return None
    return (f"warning: train.world_size = {W} ranks ({cfg.train.backend}, {per} compute thread(s) each) on "
            f"{n} core(s): they oversubscribe the cores and only time-slice; use train.world_size <= {n}")


def _experts(cfg: SFTConfig, qcfg: Any) -> list[str]:
    """A mixture of experts' line: which layers are sparse, the experts, routing and balancing
    (the model line's ``d_ff`` is then the dense layers' only)."""
    from odcfn.models import QwenMoeConfig
    from odcfn.models.moe import sparse_layers

    if not isinstance(qcfg, QwenMoeConfig):
        return []
    sparse = list(sparse_layers(qcfg))
    dense = [i for i in range(qcfg.n_layers) if i not in sparse]
    shared = (f", a shared expert of {qcfg.shared_expert_intermediate_size}"
              if qcfg.shared_expert_intermediate_size else "")
    on = qcfg.output_router_logits and qcfg.router_aux_loss_coef
    aux = f"aux loss coef {qcfg.router_aux_loss_coef:g}" if on else "no aux loss (output_router_logits off)"
    rate = cfg.train.expert_bias_rate
    bias = f"expert_bias_rate {rate:g} (aux-loss-free balancing)" if rate else "no router bias"
    return [f"experts: mixture of experts, {qcfg.num_experts} experts of moe_intermediate_size "
            f"{qcfg.moe_intermediate_size}, top-{qcfg.num_experts_per_tok} per token"
            f"{' (normalised)' if qcfg.norm_topk_prob else ''}{shared}, in sparse layers {sparse} of "
            f"{qcfg.n_layers} (dense: {dense}{f', d_ff {qcfg.d_ff}' if dense else ''}); {aux}; {bias}; "
            f"{_count(qcfg.active_params)} parameters active per token"]


def run_lines(cfg: SFTConfig, qcfg: Any, model: Any, data: Any) -> list[str]:
    """The run's opening lines (printed before any rank starts)."""
    from odcfn.models.hf_config import model_type

    try:
        family = model_type(qcfg)
    except ValueError:
        family = "qwen-like"
    source = f"from {cfg.model.hf_path}" if cfg.model.hf_path else f"fresh, seed {cfg.model.seed}"
    # the base's parameters: LoRA's adapter units ("lora.<unit>") are counted as trained below
    base = _numel(model, {u.name for u in model.units if not u.name.startswith("lora.")})
    head_dim = qcfg.head_dim or qcfg.d_model // qcfg.n_heads
    moe = _experts(cfg, qcfg)
    ff = "a mixture of experts (below)" if moe else f"d_ff {qcfg.d_ff}"
    lines = [
        f"model: {family} ({source}): {qcfg.n_layers} layers, d_model {qcfg.d_model}, {ff}, "
        f"{qcfg.n_heads} heads / {qcfg.n_kv_heads} kv heads of {head_dim}, vocab {qcfg.vocab_size}, "
        f"{'tied' if qcfg.tie_embeddings else 'untied'} embeddings; {_count(base)} parameters",
    ]
    lines += moe
    frozen = set(model.frozen)
    trained = _numel(model, {u.name for u in model.units if u.name not in frozen})
    if cfg.lora.rank:
        c = cfg.lora
        lines.append(f"trained: LoRA rank {c.rank}, alpha {c.alpha:g}, dropout {c.dropout:g} on "
                     f"{', '.join(c.targets)}{' (rsLoRA)' if c.use_rslora else ''}: {_count(trained)} "
                     f"parameters; the base is frozen")
    else:
        lines.append(f"trained: every parameter (full fine-tuning: {_count(trained)}); a [lora] section "
                     "with rank trains adapters instead")
    ds, d = data.dataset, cfg.data
    if cfg.train.task == "rl":
        from odcfn.sft.rl_data import rl_lines

        lines += rl_lines(cfg, data)
    elif cfg.train.task == "dpo":
        p = cfg.dpo
        ref = "no reference pass" if not p.uses_reference else "reference: the initial model" + (
            " (the base, adapters off)" if cfg.lora.rank else "")
        lines.append(f"task: dpo, loss {p.loss_type}, beta {p.beta:g}, label_smoothing {p.label_smoothing:g}"
                     f"{f', simpo_gamma {p.simpo_gamma:g}' if p.loss_type == 'simpo' else ''}"
                     f"{f', sft_weight {p.sft_weight:g}' if p.sft_weight else ''}; {ref}")
        lines.append(f"data: {d.path} (preference pairs, tokenizer {d.tokenizer}): {len(ds) // 2} pairs, "
                     f"{ds.num_tokens} tokens; minibatch {d.batch_size} pairs, {data.per_epoch} steps "
                     f"per epoch{', shuffled' if d.shuffle else ''}")
        from odcfn.data.preference import warn_odd

        odd = warn_odd(list(getattr(data, "odd", ())))
        if odd is not None:
            lines.append(f"warning: {odd}")
    else:
        from odcfn.data.formats import FORMATS

        short = {"messages": "chat"}  # the formats' names as the opening line has always said them
        kinds = ", ".join(dict.fromkeys(short.get(f, FORMATS[f][1]) for f in getattr(data, "formats", ())))
        what = (kinds or "token records") + (f", tokenizer {d.tokenizer}" if d.tokenizer else "")
        where = d.path or " + ".join(f"{s['path']} (weight {s['weight']:g})" for s in d.sources)
        lines.append(f"data: {where} ({what}): {len(ds)} samples, {ds.num_tokens} tokens; minibatch "
                     f"{d.batch_size} samples, {data.per_epoch} steps per epoch"
                     f"{', shuffled' if d.shuffle else ''}{', mixed by weight' if d.sources else ''}")
        if getattr(data, "eval", None) is not None:
            lines.append(f"eval data: {d.eval_path}: {len(data.eval)} samples, {data.eval.num_tokens} tokens")
    t = cfg.train
    cap = t.max_tokens_per_microbatch or "one sample"
    remat = ", remat" if t.remat else ""
    if t.staleness:  # said up front: the losses then arrive late and saves drain first
        remat += f", staleness {t.staleness}"
    lines.append(f"ranks: {t.world_size} ({t.backend}), {t.comm} + {t.balance}, microbatch cap {cap} tokens, "
                 f"{t.compute_dtype}{remat}; {t.steps} steps, {t.optimizer} lr {t.lr:g} "
                 f"({t.schedule}, warmup {t.warmup_steps})")
    k = cfg.checkpoint
    every = f"every {k.every} steps and after the last" if k.every else "after the last step only"
    keep = "all kept" if k.keep is None else f"newest {k.keep} kept"
    extra = f"; memory snapshots every {k.memory_every}" if k.memory_every else ""
    export = f"; Hugging Face export to {k.export_hf}" if k.export_hf else ""
    lines.append(f"checkpoints: {cfg.checkpoint_dir}, {every} ({keep}){extra}{export}")
    warn = oversubscription(cfg)
    return lines + ([warn] if warn else [])
