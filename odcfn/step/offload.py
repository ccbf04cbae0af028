"""The offloaded optimizer update (``StepConfig(offload=Offload(...))``): unit by unit, load the
master shard and optimizer leaves from the slow tier into a bounded buffer, update them there,
refresh the resident published copy, write them back.

A reader thread keeps up to ``Offload.prefetch`` units read ahead of the update, and starts
when the step does, so the first units load while forward and backward run; a writer thread
writes each updated unit back while the next one updates. Both are gated by the budget: the
bytes read and not yet written back never exceed ``Offload.budget_gib``. Each unit's update is
the optimizer's own on that unit alone, in place in the buffer (every op is elementwise, so
the result is bit-identical to the in-memory step). The step returns once every unit is back.

On CUDA (``path=None``: pinned host memory; a path: the disk through pinned buffers) each
unit is copied to the device, updated there and copied back: not yet run on hardware.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Mapping
from typing import Any

import torch

from odcfn.model import Model
from odcfn.optim import Optimizer
from odcfn.step.offload_store import MASTER, Store, place, store_of
from odcfn.step.state import TrainState
from odcfn.trainable import trainable_names

__all__ = ["Stream", "adopt", "prefetch", "shards", "update"]


def _offloaded(state: TrainState) -> bool:
    ok = (
        isinstance(state, TrainState) and isinstance(state.model, Model) and isinstance(state.params, Mapping)
    )
    return ok and getattr(state.config, "offload", None) is not None


def _trained(state: TrainState) -> list[str]:
    return list(trainable_names(state.model))


def adopt(state: TrainState, device: torch.device | None = None) -> TrainState:
    """``state`` with its trained shards and optimizer state in its offload store: itself when
    they are already there, else moved into a new one (a loaded checkpoint, a state built
    without offload, tensors replaced by hand). Unchanged without ``StepConfig.offload``.
    ``device``: where its published copies go (``offload_store.place``'s default otherwise)."""
    if not _offloaded(state):  # (a state with bad fields is named by the step's own checks)
        return state
    trained = _trained(state)
    if not trained or store_of(state.params, state.opt_state, trained) is not None:
        return state
    dtype = state.config.compute_dtype or state.model.dtype
    params, opt_state = place(
        state.config.offload, state.params, trained, state.optimizer.init, state.opt_state, dtype, device
    )
    return state.replace(params=params, opt_state=opt_state)


def _store(state: TrainState) -> Store | None:
    if not _offloaded(state) or not _trained(state):
        return None
    store = store_of(state.params, state.opt_state, _trained(state))
    if store is None:
        raise ValueError(
            "StepConfig.offload: this state's trained shards are not in its offload store "
            "(odcfn.step.offload.adopt moves them there; train_step does it)"
        )
    return store


def shards(state: TrainState) -> dict[str, torch.Tensor]:
    """What a pass publishes: the resident published copies of offloaded units (so no gather
    and no publish waits on the slow tier), the params themselves otherwise (a state not yet
    in its store: the values are the same, read from wherever they are)."""
    offloaded = _offloaded(state) and _trained(state)
    store = store_of(state.params, state.opt_state, _trained(state)) if offloaded else None
    return state.params if store is None else {**state.params, **store.published}


def _buffer(n: int, pinned: bool) -> torch.Tensor:
    """A unit's buffer: pinned on CUDA (the caching host allocator reuses it), else its own
    anonymous mapping, returned to the system when the buffer dies (a heap block that size
    could stay resident after it is freed, past the budget)."""
    if pinned:
        return torch.empty(n, dtype=torch.uint8, pin_memory=True)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8)


class Stream:
    """The reader and writer threads of one update, and the budget between them."""

    def __init__(self, store: Store) -> None:
        self.store, self.units = store, store.units
        self.budget, self.ahead = store.offload.budget_bytes, store.offload.prefetch
        self.cv = threading.Condition()
        self.ready: dict[str, torch.Tensor] = {}
        self.pending: list[tuple[str, torch.Tensor] | None] = []
        self.inflight = self.want = 0
        self.peak = self.most_ahead = 0  # the most bytes held at once, the most units read ahead
        self.stop, self.error = False, None
        self.threads = [
            threading.Thread(target=f, name=f"odcfn-offload-{n}", daemon=True)
            for n, f in (("read", self._read), ("write", self._write))
        ]
        for t in self.threads:
            t.start()

    def _read(self) -> None:
        try:
            for i, unit in enumerate(self.units):
                n = self.store.nbytes(unit)
                with self.cv:
                    self.cv.wait_for(
                        lambda i=i, n=n: (
                            self.stop or (i <= self.want + self.ahead and self.inflight + n <= self.budget)
                        )
                    )
                    if self.stop:
                        return
                    self.inflight += n
                    self.peak, self.most_ahead = (
                        max(self.peak, self.inflight),
                        max(self.most_ahead, i - self.want),
                    )
                buf = _buffer(n, self.store.pinned)
                self.store.read(unit, buf)
                with self.cv:
                    self.ready[unit] = buf
                    self.cv.notify_all()
                del buf  # the budget counts it until written back: hold no reference past that
        except BaseException as e:  # surfaced by take(); the step raises it
            self._fail(e)

    def _write(self) -> None:
        try:
            while True:
                with self.cv:
                    self.cv.wait_for(lambda: self.pending or self.stop)
                    if not self.pending:
                        return
                    item = self.pending.pop(0)
                if item is None:
                    return
                unit, buf = item
                self.store.write(unit, buf)
                n = buf.numel()
                del item, buf  # freed before the reader may use its bytes again
                with self.cv:
                    self.inflight -= n
                    self.cv.notify_all()
        except BaseException as e:
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self.cv:
            self.error = self.error or e
            self.stop = True
            self.cv.notify_all()

    def take(self, i: int) -> torch.Tensor:
        """Unit ``i``'s bytes, once read (its read-ahead window moves on)."""
        unit = self.units[i]
        with self.cv:
            self.want = i
            self.cv.notify_all()
            self.cv.wait_for(lambda: unit in self.ready or self.error is not None)
            if self.error is not None:
                raise OSError(f"offloaded state of unit {unit!r}: {self.error}") from self.error
            return self.ready.pop(unit)

    def give_back(self, i: int, buf: torch.Tensor) -> None:
        with self.cv:
            self.pending.append((self.units[i], buf))
            self.cv.notify_all()

    def finish(self) -> None:
        """Wait until every unit is written back; raise a thread's error."""
        with self.cv:
            self.pending.append(None)
            self.cv.notify_all()
        for t in self.threads:
            t.join()
        if self.error is not None:
            raise OSError(f"offloaded state: {self.error}") from self.error

    def cancel(self) -> None:
        """Stop both threads (a step that ends before its update); nothing was written."""
        with self.cv:
            self.stop = True
            self.pending.clear()
            self.cv.notify_all()
        for t in self.threads:
            t.join()


def prefetch(state: TrainState) -> Stream | None:
    """Start reading the first units ahead (None without offload): call before the step's
    compute, so that the loads overlap it."""
    store = _store(state)
    return None if store is None else Stream(store)


def _update_unit(
    optimizer: Optimizer,
    unit: str,
    views: dict[str, torch.Tensor],
    grad: torch.Tensor,
    scalars: dict[str, Any],
    scale: float,
    device: torch.device,
) -> torch.Tensor:
    """One unit's optimizer update, in place in ``views``; returns the new master (on ``device``)."""
    on = views if device.type == "cpu" else {k: v.to(device, non_blocking=True) for k, v in views.items()}
    groups = {k: {unit: v} for k, v in on.items() if k != MASTER}
    params, new = optimizer.update(
        {unit: grad}, {**scalars, **groups}, {unit: on[MASTER]}, grad_scale=scale, inplace=True
    )
    outs = {MASTER: params[unit], **{k: new[k][unit] for k in groups}}
    for k, v in views.items():
        if outs[k] is not on[k] or on[k] is not v:  # an out-of-place optimizer, or the device copy
            v.copy_(outs[k])
    return outs[MASTER]


def update(
    state: TrainState, stream: Stream, optimizer: Optimizer, grads: Mapping[str, torch.Tensor], scale: float
) -> dict[str, Any]:
    """Run the streamed update of ``state``'s offloaded units (the shards change in place, as a
    donated state's do); returns the new optimizer state."""
    store = stream.store
    groups = [k for k, v in state.opt_state.items() if isinstance(v, Mapping)]
    scalars = {k: v for k, v in state.opt_state.items() if k not in groups}
    # the step's scalars (the count) from the optimizer itself, on no units at all
    _, fresh = optimizer.update({}, {**scalars, **{g: {} for g in groups}}, {}, grad_scale=scale)
    try:
        for i, unit in enumerate(stream.units):
            buf = stream.take(i)
            grad = grads[unit]
            master = _update_unit(optimizer, unit, store.views(unit, buf), grad, scalars, scale, grad.device)
            store.published[unit].copy_(master)
            if grad.device.type == "cuda":  # the write-back reads the host buffer
                torch.cuda.current_stream(grad.device).synchronize()
            stream.give_back(i, buf)
            del buf, master  # the writer's now: freed once written, within the budget
    except BaseException:
        stream.cancel()
        raise
    stream.finish()
    store.scalars = {k: v for k, v in fresh.items() if k not in groups}
    return {**store.scalars, **{g: state.opt_state[g] for g in groups}}
