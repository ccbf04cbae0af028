"""Models as ordered units of pure functions over explicit parameter pytrees.

A ``Unit`` is the FSDP gather granularity: a name, the shapes of the parameter subtree it owns
and a pure ``fwd(params, x, mb) -> y``. The first unit takes ``x=None`` (it reads the tokens from
the microbatch); the last returns the *summed* token loss of the microbatch (a scalar), so that
a minibatch's loss is a plain sum divided by the minibatch's loss-token count.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from odcfn._check import check_int
from odcfn.batch import Batch, Microbatch, pack
from odcfn.moe.experts import LocalExperts
from odcfn.moe.router import RouterSpec
from odcfn.tree import PyTree, tree_flatten_with_path

__all__ = ["Model", "Unit", "check_params", "reference_loss", "unit_inputs"]

UnitFn = Callable[[PyTree, Any, Microbatch], Any]


@dataclass(frozen=True)
class Unit:
    name: str
    fwd: UnitFn
    shapes: PyTree  # the unit's parameter subtree with torch.Size leaves
    # earlier units whose parameters fwd reads too (tied weights): fwd gets each one's subtree
    # under its unit name next to its own; the gradient of that use adds to the owner's
    uses: tuple[str, ...] = ()
    # expert units (a mixture of experts) fwd reads on demand, after its router has chosen:
    # not steps of the forward chain; fwd gets ``p["experts"]``, an expert source
    # (``odcfn.moe.experts``) over them, and their gradients reach them through it
    experts: tuple[str, ...] = ()


def unit_inputs(unit: Unit, own: PyTree, used: Mapping[str, PyTree]) -> PyTree:
    """The params ``unit.fwd`` receives: its own subtree plus ``{name: subtree}`` of its uses
    (a unit with experts also needs ``"experts"``, an expert source: the caller adds it)."""
    if not unit.uses:
        return own
    return {**own, **{n: used[n] for n in unit.uses}}


@dataclass(frozen=True)
class Model:
    """Ordered units; the last returns the summed token loss. ``vocab_size``: token ids must lie
    in ``[0, vocab_size)`` (checked on every rank before any communication; None: unchecked).
    ``config_key``: a description of the config that built the model (head counts, RoPE base,
    ...), which shapes alone do not capture: checkpoints record it and refuse another model's,
    and ranks whose models differ disagree in the sync's fingerprint.
    ``frozen``: names of units that are not trained (gather-only: no gradient, no accumulator,
    no scatter, no optimizer state); ``odcfn.trainable.freeze`` sets it from a predicate."""

    units: tuple[Unit, ...]
    dtype: torch.dtype = torch.float32
    vocab_size: int | None = None
    config_key: str = ""
    frozen: tuple[str, ...] = ()
    router: RouterSpec | None = None  # a mixture of experts' routers (aux loss, load metrics)

    def __post_init__(self) -> None:
        v = self.vocab_size
        check_int(v, "Model.vocab_size", at_least=1, none_ok=True, want="a positive int or None")
        names = [u.name for u in self.units]
        if len(set(names)) != len(names):
            raise ValueError(f"Model unit names must be unique, got {names}")
        if not names:
            raise ValueError("Model needs at least one unit")
        if isinstance(self.frozen, str) or not all(isinstance(n, str) for n in self.frozen):
            raise TypeError(f"Model.frozen must be a tuple of unit names, got {self.frozen!r}")
        unknown = sorted(set(self.frozen) - set(names))
        if unknown:
            raise ValueError(f"Model.frozen names units the model does not have: {unknown}")
        object.__setattr__(self, "frozen", tuple(n for n in names if n in set(self.frozen)))  # model order
        if len(self.frozen) == len(names):
            raise ValueError("Model.frozen freezes every unit: nothing would be trained")
        experts = [e for u in self.units for e in u.experts]
        if len(set(experts)) != len(experts) or not set(experts) <= set(names):
            raise ValueError("Model: every expert unit must be a unit of the model read by exactly one unit")
        for u in self.units:
            if u.name in experts and (u.experts or u.uses):
                raise ValueError(f"expert unit {u.name!r} cannot have experts or uses of its own")
        for i, u in enumerate(self.units):
            for n in u.uses:
                if n not in names[:i]:
                    raise ValueError(
                        f"unit {u.name!r} uses {n!r}, which is not a unit before it "
                        f"(units {names}): a used unit's backward must come after its user's"
                    )
                if isinstance(u.shapes, Mapping) and n in u.shapes:
                    raise ValueError(f"unit {u.name!r} has its own parameter {n!r} and uses unit {n!r}")

    @property
    def unit_names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit named {name!r}; units are {self.unit_names}")

    @property
    def uses(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(unit, units it also reads)`` for each unit with tied weights (``ScheduleOptions.uses``)."""
        return tuple((u.name, u.uses) for u in self.units if u.uses)

    @property
    def routed(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(unit, its expert units)`` for each unit with experts (``ScheduleOptions.routed``)."""
        return tuple((u.name, u.experts) for u in self.units if u.experts)

    @property
    def chain(self) -> tuple[str, ...]:
        """The units the forward runs through in order: every unit but the expert units."""
        experts = {e for _, es in self.routed for e in es}
        return tuple(n for n in self.unit_names if n not in experts)

    @property
    def shapes(self) -> dict[str, PyTree]:
        return {u.name: u.shapes for u in self.units}

    def apply(self, params: Mapping[str, PyTree], mb: Microbatch, log: Any = None) -> torch.Tensor:
        """Summed token loss of one microbatch on unsharded params. ``log``: the microbatch's
        router log for a mixture of experts (``odcfn.moe.RouterLog``; None: none kept)."""
        x = None
        for name in self.chain:
            u = self.unit(name)
            p = unit_inputs(u, params[u.name], params)
            if u.experts:  # in memory: every expert at hand, differentiated by plain autograd
                p = {**p, "experts": LocalExperts([params[e] for e in u.experts], log)}
            x = u.fwd(p, x, mb)
        return x


def check_params(model: Model, params: Any) -> None:
    """Raise a ValueError/TypeError naming the first leaf that does not match the model."""
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict keyed by unit name, got {type(params).__name__}")
    missing = [n for n in model.unit_names if n not in params]
    extra = [k for k in params if k not in model.unit_names]
    if missing or extra:
        raise ValueError(f"params do not match the model: missing units {missing}, extra {extra}")
    for u in model.units:
        want_names, want, want_def = tree_flatten_with_path(u.shapes)
        got_names, got, got_def = tree_flatten_with_path(params[u.name])
        if want_def != got_def:
            raise ValueError(
                f"params[{u.name!r}] has leaves {got_names}, the model expects {want_names}"
            )
        for name, shape, leaf in zip(want_names, want, got):
            path = f"{u.name}.{name}"
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(f"params leaf {path} is {type(leaf).__name__}, expected a tensor")
            if tuple(leaf.shape) != tuple(shape):
                raise ValueError(
                    f"params leaf {path} has shape {tuple(leaf.shape)}, expected {tuple(shape)}"
                )
            if leaf.dtype != model.dtype:
                raise ValueError(f"params leaf {path} has dtype {leaf.dtype}, expected {model.dtype}")


def reference_loss(
    model: Model, params: Mapping[str, PyTree], batch: Batch, router_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The minibatch loss on unsharded params in one process: the definition every path matches.

    Each sample is its own microbatch, so the reference shares no packing code path with the
    sharded runtime beyond ``pack`` of one sample. A mixture of experts with an aux loss adds
    ``coef * mean over sequences`` of it (``odcfn.moe.router``); ``router_bias``: its routers'
    aux-loss-free balancing bias (``TrainState.router_bias``), which shifts the choice only.
    """
    total, aux = None, 0.0
    for i in range(len(batch)):
        mb = pack(batch, [i])
        log = None if model.router is None else model.router.log(mb.seqlens, len(batch), graph=True,
                                                                   bias=router_bias)
        s = model.apply(params, mb, log)
        total = s if total is None else total + s
        if log is not None:
            aux = aux + log.aux_loss().to(s.dtype)
    return total / batch.num_loss_tokens + aux
