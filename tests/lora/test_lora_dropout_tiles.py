"""LoRA dropout drawn tile by tile (odcfn/lora/dropout.py): the same function as the whole
mask of ``dropout_mask``, in forward and backward, independent of how samples are packed, and
in memory of a few tiles instead of the (tokens x d_in) fp32 draw the whole mask took."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from odcfn.lora.dropout import TILE, dropout_mask, dropout_plan
from odcfn.models.layers import linear
from tests.memtrack import TensorBytes

P = 0.3
KEY = dict(seed=4, step=7, unit="layers.1", path="mlp.down_proj")


def _whole(ids, lengths, d_in, dtype=torch.float64) -> torch.Tensor:
    return torch.cat([dropout_mask(P, **KEY, sample=i, length=n, d_in=d_in) for i, n in zip(ids, lengths)])


def test_tiled_dropout_equals_the_whole_mask_forward_and_backward():
    ids, lengths, d_in, r = (3, 0, 1), (TILE + 44, 5, 2 * TILE + 1), 24, 3  # tiles cut mid-sample
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), d_in, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(r, d_in, generator=g, dtype=torch.float64, requires_grad=True)
    up = torch.randn(sum(lengths), r, generator=g, dtype=torch.float64)
    got = dropout_plan(P, **KEY, samples=ids, lengths=lengths)(x, a)
    gx, ga = torch.autograd.grad(got, (x, a), up)
    mask = _whole(ids, lengths, d_in)
    assert 0.2 < float(mask.double().mean()) < 0.4
    want = F.linear(x.masked_fill(mask, 0) / (1 - P), a)
    wx, wa = torch.autograd.grad(want, (x, a), up)
    for u, v in ((got, want), (gx, wx), (ga, wa)):
        torch.testing.assert_close(u, v, rtol=1e-12, atol=1e-12)


def test_a_samples_mask_does_not_depend_on_its_microbatch():
    d_in, lengths = 8, (TILE + 3, 17)
    x = torch.randn(sum(lengths), d_in, dtype=torch.float64)
    a = torch.randn(2, d_in, dtype=torch.float64)
    both = dropout_plan(P, **KEY, samples=(5, 2), lengths=lengths)(x, a)
    first = dropout_plan(P, **KEY, samples=(5,), lengths=lengths[:1])(x[: lengths[0]], a)
    second = dropout_plan(P, **KEY, samples=(2,), lengths=lengths[1:])(x[lengths[0]:], a)
    assert torch.equal(both, torch.cat([first, second]))


def test_tiles_of_one_sample_are_drawn_independently():
    m = dropout_mask(P, **KEY, sample=0, length=3 * TILE, d_in=16)
    tiles = m.view(3, TILE, 16)
    assert not torch.equal(tiles[0], tiles[1]) and not torch.equal(tiles[1], tiles[2])


def _peaks(fn, x, a) -> tuple[int, int]:
    """Peak bytes of ``fn(x, a)``'s forward, and of its backward beyond the input's gradient."""
    with TensorBytes() as fwd:
        y = fn(x, a)
    with TensorBytes() as bwd:
        y.backward(torch.ones_like(y))
    return fwd.peak, bwd.peak - x.numel() * x.element_size()


def test_dropout_memory_is_a_few_tiles_not_tokens_times_inputs():
    T, d_in, r = 8 * TILE, 512, 8
    x = torch.randn(T, d_in, requires_grad=True)
    a = torch.randn(r, d_in, requires_grad=True)
    plan = dropout_plan(P, **KEY, samples=(0, 1), lengths=(T // 2, T // 2))
    whole_mask_fp32 = T * d_in * 4

    def tiled(x, a):  # a projection to one output: its own tensors are small
        return linear(x, {"weight": torch.zeros(1, d_in), "lora_A": a, "lora_B": torch.ones(1, r),
                          "lora_scale": 1.0, "lora_drop": plan})

    def whole(x, a):  # what training did before: the whole mask drawn, the dropped input saved
        m = torch.rand(T, d_in) < P
        return F.linear(x.masked_fill(m, 0) * (1 / (1 - P)), a)

    fwd, bwd = _peaks(lambda x, a: plan(x, a), x, a)
    tile = TILE * d_in * 4
    assert fwd <= 3 * tile + T * r * 4, fwd  # a tile's draw, its mask and dropped input; the output
    assert bwd <= 3 * tile + T * r * 4 + a.numel() * 4, bwd
    x.grad = a.grad = None
    before, _ = _peaks(whole, x, a)
    assert before >= whole_mask_fp32 > 4 * fwd  # the measure sees the whole draw when there is one
    x.grad = a.grad = None
    assert _peaks(tiled, x, a)[0] < whole_mask_fp32 // 2  # and linear() takes the tiled path
