"""odcfn's parameter names -> the names Hugging Face (and inference engines that load its
checkpoints: vLLM, SGLang) use, for a params tree as ``gather_params`` or ``odcfn.unshard``
return it: ``{unit: {path: tensor}}`` with units ``embed``, ``layers.<i>``, ``head``.

==========================  =====================================================
odcfn ``(unit, path)``      Hugging Face name
==========================  =====================================================
``embed``, ``embed_tokens.weight``          ``model.embed_tokens.weight``
``layers.<i>``, ``self_attn.q_proj.weight``  ``model.layers.<i>.self_attn.q_proj.weight``
``head``, ``norm.weight``                   ``model.norm.weight``
``head``, ``lm_head.weight``                ``lm_head.weight`` (absent when tied)
``layers.<i>.experts.<e>``, ``up_proj.weight``  ``model.layers.<i>.mlp.experts.<e>.up_proj.weight``
==========================  =====================================================

``hf_state_dict(params)`` applies it to a whole tree (what an RL loop pushes to its inference
engine after ``gather_params``); ``hf_name`` maps one leaf (also ``odcfn.models.hf.hf_name``).
``hf_state_dict(params, fused_experts=True)`` gives a mixture's experts in transformers 5's
in-memory layout instead (``mlp.experts.gate_up_proj`` (E, 2I, D), ``mlp.experts.down_proj``
(E, D, I)): what ``load_state_dict`` of a transformers model takes, where the Hub's per-expert
names match nothing (and ``strict=False`` would skip them without a word).

It also remembers where ``from_hf`` read each base from (``record_source``), so that
``odcfn.lora.save_peft`` can write the adapter's ``base_model_name_or_path`` without being told.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from odcfn.tree import tree_flatten_with_path

__all__ = ["hf_name", "hf_state_dict", "record_source", "recorded_source"]


def hf_name(unit: str, path: str) -> str:
    """odcfn ``(unit, path)`` -> the Hugging Face tensor name."""
    if unit == "embed":
        return f"model.{path}"
    if ".experts." in unit:  # layers.{i}.experts.{e}: the Hub's per-expert tensors
        layer, expert = unit.split(".experts.")
        return f"model.{layer}.mlp.experts.{expert}.{path}"
    if unit.startswith("layers."):
        return f"model.{unit}.{path}"
    if unit == "head":
        return f"model.{path}" if path.startswith("norm.") else path
    raise ValueError(f"unit {unit!r} has no Hugging Face name")


def hf_state_dict(params: Mapping[str, Any], *, fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face name -> tensor for a full (unsharded) params tree of a Qwen2/Qwen3/Llama model
    (``gather_params``, ``odcfn.unshard``, ``from_hf``). The tensors are the tree's own (no copy).
    A mixture's experts come one tensor per expert under the Hub's names (checkpoints, vLLM's
    ``load_weights``); ``fused_experts=True``: per sparse layer the two fused tensors a
    transformers 5 model holds in memory (``fuse_experts``; new tensors: a copy of the experts).
    LoRA adapter units have no Hugging Face name: merge them first (``gather_params(...,
    merged=True)`` or ``odcfn.lora.merge``), or write PEFT's names (``odcfn.lora.peft_state_dict``)."""
    if not isinstance(params, Mapping):
        got = type(params).__name__
        raise TypeError(f"hf_state_dict: params must be a mapping of unit -> subtree, got {got}")
    adapters = [u for u in params if u.startswith("lora.")]
    if adapters:
        raise ValueError(
            f"hf_state_dict: units {adapters[:3]} are LoRA adapters, which Hugging Face models lack: "
            "gather merged weights (gather_params(..., merged=True) / odcfn.lora.merge) or use "
            "odcfn.lora.peft_state_dict for PEFT's names"
        )
    out: dict[str, torch.Tensor] = {}
    for unit, tree in params.items():
        names, leaves, _ = tree_flatten_with_path(tree)
        for path, leaf in zip(names, leaves):
            out[hf_name(unit, path)] = leaf
    return fuse_experts(out) if fused_experts else out


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


def fuse_experts(named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` (Hub names) with each sparse layer's per-expert tensors replaced by transformers
    5's fused ``experts.gate_up_proj`` = stack over e of cat(gate_e, up_e) (E, 2I, D) and
    ``experts.down_proj`` = stack of down_e (E, D, I); a ValueError naming a layer whose experts
    are not 0..E-1, each with all three projections."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in named.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
        else:
            layers.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = t
    for base, experts in layers.items():
        E = len(experts)
        if sorted(experts) != list(range(E)) or any(len(p) != 3 for p in experts.values()):
            have = {e: sorted(p) for e, p in sorted(experts.items())}
            raise ValueError(f"hf_state_dict(fused_experts=True): {base[:-1]} needs experts 0..{E - 1} with "
                             f"gate, up and down projections each, got {have}")
        ordered = [experts[e] for e in range(E)]
        out[base + "gate_up_proj"] = torch.stack([torch.cat([p["gate"], p["up"]]) for p in ordered])
        out[base + "down_proj"] = torch.stack([p["down"] for p in ordered])
    return out


# repr(QwenConfig) (a model's config_key) -> the directories from_hf read a base with that config from
_SOURCES: dict[str, set[str]] = {}


def record_source(cfg: Any, path: str | os.PathLike) -> None:
    """Remember that a base with config ``cfg`` was read from directory ``path``."""
    _SOURCES.setdefault(repr(cfg), set()).add(str(Path(path).resolve()))


def recorded_source(config_key: str) -> str | None:
    """The directory the base of a model with ``config_key`` was read from (a LoRA model's key
    names its base's), or None when none was, or when several bases with that config were."""
    found = _SOURCES.get(config_key.rsplit(" lora(", 1)[0], set())
    return next(iter(found)) if len(found) == 1 else None
