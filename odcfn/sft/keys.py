"""Every ``odcfn train`` config key's rule and one-line meaning: the single table that the config
checks values against (``check_key``), that ``docs/config.md`` and ``odcfn train --init`` are
generated from (``odcfn.sft.reference``), and that a test keeps equal to the config dataclasses'
fields. A key's type and default live on its dataclass field (``odcfn.sft.config``); what
values it allows and what it means live here."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from odcfn._check import ArgTypeError, is_int, is_number

__all__ = ["KEYS", "Rule", "check_key", "check_type", "describe"]


@dataclass(frozen=True)
class Rule:
    """What one key allows beyond its type: ``choices`` (a tuple, or a callable returning one,
    for lists that live elsewhere), a lower bound ``lo`` (``strict``: ``>`` instead of ``>=``),
    an upper bound ``hi`` (``hi_strict``: ``<``); ``what``, the values in words when the type's
    name is not enough (a table, a list of ids); and ``doc``, its one-line meaning."""

    doc: str
    choices: Any = None
    lo: float | None = None
    strict: bool = False
    hi: float | None = None
    hi_strict: bool = False
    what: str | None = None  # the allowed values in words, where the type's own name says too little

    def allowed(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices


def _balancers() -> tuple[str, ...]:
    from odcfn.schedule.policy import POLICIES

    return tuple(sorted(POLICIES))


def _decay_masks() -> tuple[str, ...]:
    from odcfn.optim import DECAY_MASKS

    return tuple(DECAY_MASKS)


def _estimators() -> tuple[str, ...]:
    from odcfn.rl.config import ESTIMATORS

    return ESTIMATORS


def _backends() -> tuple[str, ...]:
    from odcfn.sft.trackers import BACKENDS

    return BACKENDS


def _kl_types() -> tuple[str, ...]:
    from odcfn.losses import KL_TYPES

    return tuple(KL_TYPES)


def _agg_modes() -> tuple[str, ...]:
    from odcfn.losses import AGG_MODES

    return AGG_MODES


def _dpo_losses() -> tuple[str, ...]:
    from odcfn.losses.preference import DPO_LOSS_TYPES

    return DPO_LOSS_TYPES


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_POS = {"lo": 1}  # a count: at least one
_NONNEG = {"lo": 0}

# (section, key) -> Rule; "" is the top level. The order is the order of the docs and --init.
KEYS: dict[tuple[str, str], Rule] = {
    ("", "out_dir"): Rule("where checkpoints, metrics.jsonl and the lock go (relative to the config file)"),
    # [model]
    ("model", "hf_path"): Rule("a local Hugging Face model directory to start from; the shape keys below "
                               "must then be left out (they come from its config.json)"),
    ("model", "vocab_size"): Rule("fresh model: vocabulary size (token ids are < this)", **_POS),
    ("model", "d_model"): Rule("fresh model: hidden width", **_POS),
    ("model", "n_layers"): Rule("fresh model: decoder layers", **_POS),
    ("model", "n_heads"): Rule("fresh model: query heads (d_model / n_heads is the head width)", **_POS),
    ("model", "n_kv_heads"): Rule("fresh model: key/value heads (divides n_heads: grouped-query attention)",
                                  **_POS),
    ("model", "d_ff"): Rule("fresh model: MLP width", **_POS),
    ("model", "rope_theta"): Rule("fresh model: RoPE base", lo=0, strict=True),
    ("model", "qkv_bias"): Rule("fresh model: biases on q/k/v (Qwen2: true, Llama: false)"),
    ("model", "head_dim"): Rule("fresh model: head width when not d_model / n_heads (Qwen3)", **_POS),
    ("model", "qk_norm"): Rule("fresh model: RMSNorm of q and k per head (Qwen3)"),
    ("model", "o_bias"): Rule("fresh model: bias on o_proj (Llama attention_bias)"),
    ("model", "tie_embeddings"): Rule("fresh model: the head reads the embedding matrix (one parameter)"),
    ("model", "seed"): Rule("fresh model: seed of the initial weights", **_NONNEG),
    # [data]
    ("data", "path"): Rule("REQUIRED (or [[data.sources]]): the training data, a JSONL or parquet file, a "
                           "folder of them or a datasets save_to_disk directory, in a format its columns "
                           "name (docs/data.md): token records (input_ids), or with data.tokenizer TRL's "
                           "text / messages / prompt + completion; train.task = \"dpo\": prompt + chosen + "
                           "rejected (or chosen + rejected); \"rl\": prompt and the reward's fields"),
    ("data", "batch_size"): Rule("samples per minibatch (one optimizer step); pairs with train.task = "
                                 "\"dpo\"; prompts per iteration with \"rl\"", **_POS),
    ("data", "seed"): Rule("seed of the per-epoch shuffle", **_NONNEG),
    ("data", "shuffle"): Rule("shuffle the samples each epoch (false: file order)"),
    ("data", "max_length"): Rule("longest sample in tokens (longer ones: see long_samples); unset: no limit",
                                 **_POS),
    ("data", "tokenizer"): Rule("a local tokenizer directory: data.path then holds {\"messages\": [...]} "
                                "chat lines, tokenized with its chat template"),
    ("data", "cache_dir"): Rule("where tokenized chat shards go (unset: beside the data file)"),
    ("data", "long_samples"): Rule("a sample over max_length or the microbatch cap: name it before the "
                                   "first step, keep its first tokens, or leave it out",
                                   choices=("error", "truncate", "drop")),
    ("data", "skip_empty_minibatches"): Rule("a minibatch without loss tokens: an error naming it (false) "
                                             "or a step without an update (true)"),
    ("data", "sources"): Rule("train.task = \"sft\", instead of data.path: several datasets mixed by "
                              "weight, [[data.sources]] tables with path (like data.path) and weight (> 0, "
                              "default 1: its share of every minibatch, relative to the others)",
                              what="a list of tables {path = \"...\", weight = 1.0}"),
    ("data", "eval_path"): Rule("a held-out set in the training data's format (sft, dpo), read and checked "
                                "with it before the first step (it must have loss tokens)"),
    # [train]
    ("train", "steps"): Rule("REQUIRED: optimizer steps (minibatches) of the whole run; RL iterations "
                             "with train.task = \"rl\"", **_POS),
    ("train", "task"): Rule("what is trained: supervised fine-tuning, preference optimization (DPO "
                            "family: data.path holds prompt/chosen/rejected pairs, the loss is [dpo]'s), or "
                            "RL on prompts (rollouts from [rollout], rewards and the loss from [rl])",
                            choices=("sft", "dpo", "rl")),
    ("train", "lr"): Rule("peak learning rate", lo=0, strict=True),
    ("train", "warmup_steps"): Rule("steps of linear warmup from 0 to lr (at most train.steps)", **_NONNEG),
    ("train", "schedule"): Rule("learning rate after warmup", choices=("constant", "cosine")),
    ("train", "optimizer"): Rule("the optimizer", choices=("adamw", "sgd")),
    ("train", "weight_decay"): Rule("decoupled weight decay", **_NONNEG),
    ("train", "weight_decay_mask"): Rule("which parameters decay", choices=_decay_masks),
    ("train", "max_grad_norm"): Rule("clip the global gradient norm to this; unset: no clipping",
                                     lo=0, strict=True),
    ("train", "comm"): Rule("ODC (point-to-point, one sync per step) or collective FSDP",
                            choices=("odc", "collective")),
    ("train", "balance"): Rule("how samples are spread over ranks (unset: lb_mini for odc, lb_micro "
                               "for collective)", choices=_balancers),
    ("train", "max_tokens_per_microbatch"): Rule("token cap of one microbatch; unset: one sample each",
                                                 **_POS),
    ("train", "compute_dtype"): Rule("dtype of the forward/backward (weights stay float32)",
                                     choices=("float32", "bfloat16")),
    ("train", "remat"): Rule("recompute every unit in its backward: O(T) activations, ~1/3 more compute"),
    ("train", "world_size"): Rule("local ranks (unset: one per CPU core, at most 4)", **_POS),
    ("train", "backend"): Rule("ranks as threads of one process or as separate processes",
                               choices=("threads", "processes")),
    ("train", "timeout"): Rule("seconds a rank waits on a peer before calling it dead", lo=0, strict=True),
    ("train", "deterministic"): Rule("bit-identical reruns and restarts (StepConfig.deterministic)"),
    ("train", "staleness"): Rule("bounded staleness tau (docs/staleness.md): a rank may run up to tau steps "
                                 "ahead, reading parameters up to tau versions old (0: synchronous); a table "
                                 "[train.staleness] maps unit patterns to tau (e.g. head = 0, \"*\" = 1)",
                                 **_NONNEG),
    ("train", "expert_bias_rate"): Rule("mixture of experts only: aux-loss-free balancing, the rate at which "
                                        "each router's per-expert bias moves toward under-loaded experts "
                                        "(0: off)", **_NONNEG),
    ("train", "gather_format"): Rule("what gathers move (docs/memory.md): block-quantized by the owner after "
                                     "its update, one float32 scale per quant_block values; unset: "
                                     "compute_dtype", choices=("bf16", "fp8_e4m3", "int8")),
    ("train", "push_format"): Rule("what gradient pushes move (owners accumulate in float32); int8 and bf16 "
                                   "need comm = \"odc\"; unset: the gradient in compute_dtype",
                                   choices=("fp32", "bf16", "int8")),
    ("train", "push_error_feedback"): Rule("carry each push's rounding error into the next push "
                                           "(needs push_format; checkpoints keep each rank's residual, "
                                           "so a resume continues it)"),
    ("train", "quant_block"): Rule("values per float32 scale of gather_format / push_format", **_POS),
    ("train", "quantize_frozen"): Rule("keep the frozen base of a [lora] run only in gather_format "
                                       "(docs/memory.md: encoded once, its full-precision copy dropped; "
                                       "needs gather_format)"),
    ("train", "max_restarts"): Rule("backend = \"processes\" only: restart all ranks this often after a "
                                    "failure", **_NONNEG),
    # [checkpoint]
    ("checkpoint", "every"): Rule("a checkpoint every N steps, and always one after the last step "
                                  "(0: only that final one)", **_NONNEG),
    ("checkpoint", "keep"): Rule("newest checkpoints kept (unset: all)", **_POS),
    ("checkpoint", "resume"): Rule("resume from the newest checkpoint in out_dir (false: start over, "
                                   "deleting them)"),
    ("checkpoint", "resume_anyway"): Rule("resume although the stored run's config or data differ"),
    ("checkpoint", "recompute_reference"): Rule("train.task = \"dpo\": resume although the reference's "
                                                "weights (model.hf_path) differ from the run's start, "
                                                "recomputing its log-probs from them"),
    ("checkpoint", "export_hf"): Rule("after the run, write the final weights as a Hugging Face model here"),
    ("checkpoint", "async_save"): Rule("write disk checkpoints in the background (the step waits for a "
                                       "copy)"),
    ("checkpoint", "memory_every"): Rule("a /dev/shm snapshot every N steps that restarts resume from "
                                         "(0: off)", **_NONNEG),
    # [log]
    ("log", "every"): Rule("a progress line every N steps (metrics.jsonl gets every step)", **_POS),
    ("log", "tensorboard"): Rule("also write TensorBoard events (needs tensorboard installed)"),
    ("log", "progress"): Rule("print progress lines (--quiet: false)"),
    ("log", "backends"): Rule("where the metrics go besides metrics.jsonl (always written): tensorboard "
                              "(<out_dir>/tensorboard), wandb (offline unless WANDB_MODE/WANDB_API_KEY say "
                              "otherwise; files under <out_dir>/wandb), trackio (its local store), mlflow "
                              "(MLFLOW_TRACKING_URI; unset: sqlite:///<out_dir>/mlflow.db); each an extra, "
                              "pip install 'odcfn[NAME]' (docs/sft.md)", choices=_backends),
    # [eval]
    ("eval", "every"): Rule("every N steps, the held-out loss of data.eval_path (one forward-only pass, "
                            "balanced like training; dpo: and its rewards) as eval/loss, eval/...; "
                            "0: never", **_NONNEG),
    # [lora]
    ("lora", "rank"): Rule("REQUIRED in a [lora] section: adapter rank r (0: no LoRA, full fine-tuning)",
                           **_NONNEG),
    ("lora", "alpha"): Rule("scaling: alpha / r (alpha / sqrt(r) with use_rslora)", lo=0, strict=True),
    ("lora", "dropout"): Rule("dropout on the adapters' input", lo=0, hi=1, hi_strict=True),
    ("lora", "targets"): Rule("projections that get adapters", choices=_PROJECTIONS),
    ("lora", "use_rslora"): Rule("rank-stabilised scaling alpha / sqrt(r)"),
    ("lora", "seed"): Rule("seed of the adapters' initial A", **_NONNEG),
    # [dpo]: train.task = "dpo" only (docs/preference.md)
    ("dpo", "beta"): Rule("strength of the pull toward the reference (TRL's beta)", lo=0, strict=True),
    ("dpo", "loss_type"): Rule("the preference loss (formulas: docs/preference.md); simpo is "
                               "reference-free", choices=_dpo_losses),
    ("dpo", "label_smoothing"): Rule("probability that a pair's label is flipped (cDPO, robust: < 0.5)",
                                     lo=0, hi=1, hi_strict=True),
    ("dpo", "reference_free"): Rule("take the reference log-probs as 0: no reference pass"),
    ("dpo", "simpo_gamma"): Rule("loss_type = \"simpo\": the target reward margin gamma", **_NONNEG),
    ("dpo", "sft_weight"): Rule("weight of an added NLL term on the chosen answers (TRL's rpo_alpha)",
                                **_NONNEG),
    # [rollout]: train.task = "rl" only (odcfn.sft.config_rl); vLLM's names for sampling
    ("rollout", "engine"): Rule("what generates the rollouts: the embedded engine, or vLLM in the same job "
                                "(the vllm extra)", choices=("local", "vllm")),
    ("rollout", "max_tokens"): Rule("new tokens per completion at most", **_POS),
    ("rollout", "temperature"): Rule("sampling temperature (0: greedy)", **_NONNEG),
    ("rollout", "top_p"): Rule("nucleus sampling: the smallest set of tokens with this probability",
                               lo=0, strict=True, hi=1),
    ("rollout", "top_k"): Rule("sample among the k most likely tokens (0: no top-k)", **_NONNEG),
    ("rollout", "stop_token_ids"): Rule("generation stops after one of these (unset: the tokenizer's "
                                        "end-of-sequence token)", what="a list of token ids >= 0"),
    ("rollout", "max_model_len"): Rule("prompt + completion tokens at most; a longer prompt is named "
                                       "(data.long_samples)", lo=2),
    ("rollout", "max_batch_tokens"): Rule("local engine: reserved tokens (prompt + new tokens) of the "
                                          "sequences generated together", **_POS),
    ("rollout", "engine_options"): Rule("vllm engine: keyword arguments for VLLMEngine (e.g. "
                                        "gpu_memory_utilization)", what="a table of option names to values"),
    # [rl]: train.task = "rl" only; verl's names (docs/rl.md)
    ("rl", "reward"): Rule("the reward: a built-in (exact_match, regex_format) or \"module:function\" / "
                           "\"path/to/file.py:function\", called as fn(prompt, completion) -> float"),
    ("rl", "reward_options"): Rule("keyword arguments of a built-in reward (exact_match: answer_key, "
                                   "extract, format_score; regex_format: pattern)",
                                   what="a table of option names to values"),
    ("rl", "reward_fields"): Rule("fields every prompt row must have for the reward (dotted for nested "
                                  "objects); exact_match's ground truth is checked without it"),
    ("rl", "estimator"): Rule("advantage estimator (verl's names)", choices=_estimators),
    ("rl", "group_size"): Rule("completions per prompt (the group of grpo/rloo: at least 2)", **_POS),
    ("rl", "norm_adv_by_std_in_grpo"): Rule("grpo: divide by the group's std (false: Dr. GRPO)"),
    ("rl", "clip_ratio_low"): Rule("PPO clip: the ratio's lower bound is 1 - this", **_NONNEG),
    ("rl", "clip_ratio_high"): Rule("PPO clip: the ratio's upper bound is 1 + this (DAPO's clip-higher: "
                                    "above clip_ratio_low)", **_NONNEG),
    ("rl", "clip_ratio_c"): Rule("dual clip of negative advantages", lo=1, strict=True),
    ("rl", "kl_loss_coef"): Rule("weight of the KL to the reference (the initial model; LoRA: the base); 0: "
                                 "no reference pass", **_NONNEG),
    ("rl", "kl_loss_type"): Rule("the KL estimator", choices=_kl_types),
    ("rl", "entropy_coeff"): Rule("weight of the entropy bonus", **_NONNEG),
    ("rl", "loss_agg_mode"): Rule("how token losses are averaged over the minibatch", choices=_agg_modes),
    ("rl", "ppo_epochs"): Rule("passes over an iteration's rollouts", **_POS),
    ("rl", "ppo_mini_batches"): Rule("optimizer steps per pass (minibatches of whole groups)", **_POS),
    ("rl", "use_rollout_logprobs"): Rule("take old log-probs from the engine instead of a forward pass"),
    ("rl", "rollout_is_threshold"): Rule("truncated importance sampling against the engine's log-probs "
                                         "(unset: off)", lo=0, strict=True),
    ("rl", "dynamic_sampling"): Rule("DAPO: drop groups whose rewards are all equal"),
    ("rl", "overlong_buffer_len"): Rule("DAPO's soft overlong penalty over the last N tokens of "
                                        "rollout.max_tokens (0: off)", **_NONNEG),
    ("rl", "overlong_penalty_factor"): Rule("the overlong penalty at rollout.max_tokens", **_NONNEG),
    ("rl", "mask_truncated"): Rule("responses cut by max_tokens train no token"),
    ("rl", "async_rollouts"): Rule("one-step asynchronous: the next iteration's generation overlaps this "
                                   "update (decoupled objective)"),
    ("rl", "max_version_lag"): Rule("async: how many trainer versions behind a rollout may be", **_POS),
    ("rl", "seed"): Rule("seed of the sampling (each iteration's seeds derive from it and the step)",
                         **_NONNEG),
    # [offload]
    ("offload", "budget_gib"): Rule("keep the owners' fp32 master shards and optimizer state in a slower "
                                    "tier, streaming the update through at most this many GiB (one unit "
                                    "plus the prefetch window must fit; docs/memory.md); 0: off, all in "
                                    "memory", **_NONNEG),
    ("offload", "path"): Rule("the slow tier: a writable directory on local disk (relative to the config "
                              "file); unset: host memory (pinned on GPUs)"),
    ("offload", "prefetch"): Rule("units read ahead of the update by a background thread", **_NONNEG),
}

# a bool is an int to Python: True must not pass for a step count
_TYPES = {
    "int": is_int,
    "float": is_number,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: v is True or v is False,
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
}
_NAMES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false",
          "list": "a list of strings", "None": "unset",
          "dict": "a table of unit patterns to integers"}


def _kinds(annotation: Any) -> list[str]:
    return [k.strip() for k in str(annotation).split("|")]


def _dotted(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def describe(section: str, key: str, annotation: Any) -> str:
    """What ``section.key`` allows, in words: ``"a number > 0"``, ``"one of ['odc', ...]"``."""
    rule, kinds = KEYS[(section, key)], _kinds(annotation)
    choices = rule.allowed()
    if rule.what is not None:
        what = rule.what
    elif choices is not None:
        what = f"a list of {list(choices)}" if "list" in kinds else f"one of {list(choices)}"
    else:
        what = " or ".join(_NAMES.get(k, k) for k in kinds if k != "None")
        bounds = []
        if rule.lo is not None:
            bounds.append(f"{'>' if rule.strict else '>='} {rule.lo:g}")
        if rule.hi is not None:
            bounds.append(f"{'<' if rule.hi_strict else '<='} {rule.hi:g}")
        if bounds:
            what += " " + " and ".join(bounds)
    return what + (" (or unset)" if "None" in kinds else "")


def check_type(section: str, key: str, value: Any, annotation: Any) -> None:
    """``value`` has ``annotation``'s type (``X | None`` allows None); else an ``ArgTypeError``."""
    kinds = _kinds(annotation)
    if value is None and "None" in kinds:
        return
    if not any(_TYPES[k](value) for k in kinds if k in _TYPES):
        raise ArgTypeError(f"config: {_dotted(section, key)} must be {describe(section, key, annotation)}, "
                           f"got {type(value).__name__} {value!r}")


def check_key(section: str, key: str, value: Any, annotation: Any) -> None:
    """Raise naming ``section.key`` and what it allows unless ``value`` passes its type and rule
    (a ``TypeError`` for a wrong type, a ``ValueError`` for a wrong value)."""
    check_type(section, key, value, annotation)
    if value is None:
        return
    rule = KEYS[(section, key)]

    def bad() -> ValueError:
        return ValueError(f"config: {_dotted(section, key)} must be {describe(section, key, annotation)}, "
                          f"got {value!r}")

    if isinstance(value, float) and not math.isfinite(value):
        raise bad()
    choices = rule.allowed()
    if choices is not None:
        items = value if isinstance(value, list) else [value]
        if (isinstance(value, list) and not value) or any(v not in choices for v in items):
            raise bad()
    if is_number(value):
        if rule.lo is not None and (value <= rule.lo if rule.strict else value < rule.lo):
            raise bad()
        if rule.hi is not None and (value >= rule.hi if rule.hi_strict else value > rule.hi):
            raise bad()
