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
    "cast_copy",
    "cast_copy_ref",
    "gather",
    "gather_ref",
    "interpreting",
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


def _launch(kernel, grid, *args) -> None:
    if interpreting():
        with _INTERPRETER_LOCK:
            kernel[grid](*args, BLOCK=BLOCK)
    else:
        kernel[grid](*args, BLOCK=BLOCK, num_warps=NUM_WARPS)


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
def cast_copy_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
    """dst[i] = dst.dtype(src[i]) (round to nearest even, like torch ``.to``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask)
    if (x.dtype == tl.float32) and (dst_ptr.dtype.element_ty == tl.bfloat16):
        y = _bf16_rtne(x)
    else:
        y = x.to(dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + offs, y, mask=mask)


@triton.jit
def _bf16_rtne(x):
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
def _check_flat(name: str, t: torch.Tensor, dtypes: Sequence[torch.dtype] = _FLOATS) -> None:
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
    _check_flat("gather out", out)
    if table.dtype != torch.int64 or table.dim() != 1 or table.numel() == 0:
        raise ValueError(
            f"gather table must be a non-empty 1-D int64 tensor, got {table.dtype} {tuple(table.shape)}"
        )
    w = table.numel()
    if out.numel() % w:
        raise ValueError(f"gather: out has {out.numel()} elements, not a multiple of {w} peers")
    n = out.numel() // w
    grid = (w, triton.cdiv(n, BLOCK))
    _launch(gather_kernel, grid, table, out, n)
    return out


def accumulate(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``acc += x`` (acc fp32; x fp32/bf16/fp16 of the same length), in place."""
    _check_flat("accumulate acc", acc, (torch.float32,))
    _check_flat("accumulate x", x)
    if acc.numel() != x.numel():
        raise ValueError(f"accumulate: acc has {acc.numel()} elements, x has {x.numel()}")
    if acc.numel():
        _launch(accumulate_kernel, (triton.cdiv(acc.numel(), BLOCK),), acc, x, acc.numel())
    return acc


def scatter_add(table: torch.Tensor, grad: torch.Tensor) -> None:
    """Atomically add slice p of ``grad`` into the fp32 accumulator at ``table[p]``."""
    _check_flat("scatter_add grad", grad)
    if table.dtype != torch.int64 or table.dim() != 1 or table.numel() == 0:
        raise ValueError(f"scatter_add table must be a non-empty 1-D int64 tensor, got {table.dtype}")
    w = table.numel()
    if grad.numel() % w:
        raise ValueError(f"scatter_add: grad has {grad.numel()} elements, not a multiple of {w} owners")
    n = grad.numel() // w
    _launch(scatter_add_kernel, (w, triton.cdiv(n, BLOCK)), table, grad, n)


def cast_copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` with the dtype conversion fused into the copy."""
    _check_flat("cast_copy dst", dst)
    _check_flat("cast_copy src", src)
    if dst.numel() != src.numel():
        raise ValueError(f"cast_copy: dst has {dst.numel()} elements, src has {src.numel()}")
    if dst.numel():
        _launch(cast_copy_kernel, (triton.cdiv(dst.numel(), BLOCK),), dst, src, dst.numel())
    return dst
