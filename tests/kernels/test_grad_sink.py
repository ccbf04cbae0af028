"""The head's gradient lands in the unit's flat gradient (``odcfn.kernels.grad_sink``): the same
gradient as autograd through plain views, and no V×D buffer besides the flat gradient itself.

Memory is counted as live tensor bytes op by op (``tests/memtrack.TensorBytes``). Through plain
``split``/``view`` views the fused head's backward holds its fp32 dW and autograd's flat copy at
once (two V×D fp32 buffers, plus a cast copy in bf16); through ``flat_views`` only the flat
gradient, plus tiles."""

from __future__ import annotations

import pytest
import torch

from odcfn.kernels.fused_head import fused_head, head_backward, head_forward
from odcfn.kernels.grad_sink import destination, flat_views
from tests.memtrack import TensorBytes

V, D, T = 4096, 64, 96
SHAPES = ((D,), (V, D))  # a head unit: the final norm's weight, then W
CHUNKS = {"token_chunk": 32, "vocab_chunk": 512}  # tiles of 64 KiB against a 1 MiB V×D fp32


def _flat(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.ones(D), torch.randn(V * D, generator=g) * 0.05, torch.zeros(7)]).to(dtype)


def _inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(T, D, generator=g) * 0.5).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[::5] = -100  # prompt rows: no gradient
    return h, y


def _loss(norm, w, h, y, entropy: bool, twice: bool):
    out = fused_head(h * norm, w, y, temperature=0.9, entropy=entropy, **CHUNKS)
    logp, ent = out if entropy else (out, None)
    loss = logp.sum() + (0.1 * ent.sum() if entropy else 0)
    if twice:  # a second consumer of W (a tied embedding's use): its gradient adds to the head's
        loss = loss + (w[:3].float() ** 2).sum()
    return loss


def _grad(flat: torch.Tensor, sink: bool, entropy: bool, twice: bool) -> torch.Tensor:
    flat = flat.detach().requires_grad_()
    if sink:
        norm, w = flat_views(flat, (D, V * D), SHAPES)
    else:
        norm, w, _ = flat.split([D, V * D, 7])
        w = w.view(V, D)
    h, y = _inputs(flat.dtype)
    (g,) = torch.autograd.grad(_loss(norm, w, h, y, entropy, twice), [flat])
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy,twice", [(False, False), (True, True)])
def test_sink_gives_autograds_gradient(dtype, entropy, twice):
    flat = _flat(dtype)
    plain = _grad(flat, False, entropy, twice)
    sunk = _grad(flat, True, entropy, twice)
    assert sunk.dtype == dtype and sunk.shape == flat.shape
    assert sunk[D + V * D:].eq(0).all()  # padding: zero gradient
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: rounded once per slice vs once at the end
    err = (sunk.double() - plain.double()).norm() / plain.double().norm()
    assert err < tol, err


def _backward_peak(dtype: torch.dtype, sink: bool) -> int:
    flat = _flat(dtype).requires_grad_()
    if sink:
        norm, w = flat_views(flat, (D, V * D), SHAPES)
    else:
        norm, w, _ = flat.split([D, V * D, 7])
        w = w.view(V, D)
    h, y = _inputs(dtype)
    loss = _loss(norm, w, h, y, entropy=True, twice=False)
    with TensorBytes() as m:
        (g,) = torch.autograd.grad(loss, [flat])
    del g
    return m.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_backward_holds_only_the_flat_gradient(dtype):
    vxd = V * D * dtype.itemsize  # the flat gradient's W part, in the compute dtype
    tiles = 4 << 20  # the tile buffers, h-sized temporaries and a vc×D slice: well under this
    before = _backward_peak(dtype, sink=False)
    after = _backward_peak(dtype, sink=True)
    # the control: through plain views the fp32 dW and the flat copy are both alive
    assert before > vxd + V * D * 4, (before, vxd)
    assert after < vxd + tiles and after < before, (after, before, vxd)


def test_dw_out_accumulates_slice_by_slice():
    h, y = _inputs(torch.float32)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(V, D, generator=g) * 0.05
    gl = torch.randn(T, generator=g)
    _, _, lse = head_forward(h, w, y, 1.0, False, **CHUNKS)
    _, dw = head_backward(h, w, y, lse, None, gl, None, 1.0, **CHUNKS)
    for dtype in (torch.float32, torch.bfloat16):
        base = (torch.randn(V, D, generator=g) * 1e-3).to(dtype)
        out = base.clone()
        got = head_backward(h, w, y, lse, None, gl, None, 1.0, dw_out=out, **CHUNKS)[1]
        assert got is out  # added in place, no copy
        want = base.double() + dw.double()
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert ((out.double() - want).norm() / want.norm()) < tol
    with pytest.raises(ValueError, match="dw_out must have W's shape"):
        head_backward(h, w, y, lse, None, gl, None, 1.0, dw_out=torch.zeros(V, D + 1))


def test_destination_only_for_flat_views():
    flat = torch.zeros(10, requires_grad=True)
    a, b = flat_views(flat, (4, 6), ((2, 2), (6,)))
    assert destination(b).shape == (6,) and destination(a).shape == (2, 2)
    assert destination(b).data_ptr() == destination(a).data_ptr() + 4 * 4  # one buffer, offsets
    assert destination(flat) is None and destination(b * 1) is None
