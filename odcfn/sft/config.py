"""The ``odcfn train`` run config: frozen dataclasses read from TOML or JSON, and a runnable
example (``odcfn train --init DIR``). The loop itself is in ``odcfn.sft.loop``; the config keys are
listed there."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from odcfn._check import ArgTypeError, is_int, is_number
from odcfn.optim import DECAY_MASKS

__all__ = [
    "CheckpointSection",
    "DataSection",
    "LogSection",
    "LoraSection",
    "ModelSection",
    "SFTConfig",
    "TrainSection",
    "config_from_dict",
    "load_config",
    "model_config",
    "default_world_size",
]


# a bool is an int to Python: True must not pass for a step count
_TYPES = {
    "int": is_int,
    "float": is_number,
    "str": lambda v: isinstance(v, str),
    "bool": lambda v: v is True or v is False,
}


def _check_types(section: Any, name: str) -> None:
    """Each field's value has its annotated type (``X | None`` allows None): a config value of
    the wrong type fails when the config is read, naming the field, not at some later step."""
    for f in fields(section):
        value, kinds = getattr(section, f.name), [k.strip() for k in str(f.type).split("|")]
        if value is None and "None" in kinds:
            continue
        known = [_TYPES[k] for k in kinds if k in _TYPES]
        if not known or any(ok(value) for ok in known):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"config: {name}.{f.name} must be finite, got {value!r}")
            continue
        want = " or ".join(k for k in kinds)
        raise ArgTypeError(f"config: {name}.{f.name} must be {want}, got {type(value).__name__} {value!r}")


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

    def __post_init__(self) -> None:
        _check_types(self, 'data')


@dataclass(frozen=True)
class TrainSection:
    steps: int = 0
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
    max_restarts: int = 0  # backend "processes": restart the ranks this often after a failure

    def __post_init__(self) -> None:
        # resolved here, so a checkpoint's stored config names what the run actually used
        if self.balance is None:
            object.__setattr__(self, "balance", "lb_micro" if self.comm == "collective" else "lb_mini")
        if self.world_size is None:
            object.__setattr__(self, "world_size", default_world_size())
        _check_types(self, 'train')


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
        t = self.targets
        if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
            raise ValueError(f"config: lora.targets must be a non-empty list of projection names, got {t!r}")
        if self.rank < 0:
            raise ValueError(f"config: lora.rank must be >= 1 (0: no LoRA), got {self.rank!r}")
        if self.rank and not self.alpha > 0:
            raise ValueError(f"config: lora.alpha must be > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"config: lora.dropout must be in [0, 1), got {self.dropout!r}")


@dataclass(frozen=True)
class SFTConfig:
    out_dir: str = "runs/sft"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    lora: LoraSection = field(default_factory=LoraSection)

    def __post_init__(self) -> None:
        t = self.train
        if not self.data.path:
            raise ValueError("config: data.path is required")
        if not isinstance(t.steps, int) or t.steps < 1:
            raise ValueError(f"config: train.steps must be a positive int, got {t.steps!r}")
        for key, value, allowed in [
            ("train.schedule", t.schedule, ("constant", "cosine")),
            ("train.optimizer", t.optimizer, ("adamw", "sgd")),
            ("train.weight_decay_mask", t.weight_decay_mask, tuple(DECAY_MASKS)),
            ("train.comm", t.comm, ("odc", "collective")),
            ("train.compute_dtype", t.compute_dtype, ("float32", "bfloat16")),
            ("train.backend", t.backend, ("threads", "processes")),
            ("data.long_samples", self.data.long_samples, ("error", "truncate", "drop")),
        ]:
            if value not in allowed:
                raise ValueError(f"config: {key} must be one of {list(allowed)}, got {value!r}")
        if not isinstance(t.world_size, int) or t.world_size < 1:
            raise ValueError(f"config: train.world_size must be a positive int, got {t.world_size!r}")
        if self.checkpoint.every < 0 or self.log.every < 1:
            raise ValueError("config: checkpoint.every must be >= 0 and log.every >= 1")
        if self.checkpoint.memory_every < 0 or t.max_restarts < 0:
            raise ValueError("config: checkpoint.memory_every and train.max_restarts must be >= 0")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.out_dir) / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return Path(self.out_dir) / "metrics.jsonl"


_SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "checkpoint": CheckpointSection,
    "log": LogSection,
    "lora": LoraSection,
}
_PATH_KEYS = {
    ("model", "hf_path"),
    ("data", "path"),
    ("data", "tokenizer"),
    ("data", "cache_dir"),
    ("checkpoint", "export_hf"),
}


def config_from_dict(doc: dict[str, Any], *, base_dir: str | os.PathLike = ".") -> SFTConfig:
    """Build an ``SFTConfig``; unknown sections or keys are errors naming them. Relative paths
    are resolved against ``base_dir`` (the config file's directory)."""
    unknown = sorted(set(doc) - set(_SECTIONS) - {"out_dir"})
    if unknown:
        raise ValueError(f"config: unknown top-level keys {unknown}; known: out_dir, {sorted(_SECTIONS)}")
    base = Path(base_dir)
    kwargs: dict[str, Any] = {"out_dir": str(base / doc.get("out_dir", "runs/sft"))}
    for name, cls in _SECTIONS.items():
        section = dict(doc.get(name, {}))
        known = {f.name for f in fields(cls)}
        bad = sorted(set(section) - known)
        if bad:
            import difflib

            close = {k: difflib.get_close_matches(k, known, n=1) for k in bad}
            hint = "".join(f" ({k!r}: did you mean {c[0]!r}?)" for k, c in close.items() if c)
            raise ValueError(f"config: unknown keys {bad} in [{name}]{hint}; known: {sorted(known)}")
        for key in section:
            if (name, key) in _PATH_KEYS and section[key] is not None:
                section[key] = str(base / section[key])
        kwargs[name] = cls(**section)
    return SFTConfig(**kwargs)


def load_config(path: str | os.PathLike) -> SFTConfig:
    """Read a ``.toml`` or ``.json`` config file; every error names the file."""
    path = Path(path)
    if path.suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ImportError(f"reading {path} on Python 3.10 needs tomli: pip install tomli") from None
        parse = tomllib.loads
    elif path.suffix == ".json":
        parse = json.loads
    else:
        raise ValueError(f"{path}: config must be .toml or .json")
    try:
        doc = parse(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise ValueError(f"{path}: cannot parse the config: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: the config must be a table/object, got {type(doc).__name__}")
    try:
        return config_from_dict(doc, base_dir=path.parent)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def model_config(cfg: SFTConfig) -> Any:
    """The run's ``QwenConfig``: read from ``model.hf_path``'s config.json, or built from
    ``[model]`` (which names QwenConfig's fields, plus ``hf_path`` and ``seed``)."""
    from odcfn.models import QwenConfig

    m = cfg.model
    if m.hf_path:
        from odcfn.models.hf_config import config_from_hf

        path = Path(m.hf_path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model.hf_path: {path} does not exist (a Hugging Face model directory)")
        return config_from_hf(json.loads(path.read_text()))
    return QwenConfig(**{f.name: getattr(m, f.name) for f in fields(QwenConfig) if hasattr(m, f.name)})
