"""The wire formats of odcfn.kernels.quant against second implementations.

- fp8 E4M3: the arithmetic encoder's bits equal torch's own ``float8_e4m3fn`` cast on every
  finite E4M3 value, every midpoint between neighbours (ties to even) and random values over
  all binades; a block round trip equals ``(x / s).to(torch.float8_e4m3fn).float() * s`` with
  the per-block scale computed here.
- int8: a round trip equals a per-block numpy reference written here (``np.rint``: half to even).
- values representable in a format (grid values times a power-of-two scale) come back exactly,
  in fp32 and in bf16;
- the measured error of random data stays within the format's per-block bound, and the bound
  is the format's (absmax * 2**-4 for E4M3, absmax / 254 for int8): not a vacuous one;
- sizes (scales included) are exact; zeros and non-finite blocks behave as documented.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from odcfn.kernels.quant import (
    _e4m3_bits,
    decode,
    encode,
    error_bound,
    get_format,
    publish,
    resident,
    roundtrip,
    unpublish,
)

FP8, INT8, BF16 = get_format("fp8_e4m3"), get_format("int8"), get_format("bf16")


def _e4m3_grid() -> torch.Tensor:
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]


def test_e4m3_bits_equal_torch_float8_on_grid_ties_and_random_values():
    grid = _e4m3_grid()
    pos = grid[grid > 0].unique().sort().values
    mids = (pos[1:] + pos[:-1]) / 2  # exact ties: round half to even
    g = torch.Generator().manual_seed(0)
    rnd = torch.randn(20000, generator=g) * torch.exp2(torch.randint(-12, 9, (20000,), generator=g).float())
    x = torch.cat([grid, mids, -mids, rnd.clamp(-448, 448), torch.tensor([0.0, -0.0, 448.0, 2.0**-9 / 2])])
    ours = _e4m3_bits(x)
    theirs = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (ours != theirs).nonzero().reshape(-1)
    assert bad.numel() == 0, [(float(x[i]), int(ours[i]), int(theirs[i])) for i in bad[:5]]


def _fp8_reference(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.numel()
    pad = torch.zeros(-(-n // block) * block)
    pad[:n] = x
    b = pad.view(-1, block)
    s = b.abs().amax(1, keepdim=True) / 448.0
    s[s == 0] = 1.0
    return ((b / s).to(torch.float8_e4m3fn).float() * s).reshape(-1)[:n]


def _int8_reference(x: np.ndarray, block: int) -> np.ndarray:
    out = np.empty_like(x)
    for lo in range(0, x.size, block):
        b = x[lo : lo + block]
        s = np.float32(np.abs(b).max()) / np.float32(127.0) if np.abs(b).max() > 0 else np.float32(1.0)
        q = np.clip(np.rint(b / s), -127, 127)
        out[lo : lo + block] = (q * s).astype(np.float32)
    return out


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 700),
    scale=st.sampled_from([1e-6, 1e-2, 1.0, 300.0, 1e5]),
    block=st.sampled_from([32, 128]),
    seed=st.integers(0, 2**16),
)
def test_round_trips_equal_second_implementations(n, scale, block, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    x[torch.rand(n, generator=g) < 0.1] = 0.0
    fp8, int8 = get_format("fp8_e4m3", block), get_format("int8", block)
    assert torch.equal(roundtrip(x, fp8), _fp8_reference(x, block))
    assert torch.equal(roundtrip(x, int8), torch.from_numpy(_int8_reference(x.numpy(), block)))


def test_representable_values_come_back_exactly():
    g = torch.Generator().manual_seed(1)
    grid = _e4m3_grid()
    for e in (-20, -3, 0, 7):
        # fp8: E4M3 grid values, one block's max 448, times 2**e: the scale is exactly 2**e
        v = grid[torch.randint(0, grid.numel(), (300,), generator=g)]
        v[::128] = 448.0
        x = v * 2.0**e
        # int8: integers in [-127, 127], one per block 127, times 2**e
        q = torch.randint(-127, 128, (300,), generator=g).float()
        q[::128] = 127.0
        y = q * 2.0**e
        for fmt, t in ((FP8, x), (INT8, y)):
            assert torch.equal(roundtrip(t, fmt), t), (fmt.name, e)
            # <= 8 significant bits times a power of two: exact in bf16 too
            assert torch.equal(roundtrip(t, fmt, torch.bfloat16), t.to(torch.bfloat16)), (fmt.name, e)
    b = torch.randn(300, generator=g).to(torch.bfloat16).float()
    assert torch.equal(roundtrip(b, BF16), b)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 1000), seed=st.integers(0, 2**16), spread=st.integers(0, 12))
def test_error_within_the_formats_per_block_bound(n, seed, spread):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread over 2**spread within a block: small values meet fp8's subnormals
    x = torch.randn(n, generator=g) * torch.exp2(-torch.randint(0, spread + 1, (n,), generator=g).float())
    for fmt, per_block in ((FP8, 2.0**-4), (INT8, 1 / 254)):
        err = (roundtrip(x, fmt) - x).abs()
        bound = error_bound(x, fmt)
        assert bool((err <= bound).all()), (fmt.name, float((err - bound).max()))
        for lo in range(0, n, 128):  # the bound is the format's, per block
            amax = float(x[lo : lo + 128].abs().max())
            assert float(bound[lo : lo + 128].max()) <= amax * per_block * (1 + 2**-10) + 1e-30
    assert n < 4 or float((roundtrip(x, INT8) - x).abs().max()) > 0  # it did quantize


def test_sizes_are_exact_scales_included():
    for n in (1, 127, 128, 129, 1000, 4096):
        blocks = -(-n // 128)
        assert FP8.nbytes(n) == INT8.nbytes(n) == -(-n // 4) * 4 + 4 * blocks
        assert encode(torch.randn(n), FP8).numel() == FP8.nbytes(n)
        assert BF16.nbytes(n) == 2 * n and get_format("fp32").nbytes(n) == 4 * n
    # the gather ratio against bf16 the benchmark reports: (1 + 4/128) / 2
    assert FP8.nbytes(4096) / BF16.nbytes(4096) == pytest.approx((1 + 4 / 128) / 2, abs=0)


def test_zero_and_nonfinite_blocks():
    x = torch.zeros(384)
    x[128:256] = torch.randn(128)
    x[200] = float("nan")
    x[300] = float("inf")
    for fmt in (FP8, INT8):
        y = roundtrip(x, fmt)
        assert torch.equal(y[:128], torch.zeros(128))  # an all-zero block: exact zeros
        assert bool(y[128:256].isnan().all()) and bool(y[256:].isnan().all())  # non-finite stays so
    ok = torch.randn(256)
    out = torch.empty(256, dtype=torch.bfloat16)
    decode(encode(ok, INT8), INT8, out)  # into the compute dtype: q * s in fp32, then one cast
    assert torch.equal(out, roundtrip(ok, INT8).to(torch.bfloat16))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("n", [1, 130, 333])
def test_a_shard_held_resident_publishes_the_bytes_a_fresh_encode_gives(name, n):
    """A frozen shard encoded once (``resident``) publishes exactly the bytes publishing its values
    gives, is typed by the format's element type, and decodes to the same values."""
    fmt = get_format(name, 64)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    held = resident(x, fmt)
    assert held.dtype == fmt.element_dtype and held.numel() * held.element_size() == fmt.nbytes(n)
    want = publish(None, x, torch.float32, fmt)
    got = publish(None, held, torch.float32, fmt)
    assert got.dtype == torch.uint8 and torch.equal(got, want)
    again = publish(got, held, torch.float32, fmt)  # the buffer is reused in place
    assert again.data_ptr() == got.data_ptr() and torch.equal(again, want)
    out = torch.empty(n, dtype=torch.bfloat16)
    assert torch.equal(unpublish(got, out, fmt), roundtrip(x, fmt).to(torch.bfloat16))


def test_a_resident_shard_published_in_another_format_is_refused():
    held = resident(torch.randn(300), INT8)
    for fmt in (None, FP8):
        with pytest.raises(ValueError, match="a shard held encoded"):
            publish(None, held, torch.float32, fmt)
