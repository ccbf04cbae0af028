"""Triton kernels that call NVSHMEM device functions (used by ``odcfn.transport.gpu.nvshmem``).

Stock Triton has no NVSHMEM bindings, so the device API is reached through
``core.extern_elementwise`` on the bitcode the nvidia-nvshmem wheels ship (``device_bitcode``);
the compiler links it into the kernel.
Triton's ``extern_elementwise`` cannot declare a void function (its op must yield a value), and
declaring NVSHMEM's void functions as returning i32 is a call through a mismatched prototype
(undefined behaviour in LLVM IR; it only compiled because InstCombine rewrote the unused
result). So every NVSHMEM function is reached through a small LLVM IR shim generated from
``DEVICE_FUNCTIONS`` (the C prototypes exactly as NVSHMEM's headers declare them, checked
against the installed wheel's headers by tests/transport/test_gpu_nvshmem_headers.py): ``odcfn_<name>``
takes pointers as int64, calls the real function with its real types (void result, ``ptr``
arguments) and returns i32 0 to Triton. NVSHMEM's ``*_block`` functions must be called by every
thread of the CTA, which is what a scalar call in a Triton program does.

A module that uses these kernels must be registered with NVSHMEM (``nvshmemx_cumodule_init``)
before its first launch; ``odcfn.transport.gpu.nvshmem`` does that. Importing this file needs only
triton; compiling needs the bitcode (``device_bitcode()``), launching needs an initialised
NVSHMEM job.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile

import triton
import triton.language as tl
from triton.language import core

__all__ = [
    "DEVICE_FUNCTIONS",
    "KERNELS",
    "NVSHMEM_SIGNAL_ADD",
    "NVSHMEM_SIGNAL_SET",
    "device_bitcode",
    "extern_libs",
    "shim_ir",
    "nvshmem_gather_kernel",
    "nvshmem_put_signal_kernel",
    "nvshmem_signal_kernel",
]

# nvshmemx_signal_op_t in device_host_transport/nvshmem_common_transport.h (3.4.5 and 3.8.0):
# ``typedef enum { NVSHMEM_SIGNAL_SET = 9, NVSHMEM_SIGNAL_ADD = 10 }``. Any other value is an
# invalid operation: the receiver's wait would never see the word change.
NVSHMEM_SIGNAL_SET = 9
NVSHMEM_SIGNAL_ADD = 10
SIGNAL_SET = tl.constexpr(NVSHMEM_SIGNAL_SET)
SIGNAL_ADD = tl.constexpr(NVSHMEM_SIGNAL_ADD)

# The C prototypes (return type, argument types) of every NVSHMEM device function called here,
# spelled as in host/nvshmemx_api.h and host/nvshmem_api.h. The shim's declarations and the
# Triton-side argument types are both derived from this table, and the table is compared with
# the installed headers in CI, so neither can drift from NVSHMEM.
DEVICE_FUNCTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "nvshmemx_getmem_block": ("void", ("void*", "const void*", "size_t", "int")),
    "nvshmemx_putmem_signal_nbi_block": (
        "void",
        ("void*", "const void*", "size_t", "uint64_t*", "uint64_t", "int", "int"),
    ),
    "nvshmemx_signal_op": ("void", ("uint64_t*", "uint64_t", "int", "int")),
    "nvshmem_quiet": ("void", ()),
}

# C type -> (LLVM type of the real call, LLVM type of the shim's argument, Triton type)
_C_TYPES = {
    "void*": ("ptr", "i64", core.int64),
    "const void*": ("ptr", "i64", core.int64),
    "uint64_t*": ("ptr", "i64", core.int64),
    "size_t": ("i64", "i64", core.uint64),  # size_t is 64-bit on nvptx64
    "uint64_t": ("i64", "i64", core.uint64),
    "int": ("i32", "i32", core.int32),
}
_SHIM_LIB = "odcfn_nvshmem_shim"


def _ctype(t: str) -> str:
    return " ".join(t.replace("*", " * ").split()).replace(" *", "*")


def shim_ir() -> str:
    """The LLVM IR (text) of the wrappers: ``i32 @odcfn_<f>(...)`` calls ``void @<f>(...)``
    with the header's types. ``alwaysinline``: nothing of the shim survives into the PTX."""
    lines = ['target triple = "nvptx64-nvidia-cuda"', ""]
    for name, (ret, args) in DEVICE_FUNCTIONS.items():
        if ret != "void":
            raise ValueError(f"{name}: only void functions are wrapped (returns {ret})")
        real = [_C_TYPES[_ctype(a)][0] for a in args]
        outer = [_C_TYPES[_ctype(a)][1] for a in args]
        lines.append(f"declare void @{name}({', '.join(real)})")
        params = ", ".join(f"{t} %a{i}" for i, t in enumerate(outer))
        lines.append(f"define linkonce_odr i32 @odcfn_{name}({params}) #0 {{")
        call_args = []
        for i, (r, o) in enumerate(zip(real, outer)):
            if r == "ptr" and o == "i64":  # symmetric addresses travel as int64
                lines.append(f"  %p{i} = inttoptr i64 %a{i} to ptr")
                call_args.append(f"ptr %p{i}")
            else:
                call_args.append(f"{r} %a{i}")
        lines.append(f"  call void @{name}({', '.join(call_args)})")
        lines += ["  ret i32 0", "}", ""]
    lines.append("attributes #0 = { alwaysinline nounwind }")
    return "\n".join(lines) + "\n"


@functools.cache
def shim_path() -> str:
    """The shim written once per content into a private (0700) per-user directory: triton's
    ``extern_libs`` take paths, and its LLVM parses textual IR as well as bitcode. Private,
    because a file another user could pre-create would be linked into our kernels."""
    text = shim_ir()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = os.path.join(base, "odcfn")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise RuntimeError(f"{d} must be owned by this user and not group/world writable")
    path = os.path.join(d, f"nvshmem_shim_{hashlib.sha256(text.encode()).hexdigest()[:16]}.ll")
    try:
        with open(path) as f:
            if f.read() == text:
                return path
    except FileNotFoundError:
        pass
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".ll")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # atomic: a concurrent rank reads the old or the new, both whole
    return path


def extern_libs(arch: int = 90) -> tuple[tuple[str, str], ...]:
    """What the NVSHMEM kernels link, in order. The shim comes FIRST: triton links each library
    with LinkOnlyNeeded, so NVSHMEM's bitcode must come after the shim that references it."""
    return ((_SHIM_LIB, shim_path()), ("libnvshmem_device", device_bitcode(arch)))


def triton_arg_types(name: str) -> tuple:
    """The Triton argument types of ``odcfn_<name>`` (derived from ``DEVICE_FUNCTIONS``)."""
    return tuple(_C_TYPES[_ctype(a)][2] for a in DEVICE_FUNCTIONS[name][1])


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


def _path() -> str:
    # extern_elementwise wants a path at trace time; the options' extern_libs decide what is
    # linked, so an empty string is enough here (see ``extern_libs``).
    return ""


def _call(name: str, args: list, _semantic):
    return core.extern_elementwise(
        _SHIM_LIB,
        _path(),
        args,
        {triton_arg_types(name): (f"odcfn_{name}", core.int32)},  # the shim's i32 0
        is_pure=False,
        _semantic=_semantic,
    )


@core.extern
def getmem_block(dest, source, nbytes, pe, _semantic=None):
    return _call("nvshmemx_getmem_block", [dest, source, nbytes, pe], _semantic)


@core.extern
def putmem_signal_nbi_block(dest, source, nbytes, sig_addr, signal, sig_op, pe, _semantic=None):
    args = [dest, source, nbytes, sig_addr, signal, sig_op, pe]
    return _call("nvshmemx_putmem_signal_nbi_block", args, _semantic)


@core.extern
def signal_op(sig_addr, signal, sig_op, pe, _semantic=None):
    return _call("nvshmemx_signal_op", [sig_addr, signal, sig_op, pe], _semantic)


@core.extern
def quiet(_semantic=None):
    return _call("nvshmem_quiet", [], _semantic)


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
