"""The ``odcfn train`` config reference, written from the config's own definition: the dataclass
fields (type, default) of ``odcfn.sft.config`` and the rules (allowed values, meaning) of
``odcfn.sft.keys.KEYS``. ``docs/config.md`` is ``config_markdown()`` (a test keeps them equal;
``python -m odcfn.sft.reference > docs/config.md`` rewrites it) and ``odcfn train --init``
writes ``config_toml(...)``: every section and key, with a one-line comment each."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from typing import Any

from odcfn.sft.config import (
    CheckpointSection,
    DataSection,
    DpoSection,
    EvalSection,
    LogSection,
    LoraSection,
    ModelSection,
    OffloadSection,
    RLSection,
    RolloutSection,
    TrainSection,
)
from odcfn.sft.keys import KEYS, describe

__all__ = ["SECTIONS", "config_markdown", "config_toml", "defaults"]

SECTIONS = {"model": ModelSection, "data": DataSection, "train": TrainSection,
            "checkpoint": CheckpointSection, "log": LogSection, "eval": EvalSection,
            "lora": LoraSection, "dpo": DpoSection, "rollout": RolloutSection, "rl": RLSection,
            "offload": OffloadSection}

# defaults that TrainSection resolves when the file leaves them unset (shown as unset, with why)
_RESOLVED = {("train", "balance"), ("train", "world_size")}


def defaults() -> dict[tuple[str, str], tuple[Any, str]]:
    """``(section, key) -> (default, annotation)`` for every key, top level (``""``) included."""
    out: dict[tuple[str, str], tuple[Any, str]] = {("", "out_dir"): ("runs/sft", "str")}
    for name, cls in SECTIONS.items():
        for f in fields(cls):
            value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
            out[(name, f.name)] = (value, str(f.type))
    return out


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else json.dumps(value)


def _shown(name: str, key: str, default: Any, written: str) -> str:
    if KEYS[(name, key)].doc.startswith("REQUIRED"):
        return "none, required"
    return "unset" if default is None or (name, key) in _RESOLVED else written


def config_toml(values: dict[tuple[str, str], Any] | None = None, *, header: str = "") -> str:
    """A TOML config with every section and key: ``values`` where given, else the default; a
    key that is unset stays a comment. Each key's comment is its meaning and its default."""
    values = values or {}
    lines = [header.rstrip("\n")] if header else []
    section = None
    for (name, key), (default, _) in defaults().items():
        if name != section:
            section = name
            if name:
                lines += ["", f"[{name}]"]
        value = values.get((name, key), default)
        shown = _shown(name, key, default, _toml(default))
        comment = f"# {KEYS[(name, key)].doc} (default: {shown})"
        if value is None:
            lines.append(f"# {key} = ...  {comment}")
        else:
            lines.append(f"{key} = {_toml(value)}  {comment}")
    return "\n".join(lines) + "\n"


def config_markdown() -> str:
    """``docs/config.md``: one table per section of key, allowed values, default and meaning."""
    out = [
        "# `odcfn train` config reference",
        "",
        "Generated from the config's definition (`odcfn/sft/config_*.py` for types and defaults,",
        "`odcfn/sft/keys.py` for allowed values and meanings) by `python -m odcfn.sft.reference`;",
        "a test keeps this page equal to it. Every value is checked when the file is read: a bad one",
        "ends `odcfn train` with one line naming the file, the key and what it allows (exit status 2).",
        "`odcfn train --init DIR` writes a runnable `run.toml` with every key below.",
        "",
        "Relative paths are relative to the config file. `data.path` and `train.steps` are required;",
        "a `[lora]` section requires `rank`; with `model.hf_path` the model's shape keys must be left",
        "out; `train.warmup_steps` may not exceed `train.steps`; `train.max_restarts` needs",
        '`train.backend = "processes"`. `train.task = "dpo"` trains on preference pairs with the',
        "`[dpo]` loss (docs/preference.md) and needs `data.tokenizer`; with `train.task = \"sft\"`",
        "the `[dpo]` keys must keep their defaults. `train.task = \"rl\"` trains on prompts with",
        "rollouts from `[rollout]` and the rewards and loss of `[rl]` (`train.steps` counts iterations,",
        "`data.batch_size` prompts each) and needs `data.tokenizer`; with another task the `[rollout]` and",
        "`[rl]` keys must keep their defaults. `train.staleness` >= 1 cannot be combined with",
        '`train.comm = "collective"`, `train.max_grad_norm`,',
        '`train.expert_bias_rate`, `train.task = "dpo"` or `data.skip_empty_minibatches`, and each',
        "pattern of a `[train.staleness]` table must match a unit of the model (docs/staleness.md).",
        "`offload.budget_gib` > 0 (docs/memory.md) needs `offload.path` to be a writable directory",
        "(or unset: host memory) and cannot be combined with `train.staleness` >= 1.",
    ]
    section = None
    for (name, key), (default, annotation) in defaults().items():
        if name != section:
            section = name
            out += ["", f"## {'[' + name + ']' if name else 'top level'}", "",
                    "| key | allowed | default | meaning |", "|---|---|---|---|"]
        shown = _shown(name, key, default, f"`{_toml(default)}`")
        allowed = describe(name, key, annotation).replace("|", "\\|")
        out.append(f"| `{key}` | {allowed} | {shown} | {KEYS[(name, key)].doc} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(config_markdown(), end="")
