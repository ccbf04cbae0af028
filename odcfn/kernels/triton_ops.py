"""Triton kernels for the GPU transports, each with a torch reference of the same signature.

- ``gather``: W peer shards -> one full flat buffer, ONE launch, peers addressed through a table
  of raw device pointers (int64), chunked over a 2-D grid (peer, chunk).
- ``accumulate``: ``acc_fp32 += x`` with ``x`` fp32 or bf16, upcast in registers.
- ``scatter_add``: a full flat gradient -> each owner's fp32 accumulator through a pointer table,
  with atomic adds, so concurrent writers into one owner lose nothing (the remote-add mode).
- ``cast_copy``: ``dst = src.to(dst.dtype)`` in one pass (publishing fp32 master shards as bf16).

The pointer tables make one kernel serve local memory, CUDA-IPC-mapped peer memory and NVSHMEM
peer pointers alike. The ``*_ref`` functions are the semantics; the kernels must equal them
(bit-exactly for copies, to fp32 rounding for sums). Importing this module needs ``triton``; the
launchers need CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was
imported (that is how the CPU test-suite runs them).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "BLOCK",
    "accumulate",
    "accumulate_ref",
    "bf16_rtne",
    "cast_copy",
    "cast_copy_ref",
    "check_flat",
    "e4m3_rtne",
    "e4m3_value",
    "gather",
    "gather_ref",
    "interpreting",
    "launch",
    "pointer_table",
    "scatter_add",
    "scatter_add_ref",
]

# 1024 elements x 4 warps: each thread moves 8 contiguous fp32 (two 128-bit accesses) per block.
BLOCK = 1024
NUM_WARPS = 4
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# The interpreter patches module-level state while a kernel runs: two threads launching at once
# corrupt each other (measured). Launches are serialised under it; compiled launches are not.
_INTERPRETER_LOCK = threading.Lock()


def launch(kernel, grid, *args, block: int = BLOCK, **constexprs) -> None:
    if interpreting():
        with _INTERPRETER_LOCK:
            kernel[grid](*args, BLOCK=block, **constexprs)
    else:
        kernel[grid](*args, BLOCK=block, num_warps=NUM_WARPS, **constexprs)


def interpreting() -> bool:
    """True when this module's kernels run on the CPU through triton's interpreter (the module
    was imported while ``TRITON_INTERPRET=1``)."""
    return type(gather_kernel).__name__ == "InterpretedFunction"


# --- kernels ----------------------------------------------------------------------------------
@triton.jit
def gather_kernel(table_ptr, out_ptr, shard_size, BLOCK: tl.constexpr):
    """out[p * shard_size + i] = table[p][i] for every peer p (program axis 0) and chunk (axis 1)."""
    peer = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < shard_size
    # The table holds raw addresses; their 16-byte alignment is the caller's contract (checked
    # in ``pointer_table``), and telling the compiler lets it emit 128-bit loads.
    src = tl.load(table_ptr + peer).to(tl.pointer_type(out_ptr.dtype.element_ty))
    src = tl.multiple_of(src, 16)
    x = tl.load(src + offs, mask=mask)
    tl.store(out_ptr + peer.to(tl.int64) * shard_size + offs, x, mask=mask)


@triton.jit
def accumulate_kernel(acc_ptr, x_ptr, n, BLOCK: tl.constexpr):
    """acc[i] += float32(x[i]); one owner of ``acc`` (no atomics)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    a = tl.load(acc_ptr + offs, mask=mask)
    tl.store(acc_ptr + offs, a + x, mask=mask)


@triton.jit
def scatter_add_kernel(table_ptr, grad_ptr, shard_size, BLOCK: tl.constexpr):
    """table[p][i] += float32(grad[p * shard_size + i]) atomically (many writers per owner)."""
    peer = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < shard_size
    dst = tl.load(table_ptr + peer).to(tl.pointer_type(tl.float32))
    dst = tl.multiple_of(dst, 16)
    g = tl.load(grad_ptr + peer.to(tl.int64) * shard_size + offs, mask=mask).to(tl.float32)
    # system scope: writers may be other GPUs of the node (peer memory over NVLink)
    tl.atomic_add(dst + offs, g, mask=mask, sem="relaxed", scope="sys")


@triton.jit
def cast_copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr, FP8: tl.constexpr = False):
    """dst[i] = dst.dtype(src[i]) (round to nearest even, like torch ``.to``). ``FP8``: ``dst`` is
    the uint8 view of a ``float8_e4m3fn`` tensor and gets its E4M3 bits (``e4m3_rtne``; values
    beyond +-448 saturate to +-448, which torch's own cast leaves undefined)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask)
    if FP8:
        y = e4m3_rtne(x.to(tl.float32))
    elif (x.dtype == tl.float32) and (dst_ptr.dtype.element_ty == tl.bfloat16):
        y = bf16_rtne(x)
    else:
        y = x.to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + offs, y, mask=mask)


@triton.jit
def e4m3_rtne(y):
    """fp32 -> E4M3 ("fn": bias 7, no inf, max 448) bits as uint8, round to nearest even, spelled
    out in integer ops (as ``bf16_rtne``) so the interpreter and the GPU give torch's bits.
    Normals keep 3 of fp32's 23 mantissa bits (the bf16 trick with a 20-bit shift, the carry
    running into the exponent); below 2**-6 the quantum is 2**-9, rounded with the 1.5 * 2**23
    magic number (fp32 addition rounds to nearest even). NaN -> 0x7F."""
    a = tl.minimum(tl.abs(y), 448.0)
    u = a.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFFF + ((u >> 20) & 1)) >> 20  # exponent and 3 mantissa bits, rounded
    normal = (((r >> 3) & 0xFF).to(tl.int32) - 120) * 8 + (r & 7).to(tl.int32)
    m = (a * 512.0 + 12582912.0) - 12582912.0  # subnormal steps of 2**-9; 8 means 2**-6 (bits 0x08)
    bits = tl.where(a < 0.015625, m.to(tl.int32), normal)
    bits = tl.where(y != y, 0x7F, bits)
    sign = ((y.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.int32)
    return (bits | sign).to(tl.uint8)


@triton.jit
def e4m3_value(b):
    """E4M3 bits (uint8) -> fp32, exactly (every E4M3 value is an fp32)."""
    b = b.to(tl.int32)
    e, m = (b >> 3) & 15, (b & 7).to(tl.float32)
    normal = ((e + 120) << 23) | ((b & 7) << 20)  # (1 + m/8) * 2**(e-7) in fp32 bits
    v = tl.where(e == 0, m * 0.001953125, normal.to(tl.float32, bitcast=True))
    v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def bf16_rtne(x):
    """fp32 -> bf16, round to nearest even (torch's rounding), NaN -> quiet NaN 0x7FC0, spelled out in
    integer ops because the triton interpreter truncates this cast (measured) while the GPU
    rounds; written this way both give torch's bits."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


# --- references -------------------------------------------------------------------------------
def gather_ref(srcs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    n = srcs[0].numel()
    for p, s in enumerate(srcs):
        out[p * n : (p + 1) * n].copy_(s)
    return out


def accumulate_ref(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return acc.add_(x.to(torch.float32))


def scatter_add_ref(accs: Sequence[torch.Tensor], grad: torch.Tensor) -> None:
    n = accs[0].numel()
    for p, a in enumerate(accs):
        a.add_(grad[p * n : (p + 1) * n].to(torch.float32))


def cast_copy_ref(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    return dst.copy_(src)


# --- launchers --------------------------------------------------------------------------------
def check_flat(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = _FLOATS) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be 1-D and contiguous, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}, expected one of {list(dtypes)}")
    if not (t.is_cuda or interpreting()):
        raise ValueError(
            f"{name} is on {t.device}: triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before importing triton, for CPU tests)"
        )


def pointer_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 tensor of the tensors' data pointers (each must be 16-byte aligned)."""
    ptrs = [t.data_ptr() for t in tensors]
    bad = [i for i, p in enumerate(ptrs) if p % 16]
    if bad:
        raise ValueError(f"pointer_table: entries {bad} are not 16-byte aligned")
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def gather(table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (W * shard_size) from the W shards addressed by ``table`` (int64 pointers to
    arrays of ``out.dtype``)."""
    check_flat("gather out", out)
    if table.dtype != torch.int64 or table.dim() != 1 or table.numel() == 0:
        raise ValueError(
            f"gather table must be a non-empty 1-D int64 tensor, got {table.dtype} {tuple(table.shape)}"
        )
    w = table.numel()
    if out.numel() % w:
        raise ValueError(f"gather: out has {out.numel()} elements, not a multiple of {w} peers")
    n = out.numel() // w
    grid = (w, triton.cdiv(n, BLOCK))
    launch(gather_kernel, grid, table, out, n)
    return out


def accumulate(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``acc += x`` (acc fp32; x fp32/bf16/fp16 of the same length), in place."""
    check_flat("accumulate acc", acc, (torch.float32,))
    check_flat("accumulate x", x)
    if acc.numel() != x.numel():
        raise ValueError(f"accumulate: acc has {acc.numel()} elements, x has {x.numel()}")
    if acc.numel():
        launch(accumulate_kernel, (triton.cdiv(acc.numel(), BLOCK),), acc, x, acc.numel())
    return acc


def scatter_add(table: torch.Tensor, grad: torch.Tensor) -> None:
    """Atomically add slice p of ``grad`` into the fp32 accumulator at ``table[p]``."""
    check_flat("scatter_add grad", grad)
    if table.dtype != torch.int64 or table.dim() != 1 or table.numel() == 0:
        raise ValueError(f"scatter_add table must be a non-empty 1-D int64 tensor, got {table.dtype}")
    w = table.numel()
    if grad.numel() % w:
        raise ValueError(f"scatter_add: grad has {grad.numel()} elements, not a multiple of {w} owners")
    n = grad.numel() // w
    launch(scatter_add_kernel, (w, triton.cdiv(n, BLOCK)), table, grad, n)


def cast_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` with the dtype conversion fused into the copy; ``dst`` may be
    ``torch.float8_e4m3fn`` (written through its uint8 view: the interpreter has no fp8 type)."""
    fp8 = getattr(torch, "float8_e4m3fn", None)
    check_flat("cast_copy dst", dst, (*_FLOATS, fp8) if fp8 is not None else _FLOATS)
    check_flat("cast_copy src", src)
    if dst.numel() != src.numel():
        raise ValueError(f"cast_copy: dst has {dst.numel()} elements, src has {src.numel()}")
    if dst.numel():
        grid = (triton.cdiv(dst.numel(), BLOCK),)
        if fp8 is not None and dst.dtype == fp8:
            launch(cast_copy_kernel, grid, dst.view(torch.uint8), src, dst.numel(), FP8=True)
        else:
            launch(cast_copy_kernel, grid, dst, src, dst.numel())
    return dst
