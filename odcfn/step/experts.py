"""The executor's side of a mixture of experts: expert sources bound to the transport.

ODC (``Forward.routed`` > 0): ``OnDemandExperts`` over a ``TransportFetcher``: the experts the
router chose are gathered from their owners a group at a time into the executor's per-unit
buffers (released after the group), and each expert's gradient is scatter-accumulated into its
owners as soon as its backward is done. Every group gather is a trace event, and the transport
counts the bytes, so a step's counters show exactly which experts moved.

Collective (all experts all-gathered by the plan, as FSDP): ``LocalExperts`` over the gathered
buffers; their gradients come out of the unit's own backward and join the reduce-scatters.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from odcfn.moe.experts import LocalExperts, OnDemandExperts
from odcfn.trace import Event

__all__ = ["TransportFetcher", "expert_load_metrics", "expert_source"]


class TransportFetcher:
    """Gathers a unit's experts by index through the executor's buffers and transport (``ex``:
    the ``odcfn.step.execute.Executor``, not imported: that module imports this one)."""

    def __init__(self, ex: Any, unit: str, experts: Sequence[str], group: int, mb: int) -> None:
        self.ex, self.unit, self.names, self.group, self.mb = ex, unit, tuple(experts), group, mb
        self.num_experts = len(self.names)
        self.trained = any(n not in ex.frozen for n in self.names)

    def fetch(self, experts: Sequence[int], grad: bool) -> list[tuple[torch.Tensor, dict]]:
        ex, start = self.ex, time.perf_counter()
        names = [self.names[e] for e in experts]
        with torch.no_grad():
            for n in names:  # issue every gather of the group, then wait: they overlap
                ex.pending[n] = ex.t.gather(n, ex.buffer(n))
        out = []
        for n in names:
            ex.wait_gather(n)
            flat = ex.bufs[n].detach().requires_grad_(grad and n not in ex.frozen)
            out.append((flat, ex.layout[n].unflatten(flat)))
        label = f"{self.unit}.experts[{','.join(map(str, experts))}]"
        ex.events.append(Event(ex.rank, "gather", label, start - ex.t0, time.perf_counter() - ex.t0, self.mb))
        return out

    def release(self, experts: Sequence[int]) -> None:
        for e in experts:
            self.ex.bufs[self.names[e]].untyped_storage().resize_(0)

    def push(self, expert: int, grad_flat: torch.Tensor) -> None:
        name = self.names[expert]
        if name not in self.ex.frozen:
            self.ex.push(name, grad_flat)


def expert_source(ex: Any, unit: str, experts: Sequence[str], routed: int, mb: int, log: Any) -> tuple[
        Any, list[tuple[str, torch.Tensor]]]:
    """``(source, [(expert, flat)])``: the flats are the gathered experts whose gradient the
    unit's backward must return (collective mode; ODC pushes them itself)."""
    if routed:
        return OnDemandExperts(TransportFetcher(ex, unit, experts, routed, mb), log), []
    got = [(e, *ex.params(e)) for e in experts]
    trained = [(e, flat) for e, flat, _ in got if e not in ex.frozen]
    return LocalExperts([tree for _, _, tree in got], log), trained


def expert_load_metrics(model: Any, loads: torch.Tensor) -> dict[str, Any]:
    """Each sparse layer's tokens per expert over the minibatch (``moe/load/<unit>``, E values)
    and their max over mean (``moe/load_max_over_mean/<unit>``; 1.0 is perfect balance)."""
    out: dict[str, Any] = {}
    for (unit, _), load in zip(model.routed, loads):
        out[f"moe/load/{unit}"] = load.clone()
        mean = float(load.mean())
        out[f"moe/load_max_over_mean/{unit}"] = float(load.max()) / mean if mean else 0.0
    return out
