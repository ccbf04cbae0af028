"""Compile every GPU kernel ahead of time for a CUDA target (default Hopper, sm_90) on any
machine, GPU or not, and summarise its PTX: what CI checks.

``python -m odcfn.transport.gpu._compile [ARCH [NAME,NAME...]]`` prints one JSON line per
kernel. Run it where ``TRITON_INTERPRET`` is unset (interpreted kernels cannot be compiled).
``python -m odcfn.transport.gpu._compile --warmup [ARCH [NAME,...]]`` instead runs triton's JIT
front end for the launches the launchers make (``warmup_launches``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

__all__ = ["PtxStats", "compile_all", "compile_kernel", "kernel_names", "ptx_stats", "warmup_launches"]


@dataclass(frozen=True)
class PtxStats:
    name: str
    cubin_bytes: int
    v4_loads: int  # 128-bit global loads
    v4_stores: int
    # 128-bit atomic adds: triton 3.9 writes red.global...v4, triton 3.6 atom.global...v4 with
    # the results unused; ptxas makes both the same REDG...F32x4 (see sass_red_v4)
    v4_reds: int
    sys_reds: int  # atomics at system scope (atomic w.r.t. other GPUs writing the same owner)
    local_ops: int  # ld/st.local: register spills or stack arrays
    sass_local: int  # STL/LDL in the cubin's SASS: real register spills (-1: no cuobjdump)
    sass_v128: int  # LDG/STG .128 in the SASS: 128-bit accesses survived ptxas
    sass_red_v4: int  # REDG...F32x4 in the SASS: the vector atomic add survived ptxas
    calls: tuple[str, ...]  # NVSHMEM (or other) functions still called after linking
    externs_unresolved: tuple[str, ...]  # .extern .func declarations left in the PTX

    def as_dict(self) -> dict:
        return asdict(self)


def _sass(cubin: bytes) -> str | None:
    """SASS of a cubin through the cuobjdump triton ships (None if it is not there)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def ptx_stats(name: str, ptx: str, cubin: bytes) -> PtxStats:
    sass = _sass(cubin)
    calls = sorted(
        set(re.findall(r"^\s*(?:@%p\d+\s+)?call(?:\.uni)?\s*(?:\([^)]*\),\s*)?([A-Za-z_][\w$]*)", ptx, re.M))
    )
    return PtxStats(
        name=name,
        cubin_bytes=len(cubin),
        v4_loads=len(re.findall(r"\bld\.global[\w.]*\.v4\.", ptx)),
        v4_stores=len(re.findall(r"\bst\.global[\w.]*\.v4\.", ptx)),
        v4_reds=len(re.findall(r"\b(?:red|atom)\.global[\w.]*\.v4\.", ptx)),
        sys_reds=len(re.findall(r"\b(?:red|atom)\.global\.sys\.", ptx)),
        local_ops=len(re.findall(r"\b(?:ld|st)\.local\b", ptx)),
        sass_local=-1 if sass is None else len(re.findall(r"\b(?:STL|LDL)\b", sass)),
        sass_v128=-1 if sass is None else len(re.findall(r"\b(?:LDG|STG)\.E[\w.]*\.128\b", sass)),
        sass_red_v4=-1 if sass is None else len(re.findall(r"\bREDG\.E\.ADD\.F32x4", sass)),
        calls=tuple(calls),
        externs_unresolved=tuple(sorted(set(re.findall(r"\.extern\s+\.func\s*(?:\([^)]*\)\s*)?(\w+)", ptx)))),
    )


def _div16(fn, names) -> dict:
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def compile_kernel(
    fn,
    signature: dict,
    constexprs: dict,
    divisible: tuple[str, ...],
    *,
    arch: int = 90,
    num_warps: int = 4,
    extern_libs: dict | None = None,
):
    """``triton.compile`` for ``cuda:arch`` without a GPU; returns the CompiledKernel (``.asm``
    holds ``ptx`` and ``cubin``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(fn, "arg_names") or type(fn).__name__ == "InterpretedFunction":
        raise RuntimeError(
            "compile_kernel needs a JIT kernel: unset TRITON_INTERPRET before importing triton"
        )
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=_div16(fn, divisible))
    opts: dict = {"num_warps": num_warps}
    if extern_libs:
        opts["extern_libs"] = extern_libs
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def _table(arch: int) -> list[tuple[str, object, dict, dict, tuple, dict | None]]:
    from odcfn.kernels import triton_ops as T
    from odcfn.transport.gpu import _nvshmem_device as nv

    d16 = ("out_ptr", "shard_size")
    rows: list = []
    for dt in ("bf16", "fp32"):
        rows.append(
            (
                f"gather[{dt}]",
                T.gather_kernel,
                {"table_ptr": "*i64", "out_ptr": f"*{dt}", "shard_size": "i32", "BLOCK": "constexpr"},
                {"BLOCK": T.BLOCK},
                d16,
                None,
            )
        )
        rows.append(
            (
                f"accumulate[{dt}]",
                T.accumulate_kernel,
                {"acc_ptr": "*fp32", "x_ptr": f"*{dt}", "n": "i32", "BLOCK": "constexpr"},
                {"BLOCK": T.BLOCK},
                ("acc_ptr", "x_ptr", "n"),
                None,
            )
        )
        rows.append(
            (
                f"scatter_add[{dt}]",
                T.scatter_add_kernel,
                {"table_ptr": "*i64", "grad_ptr": f"*{dt}", "shard_size": "i32", "BLOCK": "constexpr"},
                {"BLOCK": T.BLOCK},
                ("grad_ptr", "shard_size"),
                None,
            )
        )
    for src, dst in (("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
        rows.append(
            (
                f"cast_copy[{src}->{dst}]",
                T.cast_copy_kernel,
                {"dst_ptr": f"*{dst}", "src_ptr": f"*{src}", "n": "i32", "BLOCK": "constexpr",
                 "FP8": "constexpr"},
                {"BLOCK": T.BLOCK, "FP8": False},
                ("dst_ptr", "src_ptr", "n"),
                None,
            )
        )
    rows.append(("cast_copy[fp32->fp8e4m3]", T.cast_copy_kernel,
                 {"dst_ptr": "*u8", "src_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr", "FP8": "constexpr"},
                 {"BLOCK": T.BLOCK, "FP8": True}, ("dst_ptr", "src_ptr", "n"), None))
    rows += _quant_rows()
    rows += _fused_head_rows()
    try:
        libs = dict(nv.extern_libs(arch))  # ordered: the shim first
    except RuntimeError as e:  # no nvidia-nvshmem wheel: say so, compile the rest
        print(f"skipping NVSHMEM kernels: {e}", file=sys.stderr)
        return rows
    for name, (fn, sig, cx, div) in nv.KERNELS.items():
        rows.append((name, fn, sig, cx, div, libs))
    return rows


def _quant_rows() -> list:
    """The block quantizer's kernels (odcfn.kernels.quant_triton), both formats, blocks of 128."""
    from odcfn.kernels import quant_triton as Q

    rows = []
    for fmt, top in (("fp8e4m3", 448.0), ("int8", 127.0)):
        int8 = fmt == "int8"
        for dt in ("bf16", "fp32"):
            rows.append((f"quantize[{dt}->{fmt}]", Q.quantize_kernel,
                         {"x_ptr": f"*{dt}", "pay_ptr": "*u8", "scale_ptr": "*fp32", "n": "i32",
                          "TOP": "constexpr", "INT8": "constexpr", "BLOCK": "constexpr"},
                         {"TOP": top, "INT8": int8, "BLOCK": 128}, ("x_ptr", "n"), None))
            rows.append((f"dequantize[{fmt}->{dt}]", Q.dequantize_kernel,
                         {"pay_ptr": "*u8", "scale_ptr": "*fp32", "out_ptr": f"*{dt}", "n": "i32",
                          "INT8": "constexpr", "BLOCK": "constexpr"},
                         {"INT8": int8, "BLOCK": 128}, ("out_ptr", "n"), None))
    return rows


def _fused_head_rows() -> list:
    """The fused head's forward/backward kernels with the tiles and flags the launchers pass."""
    from odcfn.kernels import fused_head_triton as F

    def blocks(kind: str, half: bool) -> dict:
        b = F.GPU_BLOCKS[kind, half]
        return {"BLOCK_T": b["block_t"], "BLOCK_V": b["block_v"], "BLOCK_D": b["block_d"]}

    rows = []
    for dt, prec in (("bf16", None), ("fp32", "ieee")):
        half = dt == "bf16"
        ints = {"T": "i32", "V": "i32", "D": "i32"}
        fwd = {n: f"*{dt}" for n in ("h_ptr", "w_ptr")} | {"y_ptr": "*i64"}
        fwd |= {n: "*fp32" for n in ("m_ptr", "s_ptr", "u_ptr", "tgt_ptr")}
        fwd |= ints | {"v_per_split": "i32", "inv_tau": "fp32"}
        consts = ("BLOCK_T", "BLOCK_V", "BLOCK_D", "PRECISION", "UPCAST")
        fwd |= {k: "constexpr" for k in (*consts, "WANT_ENTROPY")}
        bwd = {n: f"*{dt}" for n in ("h_ptr", "w_ptr")} | {"y_ptr": "*i64"}
        bwd |= {n: "*fp32" for n in ("lse_ptr", "ent_ptr", "gl_ptr", "gh_ptr", "dw_ptr")}
        bwd |= ints | {"inv_tau": "fp32"}
        bwd |= {k: "constexpr" for k in (*consts, "WITH_ENTROPY")}
        flags = {"PRECISION": prec, "UPCAST": False}
        div = ("h_ptr", "w_ptr", "D")
        for kind, fn, sig, flag in (("fwd", F._head_fwd_kernel, fwd, "WANT_ENTROPY"),
                                    ("bwd", F._head_bwd_dw_kernel, bwd, "WITH_ENTROPY")):
            cx = {**blocks(kind, half), **flags, flag: True}
            rows.append((f"fused_head_{kind}[{dt}]", fn, sig, cx, div, None, F.GPU_BLOCKS[kind, half]))
        # the backward's second kernel (dh): same tiles, its own partial buffer and slice width
        types = bwd | {"dh_ptr": "*fp32", "v_per_split": "i32"}
        dh = {n: types[n] for n in F._head_bwd_dh_kernel.arg_names}
        cx = {**blocks("bwd", half), **flags, "WITH_ENTROPY": True}
        gb = F.GPU_BLOCKS["bwd", half]
        rows.append((f"fused_head_bwd_dh[{dt}]", F._head_bwd_dh_kernel, dh, cx, div, None, gb))
    return rows


def kernel_names(arch: int = 90) -> list[str]:
    return [row[0] for row in _table(arch)]


def compile_all(arch: int = 90, names: list[str] | None = None) -> list[PtxStats]:
    """Compile the kernels called ``names`` (all by default) and summarise their PTX."""
    out = []
    for name, fn, sig, cx, div, libs, *launch in _table(arch):
        if names is not None and name not in names:
            continue
        warps = launch[0]["num_warps"] if launch else 4  # the fused head's rows carry their launch
        k = compile_kernel(fn, sig, cx, div, arch=arch, num_warps=warps, extern_libs=libs)
        out.append(ptx_stats(name, k.asm["ptx"], k.asm["cubin"]))
    return out


def _offline_driver(arch: int):
    """A triton driver that reports ``cuda:arch`` and launches nothing: enough for the JIT front
    end (binding, specialisation, ``warmup`` compiles) on a machine without a GPU."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class OfflineCuda(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device=None) -> int:
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("offline driver: nothing runs")

    return OfflineCuda()


def warmup_launches(arch: int = 90, names: list[str] | None = None) -> list[dict]:
    """Triton's JIT front end for the launches odcfn's launchers make, as they make them:
    ``kernel.warmup`` with the launchers' argument kinds (CPU tensors stand in for device ones:
    the binder reads only dtype and address), sizes that specialise differently (1, multiples of
    16, others), and for the NVSHMEM kernels ``extern_libs`` as a launch option, the way
    ``odcfn.transport.gpu.nvshmem._launch`` passes it. Replaces triton's active driver: call it in a
    process of its own."""
    import torch
    from triton.runtime.driver import driver

    from odcfn.kernels import triton_ops as T
    from odcfn.transport.gpu import _nvshmem_device as nv

    driver.set_active(_offline_driver(arch))
    t64, bf16 = torch.zeros(2, dtype=torch.int64), torch.bfloat16
    opts = {"BLOCK": T.BLOCK, "num_warps": T.NUM_WARPS}  # what triton_ops._launch passes
    cases: list[tuple[str, object, tuple, dict]] = []
    for n in (1, 1001, 4096):
        cases += [
            (f"gather[fp32,n={n}]", T.gather_kernel, (t64, torch.empty(2 * n), n), opts),
            (f"gather[bf16,n={n}]", T.gather_kernel, (t64, torch.empty(2 * n, dtype=bf16), n), opts),
            (
                f"accumulate[bf16,n={n}]",
                T.accumulate_kernel,
                (torch.empty(n), torch.empty(n, dtype=bf16), n),
                opts,
            ),
            (
                f"scatter_add[bf16,n={n}]",
                T.scatter_add_kernel,
                (t64, torch.empty(2 * n, dtype=bf16), n),
                opts,
            ),
            (
                f"cast_copy[fp32->bf16,n={n}]",
                T.cast_copy_kernel,
                (torch.empty(n, dtype=bf16), torch.empty(n), n),
                opts,
            ),
        ]
    try:
        libs = {"extern_libs": nv.extern_libs(arch)}
    except RuntimeError as e:
        print(f"skipping NVSHMEM kernels: {e}", file=sys.stderr)
        libs = None
    if libs is not None:
        u8, i32, i64 = (torch.zeros(3 << 16, dtype=d) for d in (torch.uint8, torch.int32, torch.int64))
        big = 1 << 40  # symmetric addresses and large sizes arrive as i64, small ints as i32
        cases += [
            (
                "nvshmem_gather",
                nv.nvshmem_gather_kernel,
                (u8, big, i32, i32, 1 << 16),
                {**libs, "CHUNK_BYTES": 1 << 16},
            ),
            (
                "nvshmem_put_signal",
                nv.nvshmem_put_signal_kernel,
                (u8, 0, 4096, big, big + 24, i64, i32, 0),
                libs,
            ),
            ("nvshmem_signal[i32]", nv.nvshmem_signal_kernel, (big, 5, 0), libs),
            ("nvshmem_signal[i64]", nv.nvshmem_signal_kernel, (big, big, 1), libs),
        ]
    out = []
    for name, fn, args, kw in cases:
        if names is not None and name.split("[")[0] not in names:
            continue
        k = fn.warmup(*args, grid=(1,), **kw)
        out.append(
            {"name": name, "cubin_bytes": len(k.asm["cubin"]), "loadable": hasattr(k, "_init_handles")}
        )
    return out


if __name__ == "__main__":  # pragma: no cover - exercised through a subprocess in the tests
    argv = sys.argv[1:]
    warm = bool(argv) and argv[0] == "--warmup"
    argv = argv[1:] if warm else argv
    arch = int(argv[0]) if argv else 90
    wanted = argv[1].split(",") if len(argv) > 1 else None
    for row in warmup_launches(arch, wanted) if warm else (s.as_dict() for s in compile_all(arch, wanted)):
        print(json.dumps(row), flush=True)
