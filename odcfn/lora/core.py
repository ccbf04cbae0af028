"""``apply`` (a model + params -> the LoRA model + params), ``merge`` and the model's LoRA spec."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from odcfn._check import check_int, check_number
from odcfn.lora.dropout import dropout_mask, dropout_plan
from odcfn.model import Model, Unit
from odcfn.tree import PyTree, tree_flatten_with_path

__all__ = [
    "LoraSpec", "adapter_units", "apply", "apply_to_shards", "base_model", "dropout_mask", "merge", "spec",
]

PREFIX = "lora."  # adapter unit of unit u: "lora.u"


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    dropout: float = 0.0
    seed: int = 0

    @property
    def scale(self) -> float:
        """PEFT's ``scaling``: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True)
class _Passthrough:
    """The adapter unit's fwd: x unchanged (its weights are read by the unit it serves). The
    plan never gathers the unit for its own steps (``passthrough``)."""

    passthrough = True  # a class attribute, not a field
    spec: LoraSpec
    base: str  # the unit whose projections the adapters extend
    paths: tuple[str, ...]  # the projections' paths inside that unit ("self_attn.q_proj")

    def __call__(self, p: PyTree, x: Any, mb: Any) -> Any:
        return x


@dataclass(frozen=True)
class _LoraUnit:
    """The adapted unit's fwd: its own fwd on params whose targeted projection dicts carry
    ``lora_A``/``lora_B``/``lora_scale`` (``odcfn.models.qwen.linear`` adds the low-rank term)
    and, when training with dropout, ``lora_drop`` (a ``DropoutPlan``: the A path's input
    dropped and multiplied by A, its mask drawn tile by tile)."""

    fwd: Any
    adapter: str
    paths: tuple[str, ...]
    scale: float
    original: Unit  # the unit before LoRA (``base_model``)
    dropout: float = 0.0
    seed: int = 0

    def _drop(self, path: str, mb: Any) -> dict:
        """PEFT's dropout on the A path's input, training only (``Microbatch.step`` set): the
        per-sample masks of ``dropout_mask`` end to end, in the microbatch's sample order, as a
        plan that draws them tile by tile (``lora/dropout.py``), never whole."""
        if not self.dropout or getattr(mb, "step", None) is None:
            return {}
        plan = dropout_plan(self.dropout, seed=self.seed, step=mb.step, unit=self.original.name, path=path,
                            samples=mb.sample_ids, lengths=mb.seqlens)
        return {"lora_drop": plan}

    def __call__(self, p: PyTree, x: Any, mb: Any) -> Any:
        p = dict(p)
        ad = p.pop(self.adapter)
        for path in self.paths:
            keys = path.split(".")
            node, src = p, ad
            for k in keys[:-1]:  # copy the dicts on the way: the caller's tree is not mutated
                node[k] = dict(node[k])
                node, src = node[k], src[k]
            drop = self._drop(path, mb)
            node[keys[-1]] = {**node[keys[-1]], **src[keys[-1]], "lora_scale": self.scale, **drop}
        return self.fwd(p, x, mb)


def _projections(shapes: PyTree, targets: set[str]) -> list[tuple[str, int, int]]:
    """``(path, d_out, d_in)`` of each dict under a targeted key with a 2-D ``weight``."""
    out: list[tuple[str, int, int]] = []

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if not isinstance(node, Mapping):
            return
        for k in sorted(node):
            v = node[k]
            w = v.get("weight") if isinstance(v, Mapping) else None
            if k in targets and isinstance(w, torch.Size) and len(w) == 2:
                out.append((".".join((*path, k)), int(w[0]), int(w[1])))
            else:
                walk(v, (*path, k))

    walk(shapes, ())
    return out


def _all_projection_names(model: Model) -> list[str]:
    names: set[str] = set()
    for u in model.units:
        if u.name.startswith("layers."):
            names.update(p.rsplit(".", 1)[-1] for p, _, _ in _projections(u.shapes, _AnyKey()))
    return sorted(names)


class _AnyKey(set):
    def __contains__(self, k: object) -> bool:
        return True


def _check(rank: Any, alpha: Any, targets: Any, dropout: Any, use_rslora: Any, seed: Any) -> tuple[str, ...]:
    check_int(rank, "lora.apply: rank", at_least=1)
    check_number(alpha, "lora.apply: alpha", positive=True)
    if isinstance(targets, str):
        targets = (targets,)
    if not isinstance(targets, Sequence) or not targets or not all(isinstance(t, str) for t in targets):
        raise TypeError(
            f"lora.apply: targets must be a non-empty sequence of projection names, got {targets!r}"
        )
    check_number(dropout, "lora.apply: dropout", at_least=0.0, want="a number in [0, 1)")
    if not dropout < 1:
        raise ValueError(f"lora.apply: dropout must be a number in [0, 1), got {dropout!r}")
    if not isinstance(use_rslora, bool):
        raise TypeError(f"lora.apply: use_rslora must be a bool, got {use_rslora!r}")
    check_int(seed, "lora.apply: seed")
    return tuple(dict.fromkeys(targets))


def apply(
    model: Model,
    params: Mapping[str, PyTree],
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str] = ("q_proj", "v_proj"),
    dropout: float = 0.0,
    use_rslora: bool = False,
    seed: int = 0,
) -> tuple[Model, dict[str, PyTree]]:
    """The LoRA model (base units frozen, adapter units trained) and its params (the base
    tensors themselves plus fresh adapters: A as PEFT draws it from ``seed``, B zero)."""
    if not isinstance(model, Model):
        raise TypeError(f"lora.apply: model must be an odcfn.Model, got {type(model).__name__}")
    if adapter_units(model):
        raise ValueError("lora.apply: the model already has LoRA adapters (apply it to the base model)")
    if not isinstance(params, Mapping):
        raise TypeError(f"lora.apply: params must be a dict keyed by unit name, got {type(params).__name__}")
    targets = _check(rank, alpha, targets, dropout, use_rslora, seed)
    s = LoraSpec(rank, float(alpha), targets, use_rslora, float(dropout), seed)
    gen = torch.Generator().manual_seed(seed)
    routed = {e for _, es in model.routed for e in es}
    units: list[Unit] = []
    out: dict[str, PyTree] = {}
    hit: set[str] = set()
    for u in model.units:
        projs = _projections(u.shapes, set(targets)) if u.name.startswith("layers.") else []
        if projs and u.name in routed:
            raise ValueError(
                f"lora.apply: targets {sorted(targets)} match routed expert {u.name!r}; LoRA adapts the "
                "attention (and shared-expert) projections of a mixture of experts, not its routed experts"
            )
        if projs:
            name = PREFIX + u.name
            paths = tuple(p for p, _, _ in projs)
            shapes: dict = {}
            tree: dict = {}
            for path, d_out, d_in in projs:
                hit.add(path.rsplit(".", 1)[-1])
                node, tnode = shapes, tree
                for k in path.split("."):
                    node, tnode = node.setdefault(k, {}), tnode.setdefault(k, {})
                node.update(lora_A=torch.Size([rank, d_in]), lora_B=torch.Size([d_out, rank]))
                bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform_(a=sqrt(5)), as PEFT's reset
                a = (torch.rand(rank, d_in, generator=gen, dtype=torch.float64) * 2 - 1) * bound
                tnode.update(lora_A=a.to(model.dtype), lora_B=torch.zeros(d_out, rank, dtype=model.dtype))
            units.append(Unit(name, _Passthrough(s, u.name, paths), shapes))
            fwd = _LoraUnit(u.fwd, name, paths, s.scale, u, s.dropout, seed)
            units.append(dataclasses.replace(u, fwd=fwd, uses=(*u.uses, name)))  # keeps its experts
            out[name] = tree
        else:
            units.append(u)
        if u.name in params:
            out[u.name] = params[u.name]
    unknown = [t for t in targets if t not in hit]
    if unknown:
        raise ValueError(
            f"lora.apply: targets {unknown} match no projection of the model's layers; "
            f"its projections are {_all_projection_names(model)}"
        )
    frozen = tuple(u.name for u in model.units)
    key = (f"{model.config_key} lora(r={rank}, alpha={float(alpha)}, targets={list(targets)}, "
           f"rslora={use_rslora}" + (f", dropout={float(dropout)}, seed={seed})" if dropout else ")"))
    lm = Model(tuple(units), dtype=model.dtype, vocab_size=model.vocab_size, config_key=key, frozen=frozen,
               router=model.router)
    return lm, out


def apply_to_shards(
    model: Model, shards: Mapping[str, torch.Tensor], mesh: Any, **kwargs: Any
) -> tuple[Model, dict[str, torch.Tensor]]:
    """``apply`` for a rank that holds only its base shards (``shard_from_hf``): the LoRA model
    and this rank's shards of it (the adapters drawn whole, as ``apply`` draws them, then cut)."""
    from odcfn.sharding import make_layout

    lm, adapters = apply(model, {}, **kwargs)
    out = {}
    for u in make_layout(lm, mesh).units:
        if u.name in adapters:
            lo, hi = u.shard_range(mesh.shard_index)
            out[u.name] = u.flatten(adapters[u.name])[lo:hi].clone()
        else:
            out[u.name] = shards[u.name]
    return lm, out


def adapter_units(model: Model) -> dict[str, _Passthrough]:
    """Adapter unit name -> its description (empty for a model without LoRA)."""
    return {u.name: u.fwd for u in model.units if isinstance(u.fwd, _Passthrough)}


def spec(model: Model) -> LoraSpec:
    """The model's LoRA settings (ValueError for a model without adapters)."""
    ads = adapter_units(model)
    if not ads:
        raise ValueError("the model has no LoRA adapters (odcfn.lora.apply makes one)")
    return next(iter(ads.values())).spec


def base_model(model: Model) -> Model:
    """The model before ``apply`` (every unit trained, as the base model was)."""
    ads = adapter_units(model)
    units = [u.fwd.original if isinstance(u.fwd, _LoraUnit) else u for u in model.units if u.name not in ads]
    key = model.config_key.rsplit(" lora(", 1)[0] if ads else model.config_key
    return Model(tuple(units), dtype=model.dtype, vocab_size=model.vocab_size, config_key=key,
                 router=model.router)


def merge(model: Model, params: Mapping[str, PyTree]) -> dict[str, PyTree]:
    """The base params with each adapted weight replaced by ``W + scale * B @ A`` (computed in
    fp64, returned in the weight's dtype): for ``odcfn.models.to_hf`` or a base-model engine."""
    ads = adapter_units(model)
    if not ads:
        raise ValueError("lora.merge: the model has no LoRA adapters")
    out = {k: v for k, v in params.items() if k not in ads}
    for name, ad in ads.items():
        tree = _copy_dicts(out[ad.base])
        for path in ad.paths:
            node, src = tree, params[name]
            for k in path.split("."):
                node, src = node[k], src[k]
            w = node["weight"]
            delta = ad.spec.scale * (src["lora_B"].double() @ src["lora_A"].double())
            node["weight"] = (w.double() + delta).to(w.dtype)
        out[ad.base] = tree
    return out


def _copy_dicts(tree: Any) -> Any:
    return {k: _copy_dicts(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


def peft_names(model: Model) -> list[tuple[str, str, str]]:
    """``(adapter unit, leaf path in it, PEFT key)`` for every adapter leaf."""
    from odcfn.models.hf import hf_name

    out = []
    for name, ad in adapter_units(model).items():
        for path in ad.paths:
            for leaf in ("lora_A", "lora_B"):
                key = f"base_model.model.{hf_name(ad.base, path)}.{leaf}.weight"
                out.append((name, f"{path}.{leaf}", key))
    return out


def leaf_paths(tree: PyTree) -> list[str]:
    return tree_flatten_with_path(tree)[0]
