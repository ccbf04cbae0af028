"""Which parameters a step trains, as data: ``Model.frozen`` (unit names).

A trainable spec is a predicate on leaf names (``"layers.0.self_attn.q_proj.lora_A"``: True =
trained), a tuple of ``fnmatch`` patterns on those names, or None (everything). The unit is the
FSDP gather granularity, so a spec decides per unit: a unit is trained when all its leaves are,
frozen when none is; a spec that splits a unit's leaves is refused with the leaves named (put
the trainable leaves in their own unit, as ``odcfn.lora.apply`` does with adapters).

A frozen unit is gather-only: its Backward (when a trained unit before it needs the activation
gradient) differentiates the input, never the weights; it has no scatter / reduce-scatter, no
accumulator on the transports that allocate per unit (local, collective, shm), and no
optimizer state.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

from odcfn.model import Model
from odcfn.tree import tree_flatten_with_path

__all__ = ["Trainable", "freeze", "frozen_units", "split", "trainable_names"]

Trainable = Callable[[str], bool] | Sequence[str] | None


def _predicate(trainable: Trainable) -> Callable[[str], bool]:
    if trainable is None:
        return lambda name: True
    if callable(trainable):
        return trainable
    if isinstance(trainable, str) or not all(isinstance(p, str) for p in trainable):
        raise TypeError(
            "trainable must be a predicate on leaf names, a tuple of fnmatch patterns or None, "
            f"got {trainable!r}"
        )
    pats = tuple(trainable)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in pats)


def frozen_units(model: Model, trainable: Trainable) -> tuple[str, ...]:
    """The units ``trainable`` freezes (ValueError naming a unit it splits, or freezing all)."""
    pred = _predicate(trainable)
    frozen = []
    for u in model.units:
        names = [f"{u.name}.{p}" for p in tree_flatten_with_path(u.shapes)[0]]
        flags = []
        for n in names:
            f = pred(n)
            if not isinstance(f, bool):
                raise TypeError(f"trainable({n!r}) returned {f!r}, expected a bool")
            flags.append(f)
        if not any(flags):
            frozen.append(u.name)
        elif not all(flags):
            on = [n for n, f in zip(names, flags) if f][:4]
            off = [n for n, f in zip(names, flags) if not f][:4]
            raise ValueError(
                f"trainable splits unit {u.name!r}: it trains {on} but freezes {off}; a unit (the "
                "gather granularity) is trained or frozen as a whole"
            )
    if len(frozen) == len(model.units):
        raise ValueError(f"trainable={trainable!r} freezes every unit of the model: nothing to train")
    return tuple(frozen)


def freeze(model: Model, trainable: Trainable) -> Model:
    """``model`` with ``Model.frozen`` set from ``trainable`` (None: everything trained)."""
    return dataclasses.replace(model, frozen=frozen_units(model, trainable))


def trainable_names(model: Model) -> tuple[str, ...]:
    return tuple(n for n in model.unit_names if n not in model.frozen)


def split(model: Model, shards: dict[str, Any]) -> dict[str, Any]:
    """The trained units' entries of a per-unit dict."""
    return {k: v for k, v in shards.items() if k not in model.frozen}
