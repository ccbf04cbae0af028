"""PEFT's adapter format: ``adapter_model.safetensors`` + ``adapter_config.json``.

Keys are PEFT's: ``base_model.model.<module path>.lora_A.weight`` (r x d_in) and ``lora_B.weight``
(d_out x r), module paths as transformers names them (``model.layers.0.self_attn.q_proj``).
``peft.PeftModel.from_pretrained(hf_model, path)`` loads what ``save_peft`` writes, and
``load_peft`` reads what PEFT saves, refusing the LoRA features odcfn does not implement.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from odcfn.lora.core import adapter_units, peft_names, spec
from odcfn.lora.sync import gather_adapters
from odcfn.model import Model
from odcfn.step.state import TrainState
from odcfn.tree import PyTree, tree_flatten_with_path, tree_unflatten

__all__ = ["load_peft", "load_peft_tensors", "peft_state_dict", "save_peft", "write_peft"]

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def _leaf(tree: PyTree, path: str) -> torch.Tensor:
    for k in path.split("."):
        tree = tree[k]
    return tree


def peft_state_dict(model: Model, adapters: Mapping[str, PyTree]) -> dict[str, torch.Tensor]:
    """PEFT key -> tensor, from the adapter units' full params (``gather_adapters`` or params)."""
    names = peft_names(model)
    return {key: _leaf(adapters[unit], path).detach().contiguous().clone() for unit, path, key in names}


def _config(model: Model, base_model_name_or_path: str | None) -> dict[str, Any]:
    s = spec(model)
    alpha = int(s.alpha) if float(s.alpha).is_integer() else s.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": s.rank, "lora_alpha": alpha,
        "target_modules": sorted(s.targets), "lora_dropout": s.dropout, "bias": "none",
        "use_rslora": s.use_rslora, "use_dora": False, "fan_in_fan_out": False,
        "init_lora_weights": True, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True,
        "base_model_name_or_path": base_model_name_or_path, "revision": None,
    }


def save_peft(
    path: str | os.PathLike, state: TrainState, *, base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write the state's adapters in PEFT's format to directory ``path``. Every rank calls it
    (the adapter shards are gathered to rank 0, one sync); rank 0 writes and returns the path,
    the others return None. ``base_model_name_or_path`` (adapter_config.json): given, or the
    directory ``from_hf`` / ``shard_from_hf`` read the base from (see ``write_peft``)."""
    if not isinstance(state, TrainState):
        raise TypeError(f"save_peft(path, state): state must be a TrainState, got {type(state).__name__}")
    if not adapter_units(state.model):
        raise ValueError("save_peft: the state's model has no LoRA adapters (odcfn.lora.apply)")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"save_peft: dtype must be a floating torch.dtype or None, got {dtype!r}")
    adapters = gather_adapters(state, dst=0, dtype=state.model.dtype)  # the file keeps full precision
    if adapters is None:
        return None
    base = base_model_name_or_path
    return write_peft(path, state.model, adapters, base_model_name_or_path=base, dtype=dtype)


def write_peft(
    path: str | os.PathLike, model: Model, adapters: Mapping[str, PyTree], *,
    base_model_name_or_path: str | None = None, dtype: torch.dtype | None = None,
) -> Path:
    """Write full adapter params (``{"lora.<unit>": subtree}``) of LoRA ``model`` as a PEFT
    directory. ``base_model_name_or_path``: what ``AutoPeftModelForCausalLM`` loads the base
    from; by default the directory ``odcfn.models.from_hf`` / ``shard_from_hf`` read this
    model's base from (with none known, PEFT's loaders need the base passed to them)."""
    from odcfn.models.hf_names import recorded_source

    if base_model_name_or_path is None:
        base_model_name_or_path = recorded_source(model.config_key)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = peft_state_dict(model, adapters)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(root / WEIGHTS), metadata={"format": "pt"})
    (root / CONFIG).write_text(json.dumps(_config(model, base_model_name_or_path), indent=2))
    return root


# PEFT fields whose non-default values change the math: refused rather than ignored
_UNSUPPORTED = {
    "use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
    "modules_to_save": (None, ()), "layers_to_transform": (None,), "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None), "use_qalora": (False, None), "lora_bias": (False, None),
    "trainable_token_indices": (None,), "target_parameters": (None, ()),
}


def _check_config(cfg: Any, where: Path, model: Model) -> None:
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type={cfg.get('peft_type')!r}, only 'LORA' adapters load")
    for field, ok in _UNSUPPORTED.items():
        v = cfg.get(field)
        if field in cfg and not any(v == o or (o == () and v == []) for o in ok):
            raise ValueError(f"{where}: {field}={v!r} is not implemented by odcfn.lora (needs {ok[0]!r})")
    s = spec(model)
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list):
        raise ValueError(f"{where}: target_modules={targets!r}: only a list of projection names is supported")
    got = {
        "r": (cfg.get("r"), s.rank), "lora_alpha": (cfg.get("lora_alpha"), s.alpha),
        "use_rslora": (bool(cfg.get("use_rslora", False)), s.use_rslora),
        "target_modules": (sorted(targets), sorted(s.targets)),
    }
    for field, (v, want) in got.items():
        same = v == want if field != "lora_alpha" else isinstance(v, (int, float)) and math.isclose(v, want)
        if not same:
            raise ValueError(
                f"{where}: {field}={v!r} but the model was built with {want!r} "
                "(odcfn.lora.apply the base with the adapter's r, lora_alpha, target_modules, use_rslora)"
            )


def load_peft(path: str | os.PathLike, model: Model, params: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """``params`` with the adapters of PEFT directory ``path`` (odcfn's ``save_peft`` or PEFT's
    ``save_pretrained``); ``model`` is the LoRA model (``odcfn.lora.apply`` with the adapter's
    settings). Unsupported PEFT features, mismatched settings, missing or extra keys and wrong
    shapes raise a ValueError naming the file and field or key."""
    if not isinstance(model, Model):
        raise TypeError(f"load_peft: model must be an odcfn.Model, got {type(model).__name__}")
    if not adapter_units(model):
        raise ValueError("load_peft: the model has no LoRA adapters: odcfn.lora.apply the base model first")
    root = Path(path)
    cfg_file, weights = root / CONFIG, root / WEIGHTS
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"load_peft: {f} does not exist")
    try:
        cfg = json.loads(cfg_file.read_text())
    except ValueError as e:
        raise ValueError(f"{cfg_file}: not JSON ({e})") from None
    _check_config(cfg, cfg_file, model)
    with safe_open(str(weights), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return load_peft_tensors(model, params, tensors, where=weights)


def load_peft_tensors(
    model: Model, params: Mapping[str, PyTree], tensors: Mapping[str, torch.Tensor], *,
    where: Any = "adapters",
) -> dict[str, PyTree]:
    """``params`` with the adapters given as PEFT-keyed tensors (``...lora_A.weight``; PEFT's
    in-memory ``...lora_A.default.weight`` too)."""
    want = {key: (unit, leaf) for unit, leaf, key in peft_names(model)}
    names = {k.replace(".default.weight", ".weight"): k for k in tensors}
    missing, extra = sorted(set(want) - set(names)), sorted(set(names) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: missing keys {missing[:4]}, unexpected keys {extra[:4]}")
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for key, (unit, leaf) in want.items():
        loaded.setdefault(unit, {})[leaf] = tensors[names[key]]
    out = dict(params)
    for unit, leaves in loaded.items():
        paths, shapes, treedef = tree_flatten_with_path(model.unit(unit).shapes)
        vals = []
        for p, shape in zip(paths, shapes):
            t = leaves[p]
            if tuple(t.shape) != tuple(shape):
                key = next(k for k, v in want.items() if v == (unit, p))
                raise ValueError(
                    f"{where}: {key} has shape {tuple(t.shape)}, the model expects {tuple(shape)}"
                )
            vals.append(t.detach().to(model.dtype).clone())
        out[unit] = tree_unflatten(treedef, vals)
    return out
