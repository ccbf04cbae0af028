"""The ``odcfn train`` config's definition: the frozen dataclasses of its core sections
(``[model]``, ``[data]``, ``[train]``, ``[checkpoint]``, ``[log]``, ``[lora]``) and ``SFTConfig``,
which holds every section and checks what ties them together. Reading a file into them is
``odcfn.sft.config``, which re-exports these names; the other sections have their own
``config_*`` modules."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from odcfn.sft.config_data import check_data_section, check_data_task
from odcfn.sft.config_dpo import DpoSection, check_task
from odcfn.sft.config_eval import EvalSection, check_eval
from odcfn.sft.config_offload import OffloadSection, check_offload
from odcfn.sft.config_rl import RLSection, RolloutSection, check_rl_task
from odcfn.sft.keys import check_key
from odcfn.sft.stale_train import check_config, check_train
from odcfn.step.wire import check_wire_config

__all__ = [
    "CheckpointSection", "DataSection", "LogSection", "LoraSection", "ModelSection", "SFTConfig",
    "TrainSection", "check_wire_keys", "default_world_size",
]


def _check_types(section: Any, name: str) -> None:
    """Each field's value has its annotated type (``X | None`` allows None) and passes its rule in
    ``odcfn.sft.keys.KEYS``: a bad value fails when the config is read, naming the key and what it
    allows, not at some later step."""
    for f in fields(section):
        check_key(name, f.name, getattr(section, f.name), f.type)


@dataclass(frozen=True)
class ModelSection:
    hf_path: str | None = None
    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    rope_theta: float = 10000.0
    qkv_bias: bool = True
    head_dim: int | None = None
    qk_norm: bool = False
    o_bias: bool = False
    tie_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _check_types(self, 'model')


@dataclass(frozen=True)
class DataSection:
    path: str = ""
    batch_size: int = 8
    seed: int = 0
    shuffle: bool = True
    max_length: int | None = None
    tokenizer: str | None = None  # a local tokenizer dir: path holds chat transcripts
    cache_dir: str | None = None  # tokenized chat shards (default: beside the data file)
    # a sample longer than max_length or the microbatch cap: "error" (name it before the first
    # step), "truncate" (keep its first tokens) or "drop" (leave it out); reported in the summary
    long_samples: str = "error"
    # a minibatch without loss tokens (every sample fully masked) has no loss: an error naming
    # its step and data lines before the first step, or (true) a step without an update
    skip_empty_minibatches: bool = False
    # instead of path: [[data.sources]] tables {path, weight}, mixed by weight (odcfn.data.mixture)
    sources: list | None = None
    eval_path: str | None = None  # a held-out set in the training data's format

    def __post_init__(self) -> None:
        _check_types(self, 'data')
        check_data_section(self)


@dataclass(frozen=True)
class TrainSection:
    steps: int = 0
    task: str = "sft"  # "dpo": pairs and [dpo]'s loss (sft.config_dpo); "rl": prompts, [rl] (sft.config_rl)
    lr: float = 1e-3
    warmup_steps: int = 0
    schedule: str = "constant"
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    weight_decay_mask: str = "no_norms_biases"  # a name in odcfn.optim.DECAY_MASKS
    max_grad_norm: float | None = None
    comm: str = "odc"
    balance: str | None = None  # None: "lb_mini" for ODC, "lb_micro" for collective
    max_tokens_per_microbatch: int | None = None
    compute_dtype: str = "float32"
    remat: bool = False  # recompute every unit in its backward (StepConfig.remat): O(T) activations
    world_size: int | None = None  # None: default_world_size(), the local ranks that fit
    backend: str = "threads"
    timeout: float = 120.0
    deterministic: bool = False  # StepConfig.deterministic: bit-identical reruns and restarts
    staleness: int | dict = 0  # StepConfig.staleness: τ, or {unit pattern: τ} (odcfn.sft.stale_train)
    expert_bias_rate: float = 0.0  # StepConfig.expert_bias_rate: a mixture's aux-loss-free balancing
    gather_format: str | None = None  # StepConfig.gather_format (docs/memory.md); unset: compute_dtype
    push_format: str | None = None  # StepConfig.push_format; unset: the gradient in compute_dtype
    push_error_feedback: bool = False  # StepConfig.push_error_feedback
    quant_block: int = 128  # StepConfig.quant_block: values per fp32 scale
    quantize_frozen: bool = False  # StepConfig.quantize_frozen: a LoRA base held in gather_format alone
    max_restarts: int = 0  # backend "processes": restart the ranks this often after a failure

    def __post_init__(self) -> None:
        # resolved here, so a checkpoint's stored config names what the run actually used
        if self.balance is None:
            object.__setattr__(self, "balance", "lb_micro" if self.comm == "collective" else "lb_mini")
        if self.world_size is None:
            object.__setattr__(self, "world_size", default_world_size())
        _check_types(self, 'train')
        check_train(self)  # the table's entries, and the keys staleness cannot be combined with
        check_wire_keys(self)  # the formats' combinations with comm, staleness, feedback


def check_wire_keys(t: Any) -> None:
    """The combinations StepConfig refuses (``odcfn.step.wire``), named as this file's keys."""
    try:
        check_wire_config(t)
    except (TypeError, ValueError) as e:
        raise type(e)(f"config: {str(e).replace('StepConfig.', 'train.')}") from None


def default_world_size() -> int:
    """Local ranks when the config names none: one per CPU core, at most 4 (more ranks than
    cores only time-slice; the example minibatches hold 8 samples)."""
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class CheckpointSection:
    every: int = 100  # and always after the last step; 0: never
    keep: int | None = 3
    resume: bool = True
    resume_anyway: bool = False  # resume although the stored run's config differs
    # train.task = "dpo": resume although the reference's weights changed (recomputed from them)
    recompute_reference: bool = False
    export_hf: str | None = None
    async_save: bool = True  # disk checkpoints written in the background (the step waits for a copy)
    memory_every: int = 0  # a /dev/shm snapshot every N steps (0: off); restarts resume from it

    def __post_init__(self) -> None:
        _check_types(self, 'checkpoint')


@dataclass(frozen=True)
class LogSection:
    every: int = 1
    tensorboard: bool = False
    progress: bool = True
    backends: list = field(default_factory=lambda: ["jsonl"])  # odcfn.sft.trackers

    def __post_init__(self) -> None:
        _check_types(self, 'log')


@dataclass(frozen=True)
class LoraSection:
    """``[lora]``: train LoRA adapters on a frozen base (``odcfn.lora.apply``); rank 0: off."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list = field(default_factory=lambda: ["q_proj", "v_proj"])
    use_rslora: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        _check_types(self, "lora")


@dataclass(frozen=True)
class SFTConfig:
    out_dir: str = "runs/sft"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    eval: EvalSection = field(default_factory=EvalSection)
    lora: LoraSection = field(default_factory=LoraSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    rl: RLSection = field(default_factory=RLSection)
    offload: OffloadSection = field(default_factory=OffloadSection)

    def __post_init__(self) -> None:
        t = self.train
        check_key("", "out_dir", self.out_dir, "str")
        if not self.data.path and not self.data.sources:
            raise ValueError("config: data.path (the training data) or [[data.sources]] is required")
        if t.steps < 1:
            raise ValueError(f"config: train.steps is required, an integer >= 1, got {t.steps!r}")
        if t.warmup_steps > t.steps:
            raise ValueError(
                f"config: train.warmup_steps must be <= train.steps ({t.steps}), got {t.warmup_steps}"
            )
        if t.max_restarts and t.backend != "processes":
            raise ValueError(
                f"config: train.max_restarts = {t.max_restarts} needs train.backend = \"processes\" "
                f"(threads of one process cannot be restarted alone), got backend {t.backend!r}"
            )
        if self.data.batch_size < t.world_size:
            # a rank with no sample in a step only idles (it computes nothing and waits its turn)
            raise ValueError(
                f"config: data.batch_size = {self.data.batch_size} is below train.world_size = "
                f"{t.world_size}: {t.world_size - self.data.batch_size} rank(s) would have no sample in "
                "every step; use data.batch_size >= train.world_size (or fewer ranks)"
            )
        check_task(self)
        check_rl_task(self)
        check_data_task(self)
        check_eval(self)
        check_offload(self)
        check_config(self)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.out_dir) / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return Path(self.out_dir) / "metrics.jsonl"
