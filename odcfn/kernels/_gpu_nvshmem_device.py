"""Triton kernels that call NVSHMEM device functions (used by ``odcfn.kernels.nvshmem``).

Stock Triton has no NVSHMEM bindings, so the device API is reached through
``core.extern_elementwise`` on the bitcode the nvidia-nvshmem wheels ship (``device_bitcode``);
the compiler links it into the kernel.
Pointers cross the boundary as int64 (symmetric addresses are plain device addresses), sizes as
uint64, PEs as int32. Functions that return void in C are declared here as returning int32 and
the result is discarded; NVSHMEM's ``*_block`` functions must be called by every thread of the
CTA, which is what a scalar call in a Triton program does.

A module that uses these kernels must be registered with NVSHMEM (``nvshmemx_cumodule_init``)
before its first launch; ``odcfn.kernels.nvshmem`` does that. Importing this file needs only
triton; compiling needs the bitcode (``device_bitcode()``), launching needs an initialised
NVSHMEM job.
"""

from __future__ import annotations

import functools
import os

import triton
import triton.language as tl
from triton.language import core

__all__ = [
    "KERNELS",
    "device_bitcode",
    "nvshmem_gather_kernel",
    "nvshmem_put_signal_kernel",
    "nvshmem_signal_kernel",
]

SIGNAL_SET = tl.constexpr(0)  # NVSHMEM_SIGNAL_SET
SIGNAL_ADD = tl.constexpr(5)  # NVSHMEM_SIGNAL_ADD


@functools.cache
def device_bitcode(arch: int = 90) -> str:
    """Path of NVSHMEM's device bitcode for ``sm_{arch}`` from an nvidia-nvshmem wheel.

    nvidia-nvshmem 3.8.0 ships one file per architecture (``libnvshmem_device_sm_90.bc``); 3.4.5
    (torch 2.11's pin, as nvidia-nvshmem-cu13) a single ``libnvshmem_device.bc`` for all, and it
    is the one triton 3.6's LLVM can read. The per-architecture file wins where both exist. The
    cu12 and cu13 wheels both install into ``nvidia/nvshmem``."""
    try:
        import nvidia.nvshmem as pkg  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(
            "NVSHMEM device bitcode not found: install the 'gpu' extra (nvshmem4py-cu12 pulls "
            "nvidia-nvshmem-cu12) or nvidia-nvshmem-cu13"
        ) from e
    roots = list(getattr(pkg, "__path__", []))
    names = (f"libnvshmem_device_sm_{arch}.bc", "libnvshmem_device.bc")
    for name in names:
        for root in roots:
            path = os.path.join(root, "lib", name)
            if os.path.exists(path):
                return path
    raise RuntimeError(f"none of {list(names)} found under {roots}")


_LIB = "libnvshmem_device"


def _path() -> str:
    # extern_elementwise wants a path at trace time; the options' extern_libs decide what is
    # linked, so an empty string is enough here (see ``compile_options``).
    return ""


@core.extern
def getmem_block(dest, source, nbytes, pe, _semantic=None):
    return core.extern_elementwise(
        _LIB,
        _path(),
        [dest, source, nbytes, pe],
        {(core.int64, core.int64, core.uint64, core.int32): ("nvshmemx_getmem_block", core.int32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    return core.extern_elementwise(
        _LIB,
        _path(),
        [dest, source, nbytes, sig_addr, signal, sig_op, pe],
        {
            (core.int64, core.int64, core.uint64, core.int64, core.uint64, core.int32, core.int32): (
                "nvshmemx_putmem_signal_nbi_block",
                core.int32,
            )
        },
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    return core.extern_elementwise(
        _LIB,
        _path(),
        [sig_addr, signal, sig_op, pe],
        {(core.int64, core.uint64, core.int32, core.int32): ("nvshmemx_signal_op", core.int32)},
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def quiet(_semantic=None):
    return core.extern_elementwise(
        _LIB, _path(), [], {(): ("nvshmem_quiet", core.int32)}, is_pure=False, _semantic=_semantic
    )


# --- kernels ----------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["src_addr", "shard_bytes"])
def nvshmem_gather_kernel(out_ptr, src_addr, pes_ptr, pos_ptr, shard_bytes, CHUNK_BYTES: tl.constexpr):
    """Pull ``shard_bytes`` at symmetric address ``src_addr`` from PE ``pes[p]`` into output
    block ``pos[p]`` (``out + pos[p] * shard_bytes``); program (p, c) moves chunk c. One-sided:
    the owner's GPU runs nothing."""
    p = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    pe = tl.load(pes_ptr + p)
    block = tl.load(pos_ptr + p).to(tl.int64)
    lo = c * CHUNK_BYTES
    nbytes = tl.minimum(shard_bytes - lo, CHUNK_BYTES)
    dest = out_ptr.to(tl.int64, bitcast=True) + block * shard_bytes + lo
    getmem_block(dest, src_addr.to(tl.int64) + lo, nbytes.to(tl.uint64), pe)


@triton.jit(do_not_specialize=["shard_bytes", "nbytes", "dst_addr", "sig_addr", "chunk_lo"])
def nvshmem_put_signal_kernel(
    src_ptr, shard_bytes, nbytes, dst_addr, sig_addr, sig_vals_ptr, pes_ptr, chunk_lo
):
    """Program p puts ``nbytes`` of ``src[p * shard_bytes + chunk_lo:]`` into the landing slot
    at symmetric ``dst_addr`` on PE ``pes[p]``, then sets that PE's ``sig_addr`` to
    ``sig_vals[p]`` (NVSHMEM orders the signal after the data), and waits for local completion
    so ``src`` may be reused when the kernel ends."""
    p = tl.program_id(0)
    pe = tl.load(pes_ptr + p)
    val = tl.load(sig_vals_ptr + p).to(tl.uint64, bitcast=True)
    src = src_ptr.to(tl.int64, bitcast=True) + p.to(tl.int64) * shard_bytes + chunk_lo
    # scalars arrive as i32 or i64 depending on their value: widen before the typed externs
    putmem_signal_nbi_block(
        dst_addr.to(tl.int64), src, nbytes.to(tl.uint64), sig_addr.to(tl.int64), val, SIGNAL_SET, pe
    )
    quiet()


@triton.jit(do_not_specialize=["sig_addr", "value", "pe"])
def nvshmem_signal_kernel(sig_addr, value, pe):
    """Set the signal word at symmetric ``sig_addr`` on ``pe`` to ``value`` (versions, FINs,
    credits); callers fence their earlier puts first."""
    # small Python ints arrive as i32: widen first, or the 64-bit bitcast is ill-formed
    signal_op(
        sig_addr.to(tl.int64), value.to(tl.int64).to(tl.uint64, bitcast=True), SIGNAL_SET, pe.to(tl.int32)
    )


# name -> (kernel, signature, constexprs, divisible args): what CI compiles for sm_90.
KERNELS = {
    "nvshmem_gather": (
        nvshmem_gather_kernel,
        {
            "out_ptr": "*u8",
            "src_addr": "i64",
            "pes_ptr": "*i32",
            "pos_ptr": "*i32",
            "shard_bytes": "i64",
            "CHUNK_BYTES": "constexpr",
        },
        {"CHUNK_BYTES": 65536},
        ("out_ptr",),
    ),
    "nvshmem_put_signal": (
        nvshmem_put_signal_kernel,
        {
            "src_ptr": "*u8",
            "shard_bytes": "i64",
            "nbytes": "i64",
            "dst_addr": "i64",
            "sig_addr": "i64",
            "sig_vals_ptr": "*i64",
            "pes_ptr": "*i32",
            "chunk_lo": "i64",
        },
        {},
        ("src_ptr",),
    ),
    # value as i32: the narrow case a small step number takes at launch
    "nvshmem_signal": (nvshmem_signal_kernel, {"sig_addr": "i64", "value": "i32", "pe": "i32"}, {}, ()),
}
