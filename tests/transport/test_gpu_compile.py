"""Every GPU kernel compiles for Hopper (sm_90) on this CPU-only machine, and its PTX is what we
want: 128-bit global accesses in the copy/accumulate kernels, vector atomic reductions in the
remote-add kernel, no local-memory traffic, and NVSHMEM kernels fully linked against the
device bitcode.

Compilation runs in subprocesses (TRITON_INTERPRET unset there, whatever this process uses),
two at a time: linking NVSHMEM's device bitcode (53 MB in 3.8.0, 31 MB in 3.4.5) costs ~5-25 s
per kernel on these cores. The same tests pass on triton 3.9.0 and 3.6.0 (docs/gpu.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton  # noqa: F401  (the gpu extra: these compile with it)


def _compile(names: list[str] | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, "-m", "odcfn.transport.gpu._compile", "90"]
    if names:
        cmd.append(",".join(names))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def stats() -> dict[str, dict]:
    import nvidia.nvshmem  # noqa: F401  (NVSHMEM bitcode: the gpu extra)

    # the two NVSHMEM kernels dominate: one process each, the small kernels ride along
    first = [_compile(["nvshmem_gather", "nvshmem_signal"]),
             _compile([*_others(), *_QUANT, "nvshmem_put_signal"])]
    out: dict[str, dict] = {}
    for p in first:
        so, se = p.communicate(timeout=600)
        assert p.returncode == 0, se[-3000:]
        for line in so.splitlines():
            d = json.loads(line)
            out[d["name"]] = d
    return out


def _others() -> list[str]:
    names = ["gather", "accumulate", "scatter_add"]
    rows = [f"{n}[{dt}]" for n in names for dt in ("bf16", "fp32")]
    rows += [f"cast_copy[{a}->{b}]" for a, b in (("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "fp32"))]
    return rows


# the block quantizer (odcfn.kernels.quant_triton) and the fp8 cast-copy: they compile for sm_90,
# with no local-memory traffic (their results are checked under the interpreter:
# tests/kernels/test_quant_triton.py); not yet run on hardware
_FMTS = [(f, d) for f in ("fp8e4m3", "int8") for d in ("bf16", "fp32")]
_QUANT = ["cast_copy[fp32->fp8e4m3]", *(f"quantize[{d}->{f}]" for f, d in _FMTS),
          *(f"dequantize[{f}->{d}]" for f, d in _FMTS)]


def test_every_kernel_compiled(stats):
    assert set(stats) == {*_others(), *_QUANT, "nvshmem_gather", "nvshmem_put_signal", "nvshmem_signal"}
    for name in _QUANT:
        assert stats[name]["local_ops"] == 0 and stats[name]["calls"] == [], name
    for name, s in stats.items():
        assert s["cubin_bytes"] > 1000, name


@pytest.mark.parametrize("name", _others())
def test_streaming_kernels_use_128bit_accesses_and_never_spill(stats, name):
    s = stats[name]
    assert s["local_ops"] == 0, f"{name}: local-memory traffic in the PTX"
    if s["sass_local"] >= 0:  # the machine code ptxas produced: no spills, 128-bit accesses kept
        assert s["sass_local"] == 0, f"{name}: {s['sass_local']} STL/LDL (register spills) in the SASS"
        assert s["sass_v128"] >= 1 or name == "scatter_add[bf16]", f"{name}: no 128-bit LDG/STG in the SASS"
        if name.startswith("scatter_add"):
            assert s["sass_red_v4"] >= 1, f"{name}: the atomic add is not REDG...F32x4 in the SASS"
    assert s["calls"] == [], f"{name}: unexpected calls {s['calls']}"
    assert s["v4_loads"] >= 1, f"{name}: no 128-bit loads"
    if name.startswith("scatter_add"):
        assert s["v4_reds"] >= 1, f"{name}: the remote add is not a vector atomic reduction"
        assert s["sys_reds"] == s["v4_reds"], f"{name}: atomics must be system scope (peer GPUs write too)"
    else:
        assert s["v4_stores"] >= 1, f"{name}: no 128-bit stores"


@pytest.mark.parametrize("name", ["nvshmem_gather", "nvshmem_put_signal", "nvshmem_signal"])
def test_nvshmem_kernels_link_the_device_library(stats, name):
    s = stats[name]
    # the nvshmemx_* entry points were inlined from the bitcode: only NVSHMEM's internal
    # transfer helpers remain as calls, and nothing is left undefined except the CUDA
    # runtime's printf/assert, which the driver provides
    # the odcfn_* shim (void prototypes, see _gpu_nvshmem_device) is always-inlined away as well
    assert not any(c.startswith(("nvshmemx_", "nvshmem_", "odcfn_")) for c in s["calls"]), s["calls"]
    assert any("nvshmemi_transfer" in c for c in s["calls"]), s["calls"]
    assert set(s["externs_unresolved"]) <= {"vprintf", "__assertfail"}, s["externs_unresolved"]


def test_jit_front_end_takes_the_launchers_arguments():
    """``kernel.warmup`` (argument binding, specialisation, compile) for the launches the
    launchers make, through an offline driver that reports sm_90: the launch-time API, which
    differs from ``triton.compile``'s and is what changes between triton versions, checked
    without a GPU. One NVSHMEM kernel (the smallest) stands for ``extern_libs`` as a launch
    option; the three are linked in the tests above."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    names = "gather,accumulate,scatter_add,cast_copy,nvshmem_signal"
    cmd = [sys.executable, "-m", "odcfn.transport.gpu._compile", "--warmup", "90", names]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {d["name"]: d for d in map(json.loads, p.stdout.splitlines())}
    streaming = {f"{k}[{d},n={n}]" for n in (1, 1001, 4096) for k, d in
                 (("gather", "fp32"), ("gather", "bf16"), ("accumulate", "bf16"), ("scatter_add", "bf16"),
                  ("cast_copy", "fp32->bf16"))}  # fmt: skip
    assert streaming <= set(rows), sorted(streaming - set(rows))
    assert {"nvshmem_signal[i32]", "nvshmem_signal[i64]"} <= set(rows), sorted(rows)
    for name, d in rows.items():
        assert d["cubin_bytes"] > 1000 and d["loadable"], (name, d)


def test_device_bitcode_takes_the_per_arch_file_else_nvshmem_3_4s_single_one(tmp_path, monkeypatch):
    """nvidia-nvshmem 3.8.0 ships libnvshmem_device_sm_XX.bc, 3.4.5 (torch 2.11's pin, on the
    lent H200's image) one libnvshmem_device.bc: both must be found, the per-arch file first."""
    import types

    from odcfn.transport.gpu import _nvshmem_device as nv

    lib = tmp_path / "nvshmem" / "lib"
    lib.mkdir(parents=True)
    fake = types.ModuleType("nvidia.nvshmem")
    fake.__path__ = [str(tmp_path / "nvshmem")]
    monkeypatch.setitem(sys.modules, "nvidia.nvshmem", fake)
    monkeypatch.setitem(sys.modules, "nvidia", types.ModuleType("nvidia"))
    sys.modules["nvidia"].nvshmem = fake
    try:
        nv.device_bitcode.cache_clear()
        with pytest.raises(RuntimeError, match=r"libnvshmem_device_sm_90\.bc', 'libnvshmem_device\.bc'"):
            nv.device_bitcode(90)
        (lib / "libnvshmem_device.bc").write_bytes(b"")
        nv.device_bitcode.cache_clear()
        assert nv.device_bitcode(90) == str(lib / "libnvshmem_device.bc")
        (lib / "libnvshmem_device_sm_90.bc").write_bytes(b"")
        nv.device_bitcode.cache_clear()
        assert nv.device_bitcode(90) == str(lib / "libnvshmem_device_sm_90.bc")
    finally:
        nv.device_bitcode.cache_clear()
