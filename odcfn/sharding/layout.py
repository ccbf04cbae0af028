"""Flat per-unit layouts: every unit's leaves concatenated (sorted key-path order), padded to a
multiple of the shard count, and cut into equal contiguous shards.

Padding means any parameter count works for any world size; the padding is zero, receives zero
gradient and therefore stays zero under every optimizer here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from odcfn.model import Model, check_params
from odcfn.sharding.mesh import Mesh
from odcfn.tree import PyTree, tree_flatten_with_path, tree_map, tree_unflatten

__all__ = ["Layout", "UnitLayout", "make_layout", "shard", "unshard", "check_shards"]


@dataclass(frozen=True)
class UnitLayout:
    name: str
    paths: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    treedef: Any
    shard_count: int
    frozen: bool = False  # not trained: gather-only, no accumulator (``Model.frozen``)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        return self.shard_size * self.shard_count

    @property
    def shard_size(self) -> int:
        return max(1, -(-self.numel // self.shard_count))

    def shard_range(self, shard_index: int) -> tuple[int, int]:
        lo = shard_index * self.shard_size
        return lo, lo + self.shard_size

    def flatten(self, tree: PyTree) -> torch.Tensor:
        """Unit subtree -> padded flat vector (a copy)."""
        _, leaves, _ = tree_flatten_with_path(tree)
        flat = torch.cat([x.reshape(-1) for x in leaves])
        return torch.nn.functional.pad(flat, (0, self.padded_numel - self.numel))

    def unflatten(self, flat: torch.Tensor) -> PyTree:
        """Padded flat vector -> unit subtree of *views* into it (autograd flows to ``flat``)."""
        parts = flat.split([*self.numels, self.padded_numel - self.numel])
        return tree_unflatten(self.treedef, [p.view(s) for p, s in zip(parts, self.shapes)])


@dataclass(frozen=True)
class Layout:
    units: tuple[UnitLayout, ...]
    mesh: Mesh
    uses: tuple[tuple[str, tuple[str, ...]], ...] = ()  # tied weights: (unit, units it also reads)

    def __str__(self) -> str:
        m = self.mesh
        lines = [f"Layout({len(self.units)} units, {m.shard_count} shards, {m.sharding} sharding)"]
        users = dict(self.uses)
        for u in self.units:
            tie = f"  + reads {', '.join(users[u.name])} (tied: one copy)" if u.name in users else ""
            tie += "  frozen" if u.frozen else ""
            lines.append(
                f"  {u.name:<12} {u.numel:>12,} params  {len(u.paths):>3} leaves  "
                f"shard {u.shard_size:,} (+{u.padded_numel - u.numel} pad){tie}"
            )
        return "\n".join(lines)

    def __getitem__(self, name: str) -> UnitLayout:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)


def make_layout(model: Model, mesh: Mesh) -> Layout:
    units = []
    for u in model.units:
        paths, shapes, treedef = tree_flatten_with_path(u.shapes)
        units.append(UnitLayout(u.name, tuple(paths), tuple(tuple(s) for s in shapes), treedef,
                                mesh.shard_count, u.name in model.frozen))
    return Layout(tuple(units), mesh, model.uses)


def shard(params: Mapping[str, PyTree], model: Model, mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's shards of unsharded ``params``: unit name -> 1-D tensor of ``shard_size``."""
    check_params(model, params)
    layout = make_layout(model, mesh)
    out = {}
    for u in layout.units:
        lo, hi = u.shard_range(mesh.shard_index)
        out[u.name] = u.flatten(params[u.name])[lo:hi].clone()
    return out


def unshard(shards_per_rank: Sequence[Mapping[str, torch.Tensor]], model: Model, mesh: Mesh) -> dict:
    """Reassemble full params from one shard group's shards (``shards_per_rank[i]`` from the
    rank with shard index ``i``)."""
    layout = make_layout(model, mesh)
    if len(shards_per_rank) != mesh.shard_count:
        raise ValueError(f"unshard needs {mesh.shard_count} shards, got {len(shards_per_rank)}")
    out = {}
    for u in layout.units:
        flat = torch.cat([s[u.name] for s in shards_per_rank])
        out[u.name] = tree_map(lambda x: x.clone(), u.unflatten(flat))
    return out


def check_shards(
    shards: Any, layout: Layout, dtype: torch.dtype, what: str = "params",
    frozen_dtype: torch.dtype | None = None,
    one_device: bool = True,
    frozen_format: Any = None,
) -> None:
    """Raise a clear error if a rank's shard dict does not fit the layout. Frozen units may also
    be stored in ``frozen_dtype`` (the compute dtype: a frozen weight needs no fp32 master), or
    held encoded in ``frozen_format`` (a ``kernels.quant.Format``, ``StepConfig.quantize_frozen``:
    ``nbytes(n)`` bytes as the format's element type). ``one_device=False``: the caller checks
    the devices itself (a step's state: offloaded masters live in host memory,
    ``odcfn.step.devices``)."""
    if not isinstance(shards, Mapping):
        raise TypeError(
            f"{what} must be a dict of flat shards keyed by unit name, got {type(shards).__name__}"
        )
    missing = [n for n in layout.names if n not in shards]
    extra = [k for k in shards if k not in layout.names]
    if missing or extra:
        raise ValueError(f"{what} do not match the model: missing units {missing}, extra {extra}")
    for u in layout.units:
        t = shards[u.name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}[{u.name!r}] is {type(t).__name__}, expected a tensor")
        held = u.frozen and frozen_format is not None and t.dtype == frozen_format.element_dtype
        encoded = not t.dtype.is_floating_point or t.dtype == getattr(torch, "float8_e4m3fn", None)
        if u.frozen and encoded and not held:
            keeps = "as given" if frozen_format is None else f"in {frozen_format.name}"
            raise ValueError(
                f"{what}[{u.name!r}] is held encoded as {t.dtype}, but the config keeps frozen units "
                f"{keeps}: a base held encoded (StepConfig.quantize_frozen) needs the config it was "
                "made with (quantize_frozen=True, the same gather_format and quant_block)"
            )
        if held:
            want = frozen_format.nbytes(u.shard_size) // frozen_format.itemsize
            if t.shape != (want,):
                raise ValueError(
                    f"{what}[{u.name!r}] is held as {tuple(t.shape)} {t.dtype}, but the layout's "
                    f"{u.shard_size} values in {frozen_format.name} with quant_block={frozen_format.block} "
                    f"take ({want},) (StepConfig.quantize_frozen: the state must be built with the "
                    "config's gather_format and quant_block)"
                )
        elif t.shape != (u.shard_size,):
            raise ValueError(
                f"{what}[{u.name!r}] has shape {tuple(t.shape)}, the layout for "
                f"{layout.mesh.shard_count} shards expects ({u.shard_size},)"
            )
        if t.dtype != dtype and not (u.frozen and t.dtype == frozen_dtype) and not held:
            also = f" (or {frozen_dtype}, frozen)" if u.frozen and frozen_dtype not in (None, dtype) else ""
            raise ValueError(f"{what}[{u.name!r}] has dtype {t.dtype}, expected {dtype}{also}")
        first = shards[layout.units[0].name]
        if one_device and t.device != first.device:
            raise ValueError(
                f"{what}[{u.name!r}] is on {t.device} but {what}[{layout.units[0].name!r}] is on "
                f"{first.device}: all shards of a rank live on one device"
            )
