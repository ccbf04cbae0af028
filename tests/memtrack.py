"""Peak live tensor bytes of a block of torch code, counted op by op (a test helper).

``TensorBytes`` is a ``TorchDispatchMode``: every op's output storages are recorded (weakly),
and before and after each op the bytes of the storages still alive are summed; ``peak`` is the
largest sum seen. A storage stays alive while anything holds it (a view, autograd's saved
tensors), so this counts what the process really holds, independent of the allocator and of
other processes. Temporaries allocated *inside* one aten kernel (a fused kernel's scratch) are
not seen: that is the point of a fused kernel, and any decomposed op (SDPA's math fallback) is
seen op by op.

``TensorBytes(resizes=True)`` also follows storages resized in place (the step frees a gathered
unit's buffer with ``untyped_storage().resize_(0)`` and refills it later, outside any op): each
live storage's size is read again before and after every op. Slower, so only on request.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["TensorBytes"]


class TensorBytes(TorchDispatchMode):
    """``with TensorBytes() as m: ...``; then ``m.peak`` (bytes above what was alive before)."""

    def __init__(self, resizes: bool = False) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}  # storage key -> (weak ref, bytes)
        self.current = 0
        self.peak = 0
        self.resizes = resizes

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.current -= self.live.pop(k)[1]
        if self.resizes:
            for k, (ref, n) in self.live.items():
                now = torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
                if now != n:
                    self.live[k] = (ref, now)
                    self.current += now - n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        # an output that shares an input's storage (in-place ops, views) allocated nothing: if
        # that storage predates the block it is not the block's memory
        inputs = {StorageWeakRef(t.untyped_storage()).cdata
                  for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                ref = StorageWeakRef(s)
                if ref.cdata not in self.live and ref.cdata not in inputs:
                    self.live[ref.cdata] = (ref, s.nbytes())
                    self.current += s.nbytes()
        self.peak = max(self.peak, self.current)
        self._sweep()
        return out
