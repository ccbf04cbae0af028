"""The GPU check's first minute: each GPU path on its own, PASS / FAIL / SKIP with a reason.

Paths (``PATHS``, in report order): CUDA IPC between two processes on ONE GPU, CUDA IPC between
two GPUs (each rank seeing only its own GPU, as under torchrun; needs two), NVSHMEM init, an
NVSHMEM put-with-signal against the PE itself, the fused head's Triton kernels against float64.

Every path runs in its own spawned processes (``gpu_check_ranks.Ranks``), all started at once so
that imports and compiles overlap, and reports in *phases*; each phase has its own deadline
(seconds after its group started). A phase that does not answer by its deadline is FAIL
("hung ... killed"), its group is killed, and the later phases of that group are SKIP; a rank
that raises is FAIL with the exception's last line (the traceback goes to the JSON). A path
whose prerequisite is missing (no CUDA, one GPU, no nvshmem4py) is SKIP with that reason. So
one run says which path is broken instead of timing out as a whole; the longer measurements in
``gpu_check.py`` follow and skip the sections whose path failed.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from gpu_check_ranks import _CFG, PhaseError, Ranks, _init

__all__ = ["PATHS", "Path", "blocked", "run_paths"]


@dataclass(frozen=True)
class Path:
    """One rank group: ``target(rank, world, port, *args, q)`` reporting ``phases``, each
    ``(phase, report name, seconds after the group started)``; ``skip(dev)``: a reason not to
    run on ``dev``, or None."""

    target: Callable[..., None]
    world: int
    args: Callable[[torch.device], tuple]
    phases: tuple[tuple[str, str, float], ...]
    skip: Callable[[torch.device], str | None]


def _needs_cuda(dev: torch.device) -> str | None:
    return None if dev.type == "cuda" else "needs CUDA (this run is on cpu)"


def _needs_two_gpus(dev: torch.device) -> str | None:
    if dev.type != "cuda":
        return "needs CUDA (this run is on cpu)"
    n = torch.cuda.device_count()
    return None if n >= 2 else f"needs 2 GPUs, {n} visible"


def _needs_nvshmem(dev: torch.device) -> str | None:
    if dev.type != "cuda":
        return "needs CUDA (this run is on cpu)"
    try:
        import nvshmem.core  # noqa: F401
        import nvshmem.core.interop.torch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or a cuda.core too old for nvshmem4py
        return f"nvshmem4py does not import ({type(e).__name__}: {str(e)[:200]})"
    return None


def _triton_ok(dev: torch.device) -> str | None:
    if dev.type == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        return "needs CUDA, or TRITON_INTERPRET=1 on cpu"
    return None


# --- rank targets (spawned: module-level, plain data out) ------------------------------------
def ipc_probe_main(rank: int, world: int, port: int, dev_kind: str, own_gpu: bool, q) -> None:
    """Publish rank-valued shards, gather every unit, push ones into every owner: the gathered
    values and the accumulated sums must be exact. ``own_gpu``: this rank sees only GPU ``rank``
    (``CUDA_VISIBLE_DEVICES``, set before CUDA starts), so peers' GPUs are outside its index space."""
    try:
        if own_gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        torch.set_num_threads(1)
        import odcfn
        from odcfn.models import QwenConfig, qwen_model
        from odcfn.sharding import make_layout
        from odcfn.transport.collective import TorchCollectives
        from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport

        device = torch.device("cuda", 0) if dev_kind == "cuda" else torch.device("cpu")
        store = _init(rank, world, port, "gloo")  # nccl refuses two ranks on one GPU
        mesh = odcfn.Mesh(world, rank)
        layout = make_layout(qwen_model(QwenConfig(**_CFG)), mesh)
        shards = {u.name: torch.full((u.shard_size,), float(rank + 1)) for u in layout.units}
        tr = cuda_ipc_transport(mesh, store, TorchCollectives(mesh, "cpu"), device=device,
                                mode="remote_add", slot_elems=1024, timeout=30, prefix="probe")
        tr.begin_step(layout, shards, torch.float32)
        tr.sync(torch.zeros(2, dtype=torch.float64))  # every rank published
        bad = []
        for u in layout.units:
            buf = torch.empty(u.padded_numel, device=device)
            tr.gather(u.name, buf).wait()
            want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(u.shard_size)
            if not torch.equal(buf.cpu(), want):
                bad.append(f"gather {u.name}")
            tr.scatter_accumulate(u.name, torch.ones(u.padded_numel, device=device)).wait()
        tr.flush()
        tr.sync(torch.zeros(2, dtype=torch.float64))
        sums = tr.grad_shards()
        bad += [f"scatter {k}" for k, g in sums.items() if not bool((g.float().cpu() == world).all())]
        tr.close()
        torch.distributed.destroy_process_group()
        q.put((rank, "ipc", None, {"device": str(device), "units": len(layout.units), "bad": bad}))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "ipc", traceback.format_exc(), None))


def nvshmem_probe_main(rank: int, world: int, port: int, q) -> None:
    """Phase ``init``: NVSHMEM up, a symmetric arena and signal words. Phase ``put_signal``: one
    put-with-signal kernel against this PE: the data lands and the signal word holds the value."""
    phase = "init"
    try:
        torch.set_num_threads(1)
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")  # one node: loopback
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        import odcfn
        from odcfn.transport.gpu import _nvshmem_device as K
        from odcfn.transport.gpu.nvshmem import NvshmemFabric, _launch

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        _init(rank, world, port, "gloo")
        fab = NvshmemFabric(odcfn.Mesh(world, rank), device)
        fab.setup(1 << 20, 16, "probe")
        q.put((rank, "init", None, {"arena_bytes": fab.arena.numel()}))
        phase = "put_signal"
        src = torch.full((4096,), 7, dtype=torch.uint8, device=device)
        vals = torch.tensor([12345], dtype=torch.int64, device=device)
        _launch(K.nvshmem_put_signal_kernel, (1,), src, 0, 4096, fab.arena.data_ptr() + (1 << 17),
                fab.sig.data_ptr() + 8 * 3, vals, torch.zeros(1, dtype=torch.int32, device=device), 0)
        torch.cuda.synchronize()
        landed = bool((fab.arena[1 << 17: (1 << 17) + 4096] == 7).all())
        signal = fab.signal_read(3)
        fab.close()
        ok = landed and signal == 12345
        bad = [] if ok else [f"data landed: {landed}, signal word {signal} (want 12345)"]
        q.put((rank, "put_signal", None, {"bad": bad}))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, phase, traceback.format_exc(), None))


def head_probe_main(rank: int, world: int, port: int, dev_kind: str, q) -> None:
    """The fused head's Triton forward + backward vs float64 at a small shape, fp32 and bf16."""
    try:
        from gpu_check_head import correctness

        bad, errs = correctness(torch.device(dev_kind))
        q.put((rank, "head", None, {"bad": bad, "errors": errs}))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, "head", traceback.format_exc(), None))


PATHS: dict[str, Path] = {
    "ipc_one_gpu": Path(ipc_probe_main, 2, lambda d: (d.type, False), (("ipc", "path_ipc_one_gpu", 45.0),),
                        _triton_ok),
    "ipc_across_gpus": Path(ipc_probe_main, 2, lambda d: (d.type, True),
                            (("ipc", "path_ipc_across_gpus", 45.0),), _needs_two_gpus),
    "nvshmem": Path(nvshmem_probe_main, 1, lambda d: (),
                    (("init", "path_nvshmem_init", 40.0), ("put_signal", "path_nvshmem_put_signal", 55.0)),
                    _needs_nvshmem),
    "fused_head": Path(head_probe_main, 1, lambda d: (d.type,), (("head", "path_fused_head", 50.0),),
                       _triton_ok),
}


def section_names(paths: dict[str, Path] = PATHS) -> list[str]:
    return [name for p in paths.values() for _, name, _ in p.phases]


def _verdict(payload: Any) -> tuple[str, str, dict]:
    bad = (payload or {}).get("bad") if isinstance(payload, dict) else None
    detail = ", ".join(f"{k}={v}" for k, v in (payload or {}).items() if k not in ("bad", "errors"))
    return ("fail", "wrong result: " + "; ".join(bad[:4]), {}) if bad else ("pass", detail or "ok", {})


def run_paths(rep: Any, dev: torch.device, paths: dict[str, Path] = PATHS) -> None:
    """Every path's phases into ``rep`` (``gpu_check.Report``), status pass / fail / skip."""
    started: dict[str, tuple[Ranks, float]] = {}
    for key, p in paths.items():  # all at once: one path's hang costs no other its minute
        reason = p.skip(dev)
        if reason is not None:
            for _, name, _ in p.phases:
                rep.set(name, "skip", reason)
            continue
        started[key] = (Ranks(p.target, p.world, *p.args(dev)), time.monotonic())
    for key, (group, t0) in started.items():
        failed = None
        for phase, name, deadline in paths[key].phases:
            if failed is not None:
                rep.set(name, "skip", f"not reached: {failed}")
                continue
            try:
                got = group.collect(phase, max(0.0, t0 + deadline - time.monotonic()))
            except PhaseError as e:
                hung = "no answer" in str(e)
                first = str(e).splitlines()[0]
                msg = (f"hung: no answer {deadline:.0f} s after it started, killed ({first})" if hung
                       else f"{first} {str(e).strip().splitlines()[-1]}")
                rep.set(name, "fail", msg, None if hung else str(e)[-3000:],
                        seconds=round(time.monotonic() - t0, 1))
                failed = f"{name} {'hung' if hung else 'failed'}"
                continue
            results = [_verdict(v) for _, v in sorted(got.items())]
            status = "fail" if any(s == "fail" for s, _, _ in results) else "pass"
            detail = next((d for s, d, _ in results if s == status), "")
            rep.set(name, status, detail, seconds=round(time.monotonic() - t0, 1), ranks=got)
            if status == "fail":
                failed = f"{name} failed"
        group.close(grace=1.0)  # ends what still runs (a hung rank is killed here)


def blocked(rep: Any, *names: str) -> str | None:
    """Why a later section must not run: the first of ``names`` (path sections) that failed."""
    for n in names:
        s = rep.sections.get(n)
        if s is not None and s["status"] == "fail":
            return f"{n} failed: {s['detail'][:160]}"
    return None
