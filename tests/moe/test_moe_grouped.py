"""The routed experts' grouped compute (``odcfn.moe.experts.ffn_rows``): two
``torch._grouped_mm`` calls over the rows sorted by expert, against each expert's SwiGLU written
out here with plain matmuls in float64 (values and gradients of rows, weights and routing
scale); shapes the kernel cannot take (rows not a multiple of 16 bytes) take the per-expert
loop and agree the same way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from odcfn.moe import experts


def _case(D, inner, counts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    R = sum(counts)
    xs = torch.randn(R, D, generator=g).to(dtype).requires_grad_()
    scale = torch.rand(R, generator=g).to(dtype).requires_grad_()
    trees = [
        {
            n: {"weight": (torch.randn(*shape, generator=g) * 0.2).to(dtype).requires_grad_()}
            for n, shape in (("gate_proj", (inner, D)), ("up_proj", (inner, D)), ("down_proj", (D, inner)))
        }
        for _ in counts
    ]
    return xs, scale, trees


def _by_hand(xs, scale, trees, counts):
    """float64, expert by expert: scale_r * down(silu(gate x_r) * up x_r)."""
    out, off = [], 0
    for t, c in zip(trees, counts):
        x = xs[off : off + c].double()
        w = {n: t[n]["weight"].double() for n in t}
        a = F.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)
        out.append(scale[off : off + c, None].double() * (a @ w["down_proj"].T))
        off += c
    return torch.cat(out)


@pytest.mark.parametrize(
    "D,inner,dtype,grouped",
    [
        (16, 8, torch.float32, True),
        (24, 12, torch.float32, True),
        (16, 8, torch.bfloat16, True),
        (6, 8, torch.float32, False),
        (16, 5, torch.float32, False),
    ],
)
def test_grouped_rows_equal_each_expert_by_hand(D, inner, dtype, grouped):
    counts = [3, 1, 7, 2]
    xs, scale, trees = _case(D, inner, counts, dtype)
    assert experts._grouped_ok(xs, inner) is grouped
    got = experts.ffn_rows(xs, trees, counts, scale)
    want = _by_hand(xs, scale, trees, counts)
    gy = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    leaves = [xs, scale, *(t[n]["weight"] for t in trees for n in t)]
    g_got = torch.autograd.grad(got, leaves, gy.to(dtype))
    g_want = torch.autograd.grad(want, leaves, gy.double())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a.double(), b.double(), **tol)
    assert experts.ffn_rows(xs, trees, counts).shape == got.shape  # no scale: the plain SwiGLU
