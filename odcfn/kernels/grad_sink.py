"""A unit's flat gradient as a buffer that ops may write into directly.

The step differentiates a unit w.r.t. its padded flat buffer (``odcfn.step.execute``), whose
tensors are views of it. Through plain ``split``/``view`` autograd builds that flat gradient by
concatenating every view's gradient: a vocabulary-sized leaf (the LM head, V×D) then exists
twice at once, as the op's own gradient and as its copy in the flat one (three times with a
cast to the compute dtype between them). ``flat_views`` makes the views through one autograd
Function instead, whose flat gradient is a buffer (the *sink*) an op can reach from the view it
received (``destination``): the fused head accumulates its dW rows straight into it and returns
no gradient for W; the Function's backward adds the other views' gradients into their slices
and hands the sink on as the flat gradient, with no copy.

Correctness rests on autograd's order: a node runs only after every consumer of its outputs
has run its backward, so all direct writes land before the sink is handed on. A writer must
return ``None`` for the view it wrote: the sink already holds that gradient.

``seed`` hands the sink a buffer that already holds a gradient of the same flat buffer (a tied
embedding's gradient from the head): the writes then add into it, so the unit's backward never
holds that gradient and its own as two buffers.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["destination", "flat_views", "seed"]

_ATTR = "_odcfn_grad_sink"  # on each view: (sink, element offset of the view in the flat buffer)
_FLAT_ATTR = "_odcfn_grad_sink_flat"  # on the flat buffer: its sink


class _Sink:
    """The flat gradient of one differentiation of one flat buffer, allocated on first use."""

    __slots__ = ("numel", "dtype", "device", "buf")

    def __init__(self, like: torch.Tensor) -> None:  # its metadata only: no reference to its storage
        self.numel, self.dtype, self.device, self.buf = like.numel(), like.dtype, like.device, None

    def get(self) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        return self.buf

    def take(self) -> torch.Tensor | None:
        """The buffer, handed on once: a second backward through a retained graph starts afresh."""
        buf, self.buf = self.buf, None
        return buf


class _FlatViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, sizes: tuple[int, ...], shapes: tuple, sink: _Sink):
        ctx.sizes, ctx.sink = sizes, sink
        ctx.set_materialize_grads(False)  # an unused view costs nothing in backward
        parts = flat.split(list(sizes))
        return tuple(p.view(s) for p, s in zip(parts, shapes))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        if all(g is None for g in grads) and ctx.sink.buf is None:
            return None, None, None, None
        buf = ctx.sink.get()
        for part, g in zip(buf.split(list(ctx.sizes)), grads):
            if g is not None:  # add: a direct writer may have filled part of this slice already
                part.view(g.shape).add_(g)
        return ctx.sink.take(), None, None, None


def flat_views(flat: torch.Tensor, numels: tuple[int, ...], shapes: tuple) -> list[torch.Tensor]:
    """Views of ``flat`` (``numels[i]`` elements shaped ``shapes[i]``, back to back from 0; the
    rest is padding) whose flat gradient is a sink ops can write into (``destination``).
    ``flat`` must require grad (a frozen unit's views need no sink)."""
    sink = _Sink(flat)
    setattr(flat, _FLAT_ATTR, sink)
    views = _FlatViews.apply(flat, (*numels, flat.numel() - sum(numels)), (*shapes, (-1,)), sink)
    offset = 0
    for v, n in zip(views, numels):
        setattr(v, _ATTR, (sink, offset))
        offset += n
    return list(views[: len(numels)])


def destination(view: torch.Tensor) -> torch.Tensor | None:
    """Where ``view``'s gradient lives in its flat buffer's gradient (same shape and dtype as
    ``view``; accumulate into it, never overwrite), or None when ``view`` is not a
    ``flat_views`` view (then return its gradient as usual)."""
    got = getattr(view, _ATTR, None)
    if got is None:
        return None
    sink, offset = got
    return sink.get()[offset: offset + view.numel()].view(view.shape)


def seed(flat: torch.Tensor, buf: torch.Tensor) -> bool:
    """Make ``buf`` (contiguous, ``flat``'s numel, dtype and device) the start of ``flat``'s
    flat gradient: its views' gradients and direct writes add into ``buf``, which the
    differentiation then returns as ``flat``'s gradient. False (nothing done) when ``flat`` has
    no ``flat_views`` sink or ``buf`` does not fit; then add ``buf`` to the gradient yourself."""
    sink = getattr(flat, _FLAT_ATTR, None)
    if sink is None or not buf.is_contiguous() or (buf.numel(), buf.dtype, buf.device) != (
            sink.numel, sink.dtype, sink.device):
        return False
    if sink.buf is not None:  # written to already: keep those writes
        buf.view(-1).add_(sink.buf)
    sink.buf = buf.view(-1)
    return True
