"""The ``odcfn train`` run config: frozen dataclasses read from TOML or JSON, and a runnable
example (``odcfn train --init DIR``). The loop itself is in ``odcfn.sft.loop``; the config keys are
listed there. The dataclasses are defined in ``odcfn.sft.config_sections`` (and the ``config_*``
modules of the other sections) and re-exported here; this module reads a file into them."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from odcfn._check import ArgTypeError
from odcfn.sft.config_dpo import DpoSection
from odcfn.sft.config_eval import EvalSection
from odcfn.sft.config_offload import OffloadSection
from odcfn.sft.config_rl import RLSection, RolloutSection
from odcfn.sft.config_sections import (
    CheckpointSection,
    DataSection,
    LogSection,
    LoraSection,
    ModelSection,
    SFTConfig,
    TrainSection,
    check_wire_keys,  # noqa: F401  (re-exported)
    default_world_size,
)
from odcfn.sft.keys import KEYS, check_key
from odcfn.sft.stale_train import check_model

__all__ = [
    "CheckpointSection", "DataSection", "DpoSection", "EvalSection", "LogSection", "LoraSection",
    "OffloadSection",
    "ModelSection",
    "RLSection", "RolloutSection", "SFTConfig", "TrainSection", "config_from_dict", "config_from_stored",
    "load_config",
    "model_config", "check_inputs", "default_world_size",
]

_SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "checkpoint": CheckpointSection,
    "log": LogSection,
    "eval": EvalSection,
    "lora": LoraSection,
    "dpo": DpoSection,
    "rollout": RolloutSection,
    "rl": RLSection,
    "offload": OffloadSection,
}
_PATH_KEYS = {
    ("model", "hf_path"),
    ("data", "path"),
    ("data", "tokenizer"),
    ("data", "cache_dir"),
    ("data", "eval_path"),
    ("checkpoint", "export_hf"),
    ("offload", "path"),
}


def config_from_dict(
    doc: dict[str, Any], *, base_dir: str | os.PathLike = ".", strict: bool = True
) -> SFTConfig:
    """Build an ``SFTConfig``; unknown sections or keys, missing required keys and bad values are
    errors naming them. Relative paths are resolved against ``base_dir`` (the config file's
    directory). ``strict=False``: a stored config (``config_from_stored``)."""
    if not isinstance(doc, dict):
        raise ArgTypeError(f"config: must be a table of sections, got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(_SECTIONS) - {"out_dir"})
    if unknown:
        raise ValueError(f"config: unknown top-level keys {unknown}; known: out_dir, {sorted(_SECTIONS)}")
    if strict:
        _check_document(doc)
    base = Path(base_dir)
    out_dir = doc.get("out_dir", "runs/sft")
    check_key("", "out_dir", out_dir, "str")
    kwargs: dict[str, Any] = {"out_dir": str(base / out_dir)}
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
            if (name, key) in _PATH_KEYS and isinstance(section[key], str):
                section[key] = str(base / section[key])
        if name == "data" and isinstance(section.get("sources"), list):  # each source's path, likewise
            section["sources"] = [{**s, "path": str(base / s["path"])} if isinstance(s, dict) and
                                  isinstance(s.get("path"), str) else s for s in section["sources"]]
        kwargs[name] = cls(**section)
    return SFTConfig(**kwargs)


# [model] keys that a Hugging Face checkpoint's config.json decides: with hf_path they would be
# silently ignored, so a user's file may not give them
_SHAPE_KEYS = tuple(f.name for f in fields(ModelSection) if f.name not in ("hf_path", "seed"))


def _check_document(doc: dict[str, Any]) -> None:
    """What a user's file must say that the dataclasses cannot see once defaults are filled in:
    required keys, a ``[lora]`` section with its rank, no model shape next to ``hf_path``."""
    for name in _SECTIONS:
        if name in doc and not isinstance(doc[name], dict):
            got = f"{type(doc[name]).__name__} {doc[name]!r}"
            raise ArgTypeError(f"config: [{name}] must be a table, got {got}")
    for section, key in (("data", "path"), ("train", "steps")):
        if section == "data" and "sources" in doc.get("data", {}):
            continue  # the sources are the data
        if key not in doc.get(section, {}):
            what = KEYS[(section, key)].doc.split(": ", 1)[1]
            raise ValueError(f"config: {section}.{key} is required ({what})")
    if "lora" in doc and "rank" not in doc["lora"]:
        raise ValueError(
            "config: lora.rank is required in a [lora] section (the adapter rank, e.g. 16; without it "
            "the run would be full fine-tuning: remove [lora] for that)"
        )
    model = doc.get("model", {})
    given = [k for k in _SHAPE_KEYS if k in model]
    if model.get("hf_path") is not None and given:
        raise ValueError(
            f"config: model.hf_path is given, so model.{given[0]} must be left out (the model's shape "
            f"comes from {model['hf_path']}/config.json); remove {', '.join('model.' + k for k in given)}"
        )


def config_from_stored(doc: dict[str, Any]) -> SFTConfig:
    """The ``SFTConfig`` a checkpoint stored (``asdict`` form: every key present, paths already
    resolved), read without the checks that only a user's own file needs."""
    doc = {k: dict(v) if isinstance(v, dict) else v for k, v in doc.items()}
    if isinstance(doc.get("model"), dict) and doc["model"].get("hf_path") is not None:
        for key in _SHAPE_KEYS:
            doc["model"].pop(key, None)
    return config_from_dict(doc, strict=False)


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
        cfg = config_from_dict(doc, base_dir=path.parent)
        check_inputs(cfg)
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"{path}: {e}") from None
    return cfg


def check_inputs(cfg: SFTConfig) -> None:
    """What the config names must exist and fit: the data file, the tokenizer and HF model
    directories, and a model that ``[model]`` describes consistently (a ValueError naming the key)."""
    d, m = cfg.data, cfg.model
    from odcfn.sft.config_data import check_data_paths

    check_data_paths(cfg)
    from odcfn.sft.trackers import check_installed

    check_installed(cfg.log)
    if d.tokenizer is not None and not Path(d.tokenizer).is_dir():
        raise ValueError(f"config: data.tokenizer {d.tokenizer} is not a directory (a local tokenizer "
                         "directory with tokenizer.json / tokenizer_config.json)")
    if m.hf_path is not None and not (Path(m.hf_path) / "config.json").is_file():
        raise ValueError(f"config: model.hf_path {m.hf_path} has no config.json (a local Hugging Face "
                         "model directory)")
    try:
        qcfg = model_config(cfg)
    except (ValueError, TypeError) as e:
        where = "model.hf_path's config.json" if m.hf_path else "[model]"
        raise ValueError(f"config: {where} does not describe a model odcfn builds: {e}") from None
    from odcfn.models import qwen_model

    model = qwen_model(qcfg)  # no weights: the unit names the keys below are checked against
    if cfg.lora.rank:
        try:
            from odcfn import lora

            model = lora.apply(model, {}, rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                               targets=tuple(cfg.lora.targets))[0]
        except ValueError as e:
            raise ValueError(f"config: lora.targets {cfg.lora.targets}: {e}") from None
    check_model(cfg, model)
    if cfg.train.task == "rl":  # the reward resolves, the engine is installed
        from odcfn.sft.config_rl import check_rl_inputs

        check_rl_inputs(cfg)


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
