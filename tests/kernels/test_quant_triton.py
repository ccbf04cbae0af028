"""The Triton quantizer (odcfn.kernels.quant_triton) and the fp8 cast-copy against the torch
implementation of the formats, under triton's interpreter (not yet run on hardware):
``quantize`` writes ``quant.encode``'s bytes, ``dequantize`` gives ``quant.decode``'s values (fp32
and bf16 outputs), and ``cast_copy`` into ``torch.float8_e4m3fn`` gives torch's own cast's bits."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_saved = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    import odcfn.kernels.quant_triton as QT
    import odcfn.kernels.triton_ops as T

    if not T.interpreting():
        T = importlib.reload(T)
    # another test may have imported the quantizer compiled, or against an older triton_ops
    if type(QT.quantize_kernel).__name__ != "InterpretedFunction" or QT.e4m3_rtne is not T.e4m3_rtne:
        QT = importlib.reload(QT)
    # triton imports gluon lazily at a launch's first specialisation, asserting the interpreter
    # mode then: import it now, while the variable is set
    import triton.experimental.gluon  # noqa: F401
finally:
    if _saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _saved

from odcfn.kernels.quant import decode, encode, get_format  # noqa: E402


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(-torch.randint(0, 14, (n,), generator=g).float())
    x[: min(n, 128)] = 0.0  # an all-zero block
    if n > 300:
        x[300] = float("nan")  # a non-finite block
    return x


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("n", [1, 127, 128, 300, 1000])
def test_quantize_and_dequantize_equal_the_torch_formats(name, n):
    fmt = get_format(name)
    for src_dtype in (torch.float32, torch.bfloat16):
        x = _data(n, n).to(src_dtype)
        got = QT.quantize(x, fmt)
        assert torch.equal(got, encode(x, fmt)), (name, n, src_dtype)
        for out_dtype in (torch.float32, torch.bfloat16):
            a = QT.dequantize(got, fmt, torch.empty(n, dtype=out_dtype))
            b = decode(got, fmt, torch.empty(n, dtype=out_dtype))
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (name, n, src_dtype, out_dtype)


def test_cast_copy_into_float8_e4m3fn_gives_torchs_bits():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    pos = grid[grid > 0].unique().sort().values
    g = torch.Generator().manual_seed(0)
    x = torch.cat([grid, (pos[1:] + pos[:-1]) / 2, torch.randn(3000, generator=g) * 30, torch.tensor([-0.0])])
    x = x.clamp(-448, 448)
    for src in (x, x.to(torch.bfloat16)):
        dst = torch.empty(src.numel(), dtype=torch.float8_e4m3fn)
        T.cast_copy(dst, src)
        assert torch.equal(dst.view(torch.uint8), src.to(torch.float8_e4m3fn).view(torch.uint8))


def test_a_non_power_of_two_block_is_refused():
    with pytest.raises(ValueError, match="power-of-two block"):
        QT.quantize(torch.zeros(10), get_format("int8", 100))
