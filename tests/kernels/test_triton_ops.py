"""Triton kernels vs their torch references, on CPU through triton's interpreter.

The interpreter is chosen when the kernels are *decorated*, so this module imports
``odcfn.kernels.triton_ops`` with ``TRITON_INTERPRET=1`` (reloading it if another test imported
it compiled) and restores the variable afterwards, leaving other tests untouched.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import triton  # noqa: F401  (the gpu extra: a hard requirement of these tests)
from hypothesis import given, settings
from hypothesis import strategies as st

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import odcfn.kernels.triton_ops as T

    if not T.interpreting():
        T = importlib.reload(T)
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

DTYPES = [torch.float32, torch.bfloat16]
# sizes straddle the block (1024): below, at, just above, and not multiples of anything nice
SIZES = st.sampled_from([1, 7, 100, 1023, 1024, 1025, 2049, 3001])


def _rand(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, generator=gen) * 3).to(dtype)


def test_interpreter_is_active():
    assert T.interpreting()


@settings(max_examples=12, deadline=None)
@given(w=st.integers(1, 4), n=SIZES, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_gather_equals_reference(w, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    srcs = [_rand(n, dtype, gen) for _ in range(w)]
    out = torch.full((w * n,), float("nan"), dtype=dtype)
    T.gather(T.pointer_table(srcs, out.device), out)
    ref = T.gather_ref(srcs, torch.empty_like(out))
    assert torch.equal(out, ref)  # a copy is exact, every element written (no NaN left)


def test_gather_reads_through_the_table_not_positionally():
    """Permuting the table permutes the output blocks: the kernel really follows the pointers."""
    srcs = [torch.full((50,), float(i)) for i in range(3)]
    out = torch.empty(150)
    T.gather(T.pointer_table([srcs[2], srcs[0], srcs[1]], out.device), out)
    assert out.view(3, 50)[:, 0].tolist() == [2.0, 0.0, 1.0]


@settings(max_examples=12, deadline=None)
@given(n=SIZES, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_accumulate_equals_reference(n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    acc = _rand(n, torch.float32, gen)
    x = _rand(n, dtype, gen)
    ref = acc.clone().add_(x.double().float())  # upcast is exact, so one fp32 add each: bit-equal
    T.accumulate(acc, x)
    assert torch.equal(acc, ref)


@settings(max_examples=10, deadline=None)
@given(w=st.integers(1, 3), n=SIZES, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_scatter_add_equals_reference(w, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    accs = [_rand(n, torch.float32, gen) for _ in range(w)]
    refs = [a.clone() for a in accs]
    grad = _rand(w * n, dtype, gen)
    T.scatter_add(T.pointer_table(accs, torch.device("cpu")), grad)
    T.scatter_add_ref(refs, grad)
    for a, r in zip(accs, refs):
        assert torch.equal(a, r)


def test_scatter_add_with_aliased_owners_adds_every_slice():
    """Two table entries pointing at ONE accumulator: on a GPU those programs run concurrently,
    so only an atomic add keeps both slices (the PTX check in test_gpu_compile shows
    ``red.global.add``); here the sum must simply contain both, exactly (small integers)."""
    n = 1500
    acc = torch.zeros(n)
    grad = torch.cat([torch.full((n,), 1.0), torch.full((n,), 2.0), torch.full((n,), 4.0)])
    T.scatter_add(T.pointer_table([acc, acc, acc], acc.device), grad)
    assert torch.equal(acc, torch.full((n,), 7.0))


@settings(max_examples=12, deadline=None)
@given(
    n=SIZES,
    pair=st.sampled_from(
        [
            (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.float32),
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_cast_copy_matches_torch_bits(n, pair, seed):
    src_dtype, dst_dtype = pair
    gen = torch.Generator().manual_seed(seed)
    src = _rand(n, src_dtype, gen)
    dst = torch.empty(n, dtype=dst_dtype)
    T.cast_copy(dst, src)
    assert torch.equal(
        dst.view(torch.int16 if dst_dtype == torch.bfloat16 else torch.int32),
        src.to(dst_dtype).view(torch.int16 if dst_dtype == torch.bfloat16 else torch.int32),
    )


def test_cast_copy_rounds_to_nearest_even_at_the_edges():
    """Hand-picked fp32 values: ties go to even, carries ripple into the exponent, inf/NaN and
    the largest finite values overflow to inf: torch's bits (the interpreter alone truncates)."""
    bits = torch.tensor(
        [
            0x3F808000,  # tie, lsb 0 -> stays 0x3F80
            0x3F818000,  # tie, lsb 1 -> rounds up to 0x3F82
            0x3F80FFFF,  # just above half -> up
            0x3FFFFFFF,  # carry into the exponent
            0x7F7FFFFF,  # max finite -> inf, as torch does
            0x7F800000,
            0xFF800000,  # +-inf
            0x7FC00001,  # NaN
            0x00000001,  # smallest subnormal
            0x80000000,  # -0
        ],
        dtype=torch.int64,
    ).to(torch.int32)
    src = bits.view(torch.float32)
    dst = torch.empty(src.numel(), dtype=torch.bfloat16)
    T.cast_copy(dst, src)
    ref = src.to(torch.bfloat16)
    nan = torch.isnan(src)
    assert torch.isnan(dst[nan]).all()  # NaN stays NaN (torch and the kernel differ in payload)
    assert dst[~nan].view(torch.int16).tolist() == ref[~nan].view(torch.int16).tolist()


def test_bad_inputs_raise_clear_errors():
    a = torch.zeros(10)
    with pytest.raises(ValueError, match="accumulate: acc has 10 elements, x has 9"):
        T.accumulate(a, torch.zeros(9))
    with pytest.raises(ValueError, match="accumulate acc has dtype torch.bfloat16"):
        T.accumulate(a.bfloat16(), a)
    with pytest.raises(ValueError, match="not a multiple of 3 peers"):
        T.gather(T.pointer_table([a, a, a], a.device), torch.zeros(10))
    with pytest.raises(ValueError, match="1-D and contiguous"):
        T.cast_copy(torch.zeros(4, 4), torch.zeros(4, 4))
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        T.pointer_table([a[1:]], a.device)
    with pytest.raises(ValueError, match="int64"):
        T.scatter_add(torch.zeros(2, dtype=torch.int32), a)
