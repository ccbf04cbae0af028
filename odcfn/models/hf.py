"""Local Hugging Face Qwen2/2.5, Qwen3, Llama 3.x, Qwen3-MoE and Qwen2-MoE checkpoints <-> the params
pytree of ``qwen_model``.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or several
``*.safetensors`` files listed by ``model.safetensors.index.json``. Nothing is downloaded.

Name mapping (HF -> odcfn): ``model.embed_tokens.*`` -> ``embed.embed_tokens.*``,
``model.layers.{i}.*`` -> ``layers.{i}.*`` (same names below), ``model.norm.*`` -> ``head.norm.*``,
``lm_head.*`` -> ``head.lm_head.*``, and an expert unit ``layers.{i}.experts.{e}.*`` ->
``model.layers.{i}.mlp.experts.{e}.*`` (the Hub's layout, which ``to_hf`` writes; transformers 5's
fused ``gate_up_proj``/``down_proj`` are read too: ``odcfn.models.hf_moe``). All use the
rotate-half RoPE layout, so q/k weights need no permutation. ``config.json`` is translated by
``odcfn.models.hf_config``. Tied embeddings (``tie_word_embeddings``) stay tied: the model has no
``head.lm_head`` (the head uses the embedding), ``to_hf`` writes no ``lm_head.weight``; a tied
checkpoint that stores a copy of it anyway loads only if the copy equals the embedding.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from odcfn.models.hf_config import config_from_hf, config_to_hf
from odcfn.models.hf_moe import unfuse
from odcfn.models.hf_names import hf_name, record_source
from odcfn.models.qwen import QwenConfig, QwenMoeConfig, qwen_model, unit_shapes
from odcfn.sharding import Mesh, make_layout
from odcfn.tree import tree_flatten_with_path, tree_unflatten

__all__ = ["config_from_hf", "config_to_hf", "from_hf", "hf_name", "shard_from_hf", "to_hf"]


def _read_tensors(root: Path) -> dict[str, Any]:
    """HF tensor name -> an open safetensors handle that holds it."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{index}: not a safetensors index (a JSON object with 'weight_map')") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to file names")
        files = sorted(set(weight_map.values()))
        absent = [n for n in files if not (root / n).is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists {absent[0]!r}, which is not in {root}")
    elif (root / "model.safetensors").exists():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{root} has neither model.safetensors nor model.safetensors.index.json")
    where: dict[str, Any] = {}
    for name in files:
        f = safe_open(str(root / name), framework="pt")
        for key in f.keys():
            if weight_map is None or weight_map.get(key) == name:
                where[key] = f
    if weight_map is not None:
        lost = sorted(k for k, n in weight_map.items() if k not in where)
        if lost:
            raise ValueError(f"{index}: {lost[0]!r} is mapped to {weight_map[lost[0]]!r}, which lacks it")
    return where


def _resolve(path: str | os.PathLike) -> tuple[QwenConfig, dict[str, Any], dict[str, list]]:
    """Config, tensor locations, and per unit ``[(path, hf name, shape)]`` in flat-layout order,
    all checked (missing, misshapen or unused tensors) before any weight is read."""
    root = Path(path)
    cfg_file = root / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} does not exist (expected a Hugging Face model directory)")
    hf_cfg = json.loads(cfg_file.read_text())
    cfg = config_from_hf(hf_cfg)
    where = _read_tensors(root)
    if isinstance(cfg, QwenMoeConfig):  # fused experts -> per-expert views under the Hub's names
        where = unfuse(where, cfg, root)
    names: dict[str, list] = {}
    used = set()
    for unit, shapes in unit_shapes(cfg).items():
        paths, leaves, _ = tree_flatten_with_path(shapes)
        names[unit] = []
        for p, shape in zip(paths, leaves):
            name = hf_name(unit, p)
            if name not in where:
                raise ValueError(f"{root}: tensor {name!r} (for {unit}.{p}) is missing")
            got = tuple(where[name].get_slice(name).get_shape())
            if got != tuple(shape):
                raise ValueError(
                    f"{root}: tensor {name!r} has shape {got}, config.json implies {tuple(shape)}"
                )
            names[unit].append((p, name, tuple(shape)))
            used.add(name)
    if cfg.tie_embeddings and "lm_head.weight" in where:  # some tied checkpoints store a copy
        head, emb = (where[n].get_tensor(n) for n in ("lm_head.weight", "model.embed_tokens.weight"))
        if not torch.equal(head, emb):
            raise ValueError(
                f"{root}: config.json has tie_word_embeddings=true but lm_head.weight differs from "
                "model.embed_tokens.weight: set it to false to load an untied model"
            )
        used.add("lm_head.weight")
    unused = sorted(k for k in where if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(
            f"{root}: tensors the model does not use: {unused[:5]}{'...' if len(unused) > 5 else ''}"
        )
    return cfg, where, names


def from_hf(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> tuple[QwenConfig, dict]:
    """Load a local HF Qwen2/Qwen3/Llama or Qwen3-MoE/Qwen2-MoE checkpoint: ``(config, params)``
    for ``qwen_model(config)``."""
    cfg, where, names = _resolve(path)
    record_source(cfg, path)  # save_peft's base_model_name_or_path
    params = {}
    for unit, shapes in unit_shapes(cfg).items():
        treedef = tree_flatten_with_path(shapes)[2]
        leaves = [where[n].get_tensor(n).to(dtype).clone() for _, n, _ in names[unit]]
        params[unit] = tree_unflatten(treedef, leaves)
    return cfg, params


def shard_from_hf(
    path: str | os.PathLike, mesh: Mesh, *, dtype: torch.dtype = torch.float32
) -> tuple[QwenConfig, dict[str, torch.Tensor]]:
    """This rank's flat shards, equal to ``shard(from_hf(path)[1], qwen_model(cfg), mesh)``, read
    without materialising the full model: only the rows that overlap the rank's range."""
    cfg, where, names = _resolve(path)
    record_source(cfg, path)
    layout = make_layout(qwen_model(cfg), mesh)
    shards = {}
    for u in layout.units:
        lo, hi = u.shard_range(mesh.shard_index)
        shard = torch.zeros(u.shard_size, dtype=dtype)  # the padding stays zero
        off = 0
        for (_, name, shape), n in zip(names[u.name], u.numels):
            a, b = max(lo, off) - off, min(hi, off + n) - off  # overlap, in leaf-flat coordinates
            if a < b:
                row = math.prod(shape[1:])  # 1 for a vector
                r0, r1 = a // row, (b - 1) // row + 1
                rows = where[name].get_slice(name)[r0:r1].reshape(-1)
                shard[off + a - lo : off + b - lo] = rows[a - r0 * row : b - r0 * row].to(dtype)
            off += n
        shards[u.name] = shard
    return cfg, shards


def to_hf(
    path: str | os.PathLike,
    params: dict,
    cfg: QwenConfig,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``params`` (unsharded) as an HF checkpoint: ``config.json`` + safetensors, split
    into files of at most ``max_shard_bytes`` with an index when given."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    extra = [u for u in params if u not in unit_shapes(cfg)]
    if extra:  # LoRA adapters would be silently dropped: fold them in first
        raise ValueError(
            f"to_hf: params have units {extra[:4]} the config does not (LoRA adapters? export "
            "odcfn.lora.merge(model, params), or save them with odcfn.lora.save_peft)"
        )
    for unit, shapes in unit_shapes(cfg).items():
        if unit not in params:
            raise ValueError(f"params lack unit {unit!r} required by the config")
        want, _, _ = tree_flatten_with_path(shapes)
        names, leaves, _ = tree_flatten_with_path(params[unit])
        if names != want:
            raise ValueError(f"params[{unit!r}] has leaves {names}, the config implies {want}")
        for p, t in zip(names, leaves):
            t = t.detach()
            tensors[hf_name(unit, p)] = (t if dtype is None else t.to(dtype)).contiguous().clone()
    out_dtype = dtype or next(iter(tensors.values())).dtype
    (root / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype=out_dtype), indent=2))
    if max_shard_bytes is None:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        _ordinary_permissions(root)
        return root
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, str(root / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(g, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _ordinary_permissions(root)
    return root


def _ordinary_permissions(root: Path) -> None:
    """safetensors creates its files owner-only (0600); an exported model is meant to be read by
    whoever serves it: the permissions any new file gets here (0666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    for f in root.iterdir():
        if f.is_file() and f.suffix == ".safetensors":
            os.chmod(f, 0o666 & ~umask)
