"""What the simulator is given and what it returns: the communication model, the workload (a
model's units as the simulator sees them), the result, and the makespan lower bound."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from odcfn.schedule.cost import DEFAULT_COST, CostModel
from odcfn.schedule.plan import Plan
from odcfn.trace import Event

__all__ = [
    "A100_COMM",
    "ZERO_COMM",
    "CommModel",
    "element_bytes",
    "SimResult",
    "Workload",
    "check_slowdowns",
    "lower_bound_makespan",
]


@dataclass(frozen=True)
class CommModel:
    """Per-rank link bandwidths (bytes/s) and per-message latencies (s)."""

    intra_bandwidth: float = math.inf
    inter_bandwidth: float = math.inf
    intra_latency: float = 0.0
    inter_latency: float = 0.0

    def __post_init__(self) -> None:
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"CommModel.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"CommModel.{name} must be >= 0, got {getattr(self, name)!r}")

    def transfer(self, nbytes: float, group: int, spans_nodes: bool) -> float:
        """Time for one rank to move its ``(S-1)/S`` share of a ``nbytes`` buffer."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        bw, lat = (
            (self.inter_bandwidth, self.inter_latency)
            if spans_nodes
            else (self.intra_bandwidth, self.intra_latency)
        )
        return lat + nbytes * (group - 1) / group / bw

    def sync_time(self, world: int, spans_nodes: bool) -> float:
        lat = self.inter_latency if spans_nodes else self.intra_latency
        return 2.0 * math.ceil(math.log2(world)) * lat if world > 1 else 0.0


def element_bytes(fmt: str | None, default: float = 2.0, block: int = 128) -> float:
    """Bytes per value a transfer in wire format ``fmt`` moves (``StepConfig.gather_format`` /
    ``push_format``), scales included: 1 + 4/128 for fp8_e4m3 / int8; ``default`` for None."""
    if fmt is None:
        return default
    from odcfn.kernels.quant import get_format

    f = get_format(fmt, block)
    return f.itemsize + (4 / block if f.scaled else 0.0)


ZERO_COMM = CommModel()
# An A100 cluster as in the paper: NVLink inside a node, one 200 Gb/s InfiniBand NIC per GPU.
A100_COMM = CommModel(intra_bandwidth=200e9, inter_bandwidth=25e9, intra_latency=10e-6, inter_latency=20e-6)


@dataclass(frozen=True)
class Workload:
    """What the simulator needs of a model: unit names, each unit's share of the compute,
    its parameter bytes (as gathered) and gradient bytes (as scattered)."""

    units: tuple[str, ...]
    weights: tuple[float, ...] | None = None  # compute share per unit; None = equal
    param_bytes: float | Mapping[str, float] = 0.0  # per unit (a float = every unit)
    grad_bytes: float | Mapping[str, float] | None = None  # None = param_bytes
    fwd_fraction: float = 1.0 / 3.0  # forward's share of forward + backward

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))
        if not self.units:
            raise ValueError("Workload needs at least one unit")
        if self.weights is not None:
            if len(self.weights) != len(self.units) or min(self.weights) < 0 or sum(self.weights) <= 0:
                raise ValueError(
                    f"Workload.weights must be {len(self.units)} non-negative floats with a "
                    f"positive sum, got {self.weights!r}"
                )
        if not 0 < self.fwd_fraction < 1:
            raise ValueError(f"Workload.fwd_fraction must be in (0, 1), got {self.fwd_fraction!r}")

    @classmethod
    def uniform(cls, num_units: int, *, model_bytes: float = 0.0, **kw: object) -> Workload:
        """``num_units`` equal units named ``u0, u1, ...`` sharing ``model_bytes``."""
        if not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"num_units must be a positive int, got {num_units!r}")
        return cls(tuple(f"u{i}" for i in range(num_units)), param_bytes=model_bytes / num_units, **kw)

    @classmethod
    def of_model(
        cls, model: Any, *, param_bytes: float = 2.0, grad_bytes: float | None = None, **kw: object
    ) -> Workload:
        """An ``odcfn.Model``'s units, each moving ``param_bytes`` per parameter when gathered
        (``grad_bytes`` when scattered) and, unless ``weights`` says otherwise, taking compute in
        proportion to its parameter count (embedding lookups cost no matmul: pass measured
        ``weights``, e.g. from ``odcfn.schedule.measure.measure_unit_times``, for real shares)."""
        from odcfn.tree import tree_leaves

        numel = {u.name: float(sum(math.prod(s) for s in tree_leaves(u.shapes))) for u in model.units}
        kw.setdefault("weights", tuple(max(n, 1.0) for n in numel.values()))
        return cls(
            tuple(numel),
            param_bytes={u: n * param_bytes for u, n in numel.items()},
            grad_bytes=None if grad_bytes is None else {u: n * grad_bytes for u, n in numel.items()},
            **kw,
        )

    def shares(self) -> list[float]:
        w = self.weights or (1.0,) * len(self.units)
        total = sum(w)
        return [x / total for x in w]

    def per_unit(self, v: float | Mapping[str, float]) -> list[float]:
        """A bytes field as one float per unit, in unit order."""
        if isinstance(v, Mapping):
            missing = [u for u in self.units if u not in v]
            if missing:
                raise ValueError(f"Workload bytes lack units {missing}")
            return [float(v[u]) for u in self.units]
        return [float(v)] * len(self.units)


@dataclass(frozen=True)
class SimResult:
    plans: tuple[Plan, ...]  # what each rank ran (for work stealing: the realised claims)
    events: tuple[tuple[Event, ...], ...]  # per rank; empty tuples when not recorded
    makespan: float  # step time: the end of the sync
    busy: tuple[float, ...]  # per rank: forward + backward time
    num_samples: int
    num_tokens: int
    # per rank: when it reached the sync with every push landed (its own part of the step done)
    arrivals: tuple[float, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.busy)

    @property
    def bubble_rate(self) -> float:
        if self.makespan <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan)

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.makespan if self.makespan > 0 else math.inf

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.makespan if self.makespan > 0 else math.inf


def lower_bound_makespan(
    lengths: Sequence[int],
    world_size: int,
    cost: CostModel = DEFAULT_COST,
    slowdown: Sequence[float] | None = None,
) -> float:
    """No schedule beats ``max(max cost, total / W)`` (with stragglers: the heaviest sample on
    the fastest rank, and the total spread over the ranks' summed speeds)."""
    costs = [cost(n) for n in lengths]
    slow = check_slowdowns(slowdown, world_size)
    return max(max(costs) * min(slow), sum(costs) / sum(1.0 / f for f in slow))


def check_slowdowns(slowdown: Sequence[float] | None, world: int) -> list[float]:
    if slowdown is None:
        return [1.0] * world
    if len(slowdown) != world or min(slowdown) < 1.0:
        raise ValueError(f"slowdown must be {world} factors >= 1.0, got {list(slowdown)!r}")
    return [float(f) for f in slowdown]
