"""The compute of a rank's plan: a unit's ``Forward`` and ``Backward`` on one microbatch, as a
mixin of ``odcfn.step.execute.Executor`` (it reads the state the executor's ``__init__`` sets and
its parameter methods: ``_inputs``, ``_mb``, ``wait_gather``).

Backward is a VJP of the pure unit function with plain ``torch.autograd.grad``, w.r.t. the flat
buffer, so the gradient comes out already flat and padded, ready to scatter.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from odcfn.batch import Microbatch
from odcfn.kernels.grad_sink import seed
from odcfn.schedule.plan import Backward, Forward

__all__ = ["Saved", "UnitCompute"]


@dataclass
class Saved:
    x_in: Any
    flat: torch.Tensor | None
    y: Any
    used: tuple[torch.Tensor, ...] = ()  # flat buffers of used units (tied weights) in the graph
    experts: tuple[tuple[str, torch.Tensor], ...] = ()  # all-gathered experts (collective) in the graph


class UnitCompute:
    """Forward and Backward of the plan's compute steps (a mixin of ``Executor``)."""

    # --- compute ----------------------------------------------------------------------------
    def _input(self, s: Forward, mb: int) -> tuple[Microbatch, Any] | None:
        """Microbatch ``mb`` and the previous unit's output for it (None for the first unit);
        None for an empty microbatch (it computes nothing)."""
        data = self._mb(mb)
        if data.empty:
            return None
        prev = self.prev[s.unit]
        return data, None if prev is None else self.outs.pop((prev, mb))

    def forward(self, s: Forward, mb: int) -> None:
        got = self._input(s, mb)
        if got is None:
            return
        data, x = got
        if s.unit in self.passthrough:  # nothing to compute: its gradient comes from its users
            self.outs[(s.unit, mb)] = x
            return
        if isinstance(x, torch.Tensor) and x.is_floating_point() and s.unit in self.needs_dx:
            x = x.detach().requires_grad_()
        fwd = self.units[s.unit].fwd
        s = replace(s, mb=mb)  # the rank's microbatch number (the step's is the piece's)
        flat, params, used, experts = self._inputs(s)
        if s.unit in self.no_grad:  # forward only: no Backward follows
            with torch.no_grad():
                y = fwd(params, x, data)
        elif s.remat:
            with torch.no_grad():
                y = fwd(params, x, data)
            self.saved[(s.unit, mb)] = Saved(x, None, None)
        else:
            with torch.enable_grad():
                y = fwd(params, x, data)
            self.saved[(s.unit, mb)] = Saved(x, flat, y, used, experts)
        if s.unit == self.last:
            self.loss_sum += y.detach().double()
            log = self.logs.get(mb)
            if log is not None:  # the microbatch's aux loss (its gradient rides the routers' graphs)
                aux = log.aux_loss().to(self.loss_sum.device)
                self.loss_sum[0] += aux
                self.aux += aux
                for layer, load in log.loads.items():
                    self.loads[layer] += load
        else:
            self.outs[(s.unit, mb)] = y.detach()

    def backward(self, s: Backward, mb: int) -> None:
        data = self._mb(mb)
        if data.empty:
            if s.unit not in self.frozen:
                self.grads[s.unit] = self.shared.pop(s.unit, None)
            if not s.routed:  # collective: every expert still joins its reduce-scatter (zeros)
                self.grads.update((e, None) for e in self.units[s.unit].experts if e not in self.frozen)
            self._pass_unused(s)
            return
        if s.unit in self.passthrough:  # the activation gradient passes through unchanged
            if s.unit not in self.frozen:
                self.grads[s.unit] = self.shared.pop(s.unit, None)
            return
        self.mb_pushed = set()
        self._backward_unit(s, mb, data)
        self._pass_unused(s)

    def _pass_unused(self, s: Backward) -> None:
        """Deterministic ODC: a routed expert this microbatch did not push passes its turn, so
        each owner still adds in the fixed (microbatch slot, rank) order."""
        if s.routed and self.ordered is not None:
            for e in self.units[s.unit].experts:
                if e not in self.frozen and e not in self.mb_pushed:
                    self.ordered.skip(e)
        self.mb_pushed = set()

    def _backward_unit(self, s: Backward, mb: int, data: Microbatch) -> None:
        sv = self.saved.pop((s.unit, mb))
        flat, y, used, experts = sv.flat, sv.y, sv.used, sv.experts
        if flat is None:  # rematerialise (a mixture's routers reuse the forward's choice: RouterLog)
            flat, params, used, experts = self._inputs(replace(s, mb=mb))
            with torch.enable_grad():
                y = self.units[s.unit].fwd(params, sv.x_in, data)
        else:
            for u in (s.unit, *s.uses):  # a re-gather refills the storage the graph saved views of
                self.wait_gather(u)
        gy = self.grad_out.pop(mb, None)
        if gy is None:
            gy = torch.zeros_like(y)  # [loss, metrics...]: only the loss is differentiated
            gy[0] = 1.0
        own = s.unit not in self.frozen
        # tied: the later units' gradient of this unit starts its flat gradient (no second V×D)
        shared = self.shared.pop(s.unit, None) if own else None
        seeded = shared is not None and seed(flat, shared)
        trained_uses = [(v, f) for v, f in zip(s.uses, used) if v not in self.frozen]
        inputs = ([flat] if own else []) + [f for _, f in trained_uses] + [f for _, f in experts]
        has_x = isinstance(sv.x_in, torch.Tensor) and sv.x_in.requires_grad
        if has_x:
            inputs.append(sv.x_in)
        if not inputs:
            if s.routed and y.requires_grad:  # only the routed experts learn: their backward pushes
                torch.autograd.backward(y, gy)
            return
        # allow_unused: a unit whose fwd reads none of its own weights (LoRA's adapter units
        # pass x through; the layer that uses them differentiates them)
        if y.requires_grad:
            grads = torch.autograd.grad(y, inputs, gy, allow_unused=True)
        else:  # a pass-through unit right after the forward-only ones: nothing reaches its weights
            grads = (None,) * len(inputs)
        if seeded:  # autograd returned the seeded buffer, or nothing if it never reached flat
            grads, shared = [shared if grads[0] is None else grads[0], *grads[1:]], None
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
        g_own = grads[0] if own else None
        for (v, _), g in zip(trained_uses, grads[int(own):]):  # the used unit pushes the sum, once
            self.shared[v] = g if v not in self.shared else self.shared[v] + g
        for (e, _), g in zip(experts, grads[int(own) + len(trained_uses):]):  # joins the reduce-scatter
            self.grads[e] = g
        if own:
            if shared is None:
                self.grads[s.unit] = g_own
            elif g_own.is_contiguous():  # autograd's fresh output: a tied V×D sum, no third copy
                self.grads[s.unit] = g_own.add_(shared)
            else:  # e.g. an expanded (stride-0) gradient cannot be written in place
                self.grads[s.unit] = g_own + shared
        if has_x:
            self.grad_out[mb] = grads[-1]
