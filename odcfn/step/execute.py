"""Executes one rank's Plan on a transport.

Each unit's gathered parameters live in one persistent flat buffer; its tensors are views of it.
``Release`` frees the buffer's storage (``untyped_storage().resize_(0)``) and a later gather
re-allocates and refills it, so an autograd graph that saved views of the weights across a
release sees the re-gathered values in backward (the FSDP2 technique). Backward is a VJP of the
pure unit function with plain ``torch.autograd.grad``, w.r.t. the flat buffer, so the gradient
comes out already flat and padded, ready to scatter.

The compute of ``Forward`` and ``Backward`` is the mixin ``UnitCompute``
(``odcfn.step.execute_compute``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from odcfn.batch import Batch, Microbatch, pack
from odcfn.kernels.grad_sink import flat_views
from odcfn.model import Model, unit_inputs
from odcfn.schedule.plan import (
    AllGather,
    Backward,
    Forward,
    Gather,
    ReduceScatter,
    Release,
    Reshard,
    ScatterAccumulate,
    Step,
    Sync,
    first_trained,
)
from odcfn.sharding import Layout
from odcfn.step.execute_compute import Saved, UnitCompute
from odcfn.step.experts import expert_source
from odcfn.step.ordered_push import OrderedPusher
from odcfn.trace import Event
from odcfn.transport.base import Handle, Transport, sum_squares
from odcfn.tree import tree_unflatten

__all__ = ["Executor"]



class Executor(UnitCompute):
    def __init__(
        self,
        model: Model,
        layout: Layout,
        batch: Batch,
        transport: Transport,
        compute_dtype: torch.dtype,
        device: torch.device,
        loss: Any,
    ) -> None:
        self.model, self.layout, self.batch = model, layout, batch
        self.t, self.dtype, self.device = transport, compute_dtype, device
        chain = model.chain  # the forward's units: all but a mixture's experts (Unit.experts)
        self.rank, self.last = transport.mesh.rank, chain[-1]
        # progress that peers waiting on this rank can see (odcfn.transport.heartbeat); optional
        self.beat = getattr(transport, "beat", None) or (lambda: None)
        self.riders: torch.Tensor | None = None
        self.units = {u.name: u for u in model.units}
        # frozen units (Model.frozen): weights never differentiated, never pushed; the units
        # before the first trained one run forward only (nothing upstream needs their gradient)
        self.frozen = frozenset(model.frozen)
        first = first_trained(chain, self.frozen)
        self.no_grad = frozenset(chain[:first])
        # units whose fwd is x -> x and reads no own weights (ScheduleOptions.passthrough): their
        # gradient arrives through the unit that uses them, not through the activations
        self.passthrough = frozenset(u.name for u in model.units if getattr(u.fwd, "passthrough", False))
        # the input gradient is needed after the first unit whose Backward yields a weight gradient
        pulls = [i for i, n in enumerate(chain) if (n not in self.frozen | self.passthrough)
                 or any(v not in self.frozen for v in self.units[n].uses + self.units[n].experts)]
        self.needs_dx = frozenset(chain[pulls[0] + 1:] if pulls else ())
        self.prev = {u: (chain[i - 1] if i else None) for i, u in enumerate(chain)}
        # a mixture of experts: one router log per microbatch (aux loss, routing record) and
        # this rank's tokens per expert of each sparse layer, summed in the one sync
        self.router = model.router
        self.router_bias: torch.Tensor | None = None  # aux-loss-free balancing (TrainState.router_bias)
        self.logs: dict[int, Any] = {}
        self.loads = None if self.router is None else torch.zeros(
            self.router.num_layers, self.router.num_experts, dtype=torch.float64)
        # the aux loss's share of loss_sum, summed in the same sync: a figure of its own
        self.aux = None if self.router is None else torch.zeros(1, dtype=torch.float64, device=device)
        self.events: list[Event] = []
        self.t0 = time.perf_counter()
        self.mb_pushed: set[str] = set()  # the routed experts the current Backward pushed
        self.bufs: dict[str, torch.Tensor] = {}
        self.wbufs: dict[str, torch.Tensor] = {}
        self.pending: dict[str, Handle] = {}
        self.pushes: list[Handle] = []
        self.microbatches: list[tuple[int, ...]] = []  # grows as the program's pieces arrive
        self.packed: dict[int, Microbatch] = {}
        self.outs: dict[tuple[str, int], Any] = {}  # (unit, mb) -> detached output
        self.saved: dict[tuple[str, int], Saved] = {}
        self.grad_out: dict[int, Any] = {}  # mb -> grad w.r.t. the output of the unit in backward
        self.grads: dict[str, torch.Tensor | None] = {}
        # unit -> gradient of its uses by later units (tied weights), added to its own backward's
        self.shared: dict[str, torch.Tensor] = {}
        # a loss object (odcfn.losses): the head returns [weighted loss, metric sums...], the
        # weights (from the whole minibatch) already normalise it
        self.loss = loss
        self.weights = loss.weights(batch)
        n = 1 + len(getattr(loss, "metric_names", ()))
        self.loss_sum = torch.zeros(n, dtype=torch.float64, device=device)
        # deterministic mode: pushes staged and taken in the fixed (microbatch slot, rank) order
        self.ordered: OrderedPusher | None = None

    # --- parameters -------------------------------------------------------------------------
    def buffer(self, unit: str) -> torch.Tensor:
        """The tensor a gather writes into: an alias of the unit's buffer with its own version
        counter, so refilling it does not trip autograd's check on views saved from ``bufs``."""
        n = self.layout[unit].padded_numel
        buf = self.bufs.get(unit)
        if buf is None:
            buf = self.bufs[unit] = torch.empty(n, dtype=self.dtype, device=self.device)
            alias = torch.empty(0, dtype=self.dtype, device=self.device)
            self.wbufs[unit] = alias.set_(buf.untyped_storage(), 0, (n,))
        elif buf.untyped_storage().size() == 0:
            buf.untyped_storage().resize_(n * buf.element_size())
        return self.wbufs[unit]

    def wait_gather(self, unit: str) -> None:
        handle = self.pending.pop(unit, None)
        if handle is not None:
            handle.wait()

    def params(self, unit: str) -> tuple[torch.Tensor, Any]:
        self.wait_gather(unit)
        flat = self.bufs[unit].detach().requires_grad_(unit not in self.frozen)
        lay = self.layout[unit]
        if not flat.requires_grad:
            return flat, lay.unflatten(flat)
        # views whose flat gradient ops may fill in place (the fused head's dW: no V×D copies)
        return flat, tree_unflatten(lay.treedef, flat_views(flat, lay.numels, lay.shapes))

    def _inputs(self, s: Forward | Backward) -> tuple[torch.Tensor, Any, tuple[torch.Tensor, ...], tuple]:
        """``(own flat, what fwd receives, used units' flats, all-gathered experts' (name, flat))``;
        the plan must gather the uses (and, in collective mode, the experts)."""
        unit = self.units[s.unit]
        if s.unit in self.passthrough:  # reads no weights of its own; never gathered for itself
            return None, {}, (), ()
        if s.uses != unit.uses:
            raise ValueError(f"plan step {s} does not gather what unit {s.unit!r} uses: {unit.uses}")
        flat, params = self.params(s.unit)
        used = {v: self.params(v) for v in unit.uses}
        fwd_in = unit_inputs(unit, params, {v: t for v, (_, t) in used.items()})
        experts: list = []
        if unit.experts:
            log = self._log(s.mb)
            fwd_in["experts"], experts = expert_source(self, s.unit, unit.experts, s.routed, s.mb, log)
        return flat, fwd_in, tuple(f for f, _ in used.values()), tuple(experts)

    def _log(self, mb: int) -> Any:
        """Microbatch ``mb``'s router log (None for a dense model)."""
        if self.router is None:
            return None
        if mb not in self.logs:
            self.logs[mb] = self.router.log(self._mb(mb).seqlens, len(self.batch), bias=self.router_bias)
        return self.logs[mb]

    def _mb(self, mb: int) -> Microbatch:
        if mb not in self.packed:
            mb_ids = self.microbatches[mb]
            self.packed[mb] = pack(self.batch, mb_ids, loss=self.loss, weights=self.weights).to(self.device)
        return self.packed[mb]

    # --- the loop ---------------------------------------------------------------------------
    def run_steps(self, steps: Sequence[Step], offset: int, t0: float, events: list[Event]) -> Any:
        """Run one piece's steps (its microbatch ``k`` is the rank's ``offset + k``), appending
        their events; returns the synced stats if a Sync was among them."""
        stats = None
        for s in steps:
            kind, run = _STEPS[type(s)]
            moved = _moved(self.t.counters)
            start = time.perf_counter()
            out = getattr(self, run)(s, offset)
            self.beat()
            end = time.perf_counter()
            stats = out if isinstance(s, Sync) else stats
            unit, mb = getattr(s, "unit", ""), getattr(s, "mb", -1 - offset) + offset
            nbytes = _moved(self.t.counters) - moved  # the trace shows what each transfer moved
            events.append(Event(self.rank, kind, unit, start - t0, end - t0, mb, nbytes))
        return stats

    # one method per step type of the plan IR (``_STEPS`` maps each type to its method)

    def _gather(self, s: Gather, offset: int) -> None:
        with torch.no_grad():
            if s.group:  # hpZ: from the group's secondary shards (never across the group)
                self.pending[s.unit] = self.t.gather_group(s.unit, self.buffer(s.unit), s.group)
            else:
                self.pending[s.unit] = self.t.gather(s.unit, self.buffer(s.unit))

    def _all_gather(self, s: AllGather, offset: int) -> None:
        with torch.no_grad():
            self.t.all_gather(s.unit, self.buffer(s.unit))

    def _forward(self, s: Forward, offset: int) -> None:
        self.forward(s, s.mb + offset)

    def _backward(self, s: Backward, offset: int) -> None:
        self.backward(s, s.mb + offset)

    def _grad_out(self, unit: str) -> torch.Tensor:
        if unit in self.frozen:  # the plan never pushes a frozen unit; a plan that does is wrong
            raise ValueError(f"a plan step pushes a gradient of frozen unit {unit!r}")
        g = self.grads.pop(unit)
        if g is None:  # an empty microbatch (or an unused unit) still joins the collective
            g = torch.zeros(self.layout[unit].padded_numel, dtype=self.dtype, device=self.device)
        return g

    def _scatter(self, s: ScatterAccumulate, offset: int) -> None:
        self.push(s.unit, self._grad_out(s.unit))

    def push(self, unit: str, g: torch.Tensor) -> None:
        """Scatter-accumulate a unit's padded flat gradient into its owners (a plan step, or a
        routed expert's backward)."""
        with torch.no_grad():
            if self.ordered is None:
                self.pushes.append(self.t.scatter_accumulate(unit, g))
            else:  # deterministic: pushed when its turn comes (staged until then, bounded); a
                # routed expert takes its microbatch's slot (unused: passed, ``_pass_unused``)
                self.ordered.add(unit, g)
                self.mb_pushed.add(unit)

    def _reduce_scatter(self, s: ReduceScatter, offset: int) -> None:
        g = self._grad_out(s.unit)
        with torch.no_grad():
            self.t.reduce_scatter(s.unit, g)

    def _release(self, s: Release, offset: int) -> None:
        self.wait_gather(s.unit)
        self.bufs[s.unit].untyped_storage().resize_(0)

    def _reshard(self, s: Reshard, offset: int) -> None:
        self.wait_gather(s.unit)
        self.t.publish_secondary(s.unit, self.bufs[s.unit], s.group)  # once per minibatch
        self._release(s, offset)

    def _sync(self, s: Sync, offset: int) -> Any:
        return self.sync()

    def sync(self) -> torch.Tensor:
        if self.ordered is not None:
            self.ordered.finish()
        for h in self.pushes:
            h.wait()
        self.t.flush()
        grads = {k: g for k, g in self.t.grad_shards().items() if k not in self.frozen}
        self.t.replica_all_reduce(grads)
        norm2 = sum_squares(grads.values()).to(self.device)
        # after the replica all-reduce every replica holds the same shard: count it once
        norm2 = norm2 / len(self.t.mesh.replica_group)
        # [loss sum, grad-norm^2, the loss's metric sums, expert loads, aux loss, riders]
        s = self.loss_sum.reshape(-1)
        stats = torch.cat([s[:1], norm2.reshape(1), s[1:]])
        if self.loads is not None:
            stats = torch.cat([stats, self.loads.reshape(-1).to(stats.device), self.aux.to(stats.device)])
        if self.riders is not None:  # e.g. the minibatch fingerprint: same sync, no extra trip
            stats = torch.cat([stats, self.riders.to(stats.device, torch.float64)])
        return self.t.sync(stats)


def _moved(c: Any) -> int:
    return c.gather_bytes + c.scatter_bytes + c.collective_bytes


# the plan IR is closed: every step type has its event kind and its method (by name, so that a
# subclass such as the forward-only executor can override one)
_STEPS = {
    Gather: ("gather", "_gather"),
    AllGather: ("collective", "_all_gather"),
    Forward: ("forward", "_forward"),
    Backward: ("backward", "_backward"),
    ScatterAccumulate: ("scatter", "_scatter"),
    ReduceScatter: ("collective", "_reduce_scatter"),
    Release: ("release", "_release"),
    Reshard: ("release", "_reshard"),
    Sync: ("sync", "_sync"),
}
