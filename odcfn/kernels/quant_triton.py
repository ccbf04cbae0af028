"""Block quantization on the GPU: the Triton kernels of ``odcfn.kernels.quant``'s formats.

``quantize(x, fmt)`` writes the same bytes as ``quant.encode`` (payload, padding, one fp32 scale
per block) in one launch, one program per block; ``dequantize(data, fmt, out)`` the same values
as ``quant.decode``. E4M3 goes through ``triton_ops.e4m3_rtne`` / ``e4m3_value`` (integer ops:
the interpreter has no fp8 type, and they give torch's bits on both); int8 rounds with the
1.5 * 2**23 magic number (fp32 addition rounds to nearest even). Tested against ``quant`` under
``TRITON_INTERPRET=1`` (tests/kernels/test_quant_triton.py); not yet run on hardware.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from odcfn.kernels.quant import Format
from odcfn.kernels.triton_ops import bf16_rtne, check_flat, e4m3_rtne, e4m3_value, launch

__all__ = ["dequantize", "quantize"]

# triton builtins only (as in fused_head_triton): tl.sum / tl.max are jit functions of triton's
# library, interpreted only if triton itself was imported under TRITON_INTERPRET=1
_sum_combine = tl.standard._sum_combine
_max_combine = tl.standard._elementwise_max


@triton.jit
def quantize_kernel(x_ptr, pay_ptr, scale_ptr, n, TOP: tl.constexpr, INT8: tl.constexpr, BLOCK: tl.constexpr):
    """One block: its scale (absmax / TOP; 1 for zeros; NaN for a non-finite block), then its
    payload (int8 values or E4M3 bits) as bytes."""
    blk = tl.program_id(0).to(tl.int64)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bad = tl.reduce(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), 0, _sum_combine) > 0
    s = tl.reduce(tl.abs(tl.where(x == x, x, 0.0)), 0, _max_combine) / TOP
    s = tl.where(s == 0.0, 1.0, s)
    s = tl.where(bad, float("nan"), s)
    y = x / s
    y = tl.where(y == y, y, 0.0)  # a NaN block decodes through its NaN scale
    y = tl.minimum(tl.maximum(y, -TOP), TOP)
    if INT8:
        q = ((y + 12582912.0) - 12582912.0).to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        q = e4m3_rtne(y)
    tl.store(pay_ptr + offs, q, mask=mask)
    tl.store(scale_ptr + blk, s)


@triton.jit
def dequantize_kernel(pay_ptr, scale_ptr, out_ptr, n, INT8: tl.constexpr, BLOCK: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(pay_ptr + offs, mask=mask, other=0)
    if INT8:
        q = b.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        q = e4m3_value(b)
    v = q * tl.load(scale_ptr + blk)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(out_ptr + offs, bf16_rtne(v), mask=mask)
    else:
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def _split(data: torch.Tensor, fmt: Format, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pad = -(-n // 4) * 4
    return data[:n], data[pad : fmt.nbytes(n)].view(torch.float32)


def _check_fmt(fmt: Format) -> None:
    if fmt.name not in ("int8", "fp8_e4m3"):
        raise ValueError(
            f"the Triton quantizer serves int8 and fp8_e4m3, not {fmt.name!r} (a plain cast: cast_copy)"
        )
    if fmt.block & (fmt.block - 1):  # one program per block: tl.arange needs a power of two
        raise ValueError(f"the Triton quantizer needs a power-of-two block (quant_block), got {fmt.block}")


def quantize(x: torch.Tensor, fmt: Format, out: torch.Tensor | None = None) -> torch.Tensor:
    """``quant.encode(x, fmt)``'s bytes, computed on ``x``'s device."""
    _check_fmt(fmt)
    check_flat("quantize x", x)
    n = x.numel()
    if out is None:
        out = torch.zeros(fmt.nbytes(n), dtype=torch.uint8, device=x.device)
    if out.dtype != torch.uint8 or out.numel() != fmt.nbytes(n):
        raise ValueError(f"quantize: out must be {fmt.nbytes(n)} uint8, got {out.numel()} {out.dtype}")
    pay, scales = _split(out, fmt, n)
    if n:
        top = 127.0 if fmt.name == "int8" else 448.0
        grid = (triton.cdiv(n, fmt.block),)
        launch(quantize_kernel, grid, x, pay, scales, n, block=fmt.block, TOP=top, INT8=fmt.name == "int8")
    return out


def dequantize(data: torch.Tensor, fmt: Format, out: torch.Tensor) -> torch.Tensor:
    """``quant.decode(data, fmt, out)`` on ``data``'s device."""
    _check_fmt(fmt)
    check_flat("dequantize out", out)
    n = out.numel()
    if data.dtype != torch.uint8 or data.numel() != fmt.nbytes(n):
        raise ValueError(f"dequantize: {fmt.name} data of {data.numel()} bytes does not hold {n} values")
    pay, scales = _split(data, fmt, n)
    if n:
        grid = (triton.cdiv(n, fmt.block),)
        launch(dequantize_kernel, grid, pay, scales, out, n, block=fmt.block, INT8=fmt.name == "int8")
    return out
