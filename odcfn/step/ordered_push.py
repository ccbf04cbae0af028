"""Deterministic accumulation (``StepConfig(deterministic=True)``) in bounded memory.

Every owner's accumulator of unit ``u`` adds the pushes in one fixed order whatever the timing:
slot 0 of rank 0, slot 0 of rank 1, ..., slot 1 of rank 0, ... where slot ``j`` is a rank's
``j``-th microbatch (a rank with fewer microbatches passes its later turns without pushing). The
turn of unit ``u`` is one shared counter (``fetch_add``, fresh every step) counted from the top of
the counter range (work stealing, which uses the bottom, is refused in this mode): rank ``r``
pushes slot ``j`` when it reads ``j * W + r``, then adds 1.

Each microbatch's gradient is pushed as soon as its turn comes (polled after every push step,
never waited for), so a rank holds only the gradients whose turn has not come yet, and blocks on
the oldest of them when they exceed ``window`` bytes. The former design summed every microbatch
locally and pushed at the sync: an unsharded fp32 gradient of every trained unit per rank.
No circular wait: a rank blocks only on a turn that precedes its own in the (slot, rank) order,
and the earliest turn still open anywhere always belongs to a rank that can take it.
"""

from __future__ import annotations

import time

import torch

from odcfn.sharding import Layout
from odcfn.transport.base import Transport, TransportError

__all__ = ["WINDOW_BYTES", "OrderedPusher", "check_counters", "check_head"]

WINDOW_BYTES = 64 << 20  # staged gradients above this block the rank on its oldest turn


def check_counters(num_units: int, max_counters: int | None) -> None:
    """The turn counters fit the transport's (before any communication); one per trained unit
    whatever the microbatch count: the slot is in the counter's value."""
    if max_counters is None or num_units > max_counters:
        have = "no fetch_add" if max_counters is None else f"{max_counters} counters"
        raise ValueError(
            f"StepConfig(deterministic=True) needs one shared counter per trained unit "
            f"({num_units}); this transport has {have}"
        )


def check_head(loss: object, device: torch.device) -> None:
    """Refuse, before any communication, a deterministic step whose compute on ``device`` is not
    bit-reproducible: a fixed push order cannot repair sums that differ before the push.

    Both heads are reproducible on every device: the torch head walks its chunks in order, and the
    Triton head on CUDA has no atomics (each element of dW and of dh's slice partials is written
    by one program walking its tiles in order; the partials are summed in slice order), so
    ``loss`` needs no check. What is not reproducible by default on CUDA is torch's own backward
    of ``scaled_dot_product_attention`` (the flash and memory-efficient kernels sum dQ/dK/dV with
    atomics) unless ``torch.use_deterministic_algorithms(True)`` is on (not ``warn_only``); the
    same switch covers torch's other atomic kernels a loss may reach (``index_add_`` with repeated
    indices: the preference loss's per-pair sums).
    ``odcfn.step.stale`` and ``train`` call this by its old name; it checks the device only."""
    del loss  # every head is reproducible (above)
    if torch.device(device).type != "cuda":
        return
    if torch.are_deterministic_algorithms_enabled():
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            return
    raise ValueError(
        "StepConfig(deterministic=True) on CUDA needs torch.use_deterministic_algorithms(True) (not "
        "warn_only) before the step: without it torch's scaled_dot_product_attention backward (flash / "
        "memory-efficient kernels) adds its gradients with atomics in a run-dependent order; cuBLAS then "
        "also needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment. Or use deterministic=False"
    )


class OrderedPusher:
    """This rank's pushes of one step in the fixed (slot, rank) order; ``slots``: the most
    microbatches any rank runs, ``mine``: this rank's count."""

    def __init__(
        self, transport: Transport, layout: Layout, slots: int, mine: int, window: int | None = None
    ) -> None:
        self.t, self.rank, self.world = transport, transport.mesh.rank, transport.mesh.world_size
        self.slots, self.mine = slots, mine
        self.window = WINDOW_BYTES if window is None else window
        self.timeout = float(getattr(transport, "timeout", 60.0))
        trained = [u.name for u in layout.units if not u.frozen]
        top = transport.max_counters - 1
        self.counter = {u: top - i for i, u in enumerate(trained)}
        self.next = dict.fromkeys(trained, 0)  # the next slot of each unit this rank takes
        self.pushed = dict.fromkeys(trained, 0)  # microbatch gradients of each unit staged so far
        self.staged: dict[tuple[str, int], torch.Tensor] = {}  # insertion order: oldest first
        self.bytes = self.peak = 0

    def add(self, unit: str, grad: torch.Tensor) -> None:
        """Stage this rank's next microbatch gradient of ``unit``; push what is due."""
        j = self.pushed[unit]
        if j >= self.mine:
            raise ValueError(f"unit {unit!r} pushed more microbatches than this rank runs ({self.mine})")
        self.pushed[unit] = j + 1
        self.staged[(unit, j)] = grad
        self.bytes += grad.numel() * grad.element_size()
        self.peak = max(self.peak, self.bytes)
        self.drain()
        while self.bytes > self.window and self.staged:
            self._wait_turn(next(iter(self.staged))[0])
            self.drain()

    def skip(self, unit: str) -> None:
        """This rank's next microbatch has no gradient for ``unit`` (a routed expert none of its
        tokens chose): its turn is passed, so every unit keeps one turn per microbatch slot."""
        j = self.pushed[unit]
        if j >= self.mine:
            raise ValueError(f"unit {unit!r} passed more microbatches than this rank runs ({self.mine})")
        self.pushed[unit] = j + 1
        self.staged[(unit, j)] = None
        self.drain()

    def finish(self) -> None:
        """At the sync: take every remaining turn (push or pass), waiting for each."""
        for unit in self.next:
            while self.next[unit] < self.slots:
                self._wait_turn(unit)
                self.drain()

    def drain(self) -> None:
        """Take every turn that has come, without waiting."""
        for unit, j in self.next.items():
            while j < self.slots and (j >= self.mine or (unit, j) in self.staged):
                if self._turn(unit) != j * self.world + self.rank:
                    break
                self._take(unit, j)
                j += 1

    def _turn(self, unit: str) -> int:
        turn = self.t.fetch_add(self.counter[unit], 0)
        j = self.next[unit]
        if turn > j * self.world + self.rank:
            raise TransportError(
                f"rank {self.rank}: the push order of unit {unit!r} passed slot {j} "
                "(ranks disagree on StepConfig.deterministic or the assignment?)"
            )
        return turn

    def _take(self, unit: str, j: int) -> None:
        g = self.staged.pop((unit, j), None)
        if g is not None:  # None: a passed turn (``skip``)
            self.t.scatter_accumulate(unit, g).wait()
            self.bytes -= g.numel() * g.element_size()
        self.next[unit] = j + 1
        self.t.fetch_add(self.counter[unit], 1)

    def _wait_turn(self, unit: str) -> None:
        want = self.next[unit] * self.world + self.rank
        deadline, pause = time.monotonic() + self.timeout, 1e-5
        while (turn := self._turn(unit)) != want:
            if time.monotonic() > deadline:
                raise TransportError(
                    f"rank {self.rank}: timed out after {self.timeout}s waiting for turn {want} of unit "
                    f"{unit!r} (at {turn}; deterministic order; dead or stuck peer?)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
