"""GPU check. First minute: each GPU path on its own (``gpu_check_paths``: IPC on one GPU, IPC
across GPUs, NVSHMEM init, put-with-signal, fused head), PASS / FAIL / SKIP with a reason, each
under its own timeout. Then the measurements: kernels vs references, the fused head
(``gpu_check_head``), the CUDA-IPC transport with W processes (gradients vs the single-process
reference and the collective path, one sync per step), transport and kernel bandwidth against
the device's own ``copy_``, NVSHMEM last.

    python bench/gpu_check.py --json OUT.json         # on a GPU machine (bench/gpu_check.sh wraps it)
    TRITON_INTERPRET=1 python bench/gpu_check.py --device cpu --json OUT.json   # dry run on CPU

Sections run in order of value, each guarded: a failing or hanging section is recorded (status,
error) and the next one runs; a section whose path failed in the first minute is skipped. The
JSON is rewritten after every section, so a run killed at its time limit still leaves what it
finished. Exit code 0 when nothing failed (or there is no GPU: skipped), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from importlib import metadata

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_check_head import fused_head  # noqa: E402
from gpu_check_paths import _needs_nvshmem, blocked, run_paths  # noqa: E402
from gpu_check_paths import section_names as path_names  # noqa: E402
from gpu_check_ranks import PARITY_TOL, PhaseError, Ranks, ipc_rank_main, nvshmem_rank_main  # noqa: E402

STATUSES = ("pass", "fail", "error", "timeout", "skip")


class Report:
    """Every section's status, error, detail and data; written to ``path`` after each."""

    def __init__(self, path: str | None, names: list[str], budget: float) -> None:
        self.path, self.t0, self.budget = path, time.monotonic(), budget
        self.sections = {n: {"status": "skip", "detail": "not reached", "error": None} for n in names}
        self.meta: dict = {}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def set(self, name: str, status: str, detail: str = "", error: str | None = None, **data) -> None:
        assert status in STATUSES, status
        self.sections[name] = {"status": status, "detail": detail, "error": error, **data}
        print(f"[{status.upper()}] {name}: {detail}" + (f"\n{error}" if error else ""), flush=True)
        self.write()

    def run(self, name: str, fn, need: float = 10.0) -> None:
        """``fn()`` returns (status, detail, data); an exception (here or in a rank) is an
        ``error`` with its traceback, a rank group that stopped answering a ``timeout``."""
        if self.left() < need:
            self.set(name, "skip", f"time budget spent ({self.budget:.0f} s)")
            return
        t = time.monotonic()
        try:
            status, detail, data = fn()
        except PhaseError as e:
            status, detail, data = (
                ("timeout" if "no answer" in str(e) else "error"),  # else: a rank raised
                str(e).splitlines()[0],
                {},
            )
            data["error"] = str(e)
        except Exception:  # noqa: BLE001 - recorded, then the next section runs
            status, detail, data = "error", "crashed", {"error": traceback.format_exc()[-3000:]}
        err = data.pop("error", None)
        self.set(name, status, detail, err, seconds=round(time.monotonic() - t, 2), **data)

    def write(self) -> None:
        if not self.path:
            return
        doc = {
            "meta": {**self.meta, "seconds": round(time.monotonic() - self.t0, 1)},
            "sections": self.sections,
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.replace(tmp, self.path)


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def env(dev: torch.device) -> tuple[str, str, dict]:
    import triton

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": triton.__version__,
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        # an MPS daemon makes NVSHMEM's several-PEs-per-GPU mode full instead of limited
        "mps_pipe_dir": os.path.exists(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")),
        **{
            d: _version(d)
            for d in (
                "optree",
                "nvshmem4py-cu13",
                "nvshmem4py-cu12",
                "nvidia-nvshmem-cu13",
                "nvidia-nvshmem-cu12",
                "cuda-core",
                "cuda-bindings",
                "cuda-pathfinder",
            )
        },
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(0)
        info |= {
            "gpus": torch.cuda.device_count(),
            "gpu": p.name,
            "capability": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
        }
    return "pass", f"torch {info['torch']}, triton {info['triton']}, {info.get('gpu', 'cpu')}", info


# --- kernels vs references --------------------------------------------------------------------
def kernels(dev: torch.device) -> tuple[str, str, dict]:
    from odcfn.kernels import triton_ops as T

    gen = torch.Generator().manual_seed(0)
    sizes = [1, 1000, 1024, 4097, 123457] if dev.type == "cuda" else [1, 1000, 1025]
    bad: list[str] = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            for w in (1, 3, 8):
                srcs = [torch.randn(n, generator=gen).to(dev, dtype) for _ in range(w)]
                out = torch.empty(w * n, dtype=dtype, device=dev)
                T.gather(T.pointer_table(srcs, dev), out)
                if not torch.equal(out, T.gather_ref(srcs, torch.empty_like(out))):
                    bad.append(f"gather {dtype} n={n} W={w}")
                accs = [torch.randn(n, generator=gen).to(dev) for _ in range(w)]
                refs = [a.clone() for a in accs]
                g = torch.randn(w * n, generator=gen).to(dev, dtype)
                T.scatter_add(T.pointer_table(accs, dev), g)
                T.scatter_add_ref(refs, g)
                if not all(torch.equal(a, r) for a, r in zip(accs, refs)):
                    bad.append(f"scatter_add {dtype} n={n} W={w}")
            acc = torch.randn(n, generator=gen).to(dev)
            x = torch.randn(n, generator=gen).to(dev, dtype)
            if not torch.equal(T.accumulate(acc.clone(), x), acc.add_(x.float())):
                bad.append(f"accumulate {dtype} n={n}")
            s32 = torch.randn(n, generator=gen).to(dev) * 100
            d = torch.empty(n, dtype=torch.bfloat16, device=dev)
            if not torch.equal(
                T.cast_copy(d, s32).view(torch.int16), s32.to(torch.bfloat16).view(torch.int16)
            ):
                bad.append(f"cast_copy fp32->bf16 n={n}")
    # concurrent atomic adds: many programs into ONE accumulator
    n = 1 << 16 if dev.type == "cuda" else 2048
    acc = torch.zeros(n, device=dev)
    T.scatter_add(T.pointer_table([acc] * 16, dev), torch.ones(16 * n, device=dev))
    if not bool((acc == 16).all()):
        bad.append(f"scatter_add: 16 writers into one owner lost adds (n={n})")
    detail = (
        f"gather, scatter_add, accumulate, cast_copy bit-equal to torch; sizes {sizes}, W 1,3,8, fp32+bf16"
    )
    return ("fail", "; ".join(bad[:8]), {"failures": bad}) if bad else ("pass", detail, {})


# --- CUDA-IPC: W processes ----------------------------------------------------------------------
def ipc_grads(group: Ranks, timeout: float, where: str) -> tuple[str, str, dict]:
    got = group.collect("grads", timeout)
    worst = max(r["err_vs_reference"] for g in got.values() for k, r in g.items() if "err_vs_reference" in r)
    syncs = sorted({r["syncs"] for g in got.values() for r in g.values() if "syncs" in r})
    cross = max(r["err"] for g in got.values() for k, r in g.items() if k.endswith("odc_vs_collective"))
    ok = worst < PARITY_TOL and cross < PARITY_TOL and syncs == [1]
    detail = (
        f"{where}; both scatter modes x odc/collective: worst rel err vs reference {worst:.1e}, "
        f"odc vs collective {cross:.1e}, syncs per step {syncs}"
    )
    return ("pass" if ok else "fail"), detail, {"worst_err": worst, "syncs": syncs, "ranks": got}


def ipc_bandwidth(group: Ranks, timeout: float) -> tuple[str, str, dict]:
    got = group.collect("bandwidth", timeout)
    rows = {}
    for mode in ("remote_add", "landing"):
        pb = [g["peer_bytes"] for g in got.values()]
        g_s = [g[mode]["gather_s"] for g in got.values()]
        s_s = [g[mode]["scatter_s"] for g in got.values()]
        # GB/s of peer bytes per rank (slowest rank), and summed over ranks counting read +
        # write like copy_: a gather reads and writes each byte; a bf16 -> fp32 scatter-add
        # reads 2 bytes and read-modify-writes 8 per element
        rows[mode] = {
            "gather_peer_gbs_min": min(b / t / 1e9 for b, t in zip(pb, g_s)),
            "scatter_peer_gbs_min": min(b / t / 1e9 for b, t in zip(pb, s_s)),
            "gather_rw_gbs_sum": sum(2 * b / t / 1e9 for b, t in zip(pb, g_s)),
            "scatter_rw_gbs_sum": sum(5 * b / t / 1e9 for b, t in zip(pb, s_s)),
        }
    detail = ", ".join(
        f"{m}: gather {r['gather_peer_gbs_min']:.3g} / scatter+flush {r['scatter_peer_gbs_min']:.3g} GB/s"
        for m, r in rows.items()
    )
    return "pass", f"peer bytes per rank, slowest rank: {detail}", {"modes": rows}


# --- kernel bandwidth ---------------------------------------------------------------------------
def _time(fn, reps: int) -> float:
    if torch.cuda.is_available():
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / reps
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def kernel_bandwidth(dev: torch.device) -> tuple[str, str, dict]:
    """GB/s counting bytes read + written, and as a fraction of this device's own copy_."""
    from odcfn.kernels import triton_ops as T

    total = (256 << 20) if dev.type == "cuda" else (1 << 16)  # bytes of fp32 output
    n, w, reps = total // 4, 8, (20 if dev.type == "cuda" else 1)
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    out = [("torch copy_ (device baseline)", 2 * total / _time(lambda: dst.copy_(src), reps) / 1e9)]
    shards = [torch.randn(n // w, device=dev) for _ in range(w)]
    table = T.pointer_table(shards, dev)
    out.append((f"gather {w} shards fp32", 2 * total / _time(lambda: T.gather(table, dst), reps) / 1e9))
    dstb = torch.empty(n, dtype=torch.bfloat16, device=dev)
    # a pointer table does not keep its tensors alive: every list it is built from stays named
    shards_b = [s.bfloat16() for s in shards]
    table_b = T.pointer_table(shards_b, dev)  # built once: its H2D copy is not timed
    out.append((f"gather {w} shards bf16", total / _time(lambda: T.gather(table_b, dstb), reps) / 1e9))
    xb = src.bfloat16()
    out.append(("accumulate fp32 += bf16", 10 * n / _time(lambda: T.accumulate(dst, xb), reps) / 1e9))
    out.append(("accumulate fp32 += fp32", 12 * n / _time(lambda: T.accumulate(dst, src), reps) / 1e9))
    accs = [torch.zeros(n // w, device=dev) for _ in range(w)]
    at = T.pointer_table(accs, dev)
    out.append(
        (f"scatter_add bf16 -> {w} fp32 owners", 10 * n / _time(lambda: T.scatter_add(at, xb), reps) / 1e9)
    )
    out.append(("cast_copy fp32 -> bf16", 6 * n / _time(lambda: T.cast_copy(dstb, src), reps) / 1e9))
    base = out[0][1]
    rows = {k: {"gbs": gbs, "x_copy": gbs / base} for k, gbs in out}
    worst = min(r["x_copy"] for k, r in rows.items() if not k.startswith("torch"))
    detail = f"copy_ {base:.4g} GB/s; slowest kernel at {worst:.2f}x copy_ (goal >= 0.8)"
    return "pass", detail, {"kernels": rows, "copy_gbs": base, "goal_0.8_met": worst >= 0.8}


# --- NVSHMEM ------------------------------------------------------------------------------------
NVSHMEM_ONE_GPU = (
    "several PEs on ONE GPU: NVSHMEM's multiple-PEs-per-GPU mode; without an MPS daemon it is "
    "'limited MPG' (RMA, signals and barrier_all work; NVSHMEM's own team collectives abort), "
    "which is all this transport uses (its sync is torch.distributed, over gloo here)"
)


def nvshmem(dev: torch.device, world: int, timeout: float) -> tuple[str, str, dict]:
    missing = _needs_nvshmem(dev)
    if missing:
        return "skip", missing, {}
    ndev = torch.cuda.device_count()
    where = (
        "1 PE"
        if world == 1
        else (f"{world} PEs on {ndev} GPU(s)" + (f"; {NVSHMEM_ONE_GPU}" if ndev < world else ""))
    )
    group = Ranks(nvshmem_rank_main, world)
    try:
        got = group.collect("kernels" if world == 1 else "grads", timeout)
    except PhaseError as e:
        raise PhaseError(f"NVSHMEM {where}: {e}") from None
    finally:
        group.close()
    if world == 1:
        res = got[0]
        return (
            ("pass" if all(res.values()) else "fail"),
            f"device kernels against this PE: {res}",
            {"result": res},
        )
    rows = {r: v for r, v in got.items()}
    ok = all(
        v["err_vs_reference"] < PARITY_TOL and v["syncs"] == 1 for g in rows.values() for v in g.values()
    )
    return ("pass" if ok else "fail"), f"{where}: grads vs reference, odc + collective", {"ranks": rows}


# --- driver -------------------------------------------------------------------------------------
def imports() -> str:
    """What this run uses, one line: python, torch, triton, optree and odcfn (ImportError if one
    is missing). Printed first, in this process: a separate interpreter only to check the
    imports would import torch once more."""
    import optree
    import triton

    import odcfn

    return (
        f"python {sys.version.split()[0]} {sys.executable}; "
        f"torch {torch.__version__} (cuda {torch.version.cuda}); triton {triton.__version__}; "
        f"optree {optree.__version__}; odcfn from {os.path.dirname(os.path.abspath(odcfn.__file__))}"
    )


def section_names(worlds: list[int]) -> list[str]:
    ipc = [s for w in worlds for s in (f"ipc_w{w}_grads", f"ipc_w{w}_bandwidth")]
    return [
        "env",
        *path_names(),
        "kernels",
        "fused_head",
        *ipc[:2],
        "kernel_bandwidth",
        *ipc[2:],
        "nvshmem_w1_kernels",
        "nvshmem_w2_transport",
    ]


def _ipc_sections(rep: Report, dev: torch.device, world: int) -> None:
    ndev = torch.cuda.device_count() if dev.type == "cuda" else 0
    backend = "nccl" if dev.type == "cuda" and ndev >= world else "gloo"  # nccl refuses 2 ranks on 1 GPU
    where = f"{world} procs on {ndev or 'cpu'} device(s), collectives over {backend}"
    group: list[Ranks] = []
    answered: list[bool] = []  # every rank reported its gradients: the bandwidth phase follows

    def grads():
        group.append(Ranks(ipc_rank_main, world, dev.type, backend))
        out = ipc_grads(group[0], min(120.0, rep.left()), where)
        answered.append(True)
        return out

    try:
        rep.run(f"ipc_w{world}_grads", grads, need=30)
        if answered:
            rep.run(f"ipc_w{world}_bandwidth", lambda: ipc_bandwidth(group[0], min(90.0, rep.left())))
        else:
            rep.set(f"ipc_w{world}_bandwidth", "skip", "its processes did not finish the gradient phase")
    finally:
        if group:
            group[0].close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4], help="CUDA-IPC process counts, in order")
    ap.add_argument("--json", default=None, help="write the results here (rewritten after each section)")
    ap.add_argument("--budget", type=float, default=360.0, help="seconds; sections past it are skipped")
    args = ap.parse_args()
    try:
        print(imports(), flush=True)
    except Exception:  # noqa: BLE001 - ImportError, or a package that fails while importing
        traceback.print_exc()
        print("gpu_check: FAILED: torch, triton, optree and odcfn must import (see above)", flush=True)
        return 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible to torch {torch.__version__}: skipped (exit 0)")
        return 0
    dev = torch.device(args.device)
    if dev.type == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        print(
            "gpu_check --device cpu needs TRITON_INTERPRET=1 (dry run of this script through the interpreter)"
        )
        return 2
    rep = Report(args.json, section_names(args.world), args.budget)
    rep.meta = {"device": args.device, "world": args.world, "budget_s": args.budget, "argv": sys.argv[1:]}
    rep.run("env", lambda: env(dev))
    run_paths(rep, dev)  # the first minute: every path on its own, each with its own timeout

    def run(name: str, fn, need: float = 10.0, paths: tuple[str, ...] = ()) -> None:
        why = blocked(rep, *paths)  # a path that failed would only hang this section to its timeout
        if why:
            return rep.set(name, "skip", why)
        rep.run(name, fn, need)

    ipc = ("path_ipc_one_gpu", "path_ipc_across_gpus")
    nvs = ("path_nvshmem_init", "path_nvshmem_put_signal")
    run("kernels", lambda: kernels(dev))
    run("fused_head", lambda: fused_head(dev), 60, ("path_fused_head",))
    for i, world in enumerate(args.world):
        why = blocked(rep, *ipc)
        if why:
            for n in (f"ipc_w{world}_grads", f"ipc_w{world}_bandwidth"):
                rep.set(n, "skip", why)
        else:
            _ipc_sections(rep, dev, world)
        if i == 0:
            run("kernel_bandwidth", lambda: kernel_bandwidth(dev))
    if not args.world:
        run("kernel_bandwidth", lambda: kernel_bandwidth(dev))
    run("nvshmem_w1_kernels", lambda: nvshmem(dev, 1, min(120.0, rep.left())), 30, nvs)
    run("nvshmem_w2_transport", lambda: nvshmem(dev, 2, min(150.0, rep.left())), 30, nvs)
    _summary(rep)
    return 1 if any(s["status"] in ("fail", "error", "timeout") for s in rep.sections.values()) else 0


def _summary(rep: Report) -> None:
    print(f"\n=== gpu_check summary ({time.monotonic() - rep.t0:.0f} s) ===")
    for name, s in rep.sections.items():
        print(f"{s['status']:8} {name}: {s['detail'].splitlines()[0] if s['detail'] else ''}")
    kb = rep.sections.get("kernel_bandwidth", {}).get("kernels")
    if kb:
        print(f"\n{'kernel':40} {'GB/s':>9} {'x copy_':>8}")
        for k, r in kb.items():
            print(f"{k:40} {r['gbs']:9.4g} {r['x_copy']:8.3f}")


if __name__ == "__main__":
    sys.exit(main())
