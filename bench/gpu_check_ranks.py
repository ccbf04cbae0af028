"""The rank side of ``bench/gpu_check.py``: what each spawned process runs, and the parent's
handle on a group of them.

A rank reports in *phases* (``grads``, then ``bandwidth``): it puts one message per phase on
the queue as soon as that phase is done, so a later phase that hangs or crashes cannot hide an
earlier one's results. Messages are ``(rank, phase, traceback or None, payload)``, payloads
plain data.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

__all__ = ["PhaseError", "Ranks", "ipc_rank_main", "nvshmem_rank_main"]

# a small Qwen and a ragged batch: every rank's gradients against the single-process reference
_CFG = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
_LENGTHS = [9, 17, 5, 12, 7, 20, 3]
PARITY_TOL = 1e-4  # max |g - ref| / max |ref| per unit, fp32


class PhaseError(RuntimeError):
    """A phase of a rank group did not complete: a rank failed, or not every rank answered."""


class Ranks:
    """``world`` spawned processes running ``target(rank, world, port, *args, queue)``."""

    def __init__(self, target, world: int, *args: Any) -> None:
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.world = world
        self.got: dict[str, dict[int, Any]] = {}
        args_of = [(r, world, port, *args, self.q) for r in range(world)]
        self.procs = [ctx.Process(target=target, args=a, daemon=True) for a in args_of]
        for p in self.procs:
            p.start()

    def collect(self, phase: str, timeout: float) -> dict[int, Any]:
        """Every rank's payload for ``phase``; PhaseError naming the first failed rank or the
        ranks that did not answer within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while len(self.got.get(phase, {})) < self.world:
            left = deadline - time.monotonic()
            try:
                # past the deadline, still read what is already queued: groups may run
                # concurrently while the parent reads one at a time (gpu_check_paths.py)
                msg = self.q.get(timeout=min(left, 1.0)) if left > 0 else self.q.get_nowait()
            except Exception:  # noqa: BLE001 - queue.Empty: poll again until the deadline
                if deadline - time.monotonic() > 0:
                    continue
                missing = sorted(set(range(self.world)) - set(self.got.get(phase, {})))
                dead = [r for r in missing if not self.procs[r].is_alive()]
                raise PhaseError(
                    f"phase {phase!r}: ranks {missing} gave no answer within {timeout:.0f} s"
                    + (
                        f" (ranks {dead} exited, codes {[self.procs[r].exitcode for r in dead]})"
                        if dead
                        else ""
                    )
                ) from None
            rank, ph, err, payload = msg
            if err is not None:
                raise PhaseError(f"phase {ph!r}: rank {rank} failed:\n{err[-3000:]}")
            self.got.setdefault(ph, {})[rank] = payload
        return self.got[phase]

    def close(self, grace: float = 10.0) -> None:
        """Join the ranks, killing those still running after ``grace`` seconds (for the whole
        group: a hung W=4 costs 10 s, not 40)."""
        deadline = time.monotonic() + grace
        for p in self.procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _grads(params, batch, *, model, transport, comm):
    """One gradient step through ``transport`` (the only call of odcfn's step API in this file).
    Plain SGD: the checks read gradients, not updates; round-robin balance, a 24-token cap."""
    import odcfn

    config = odcfn.StepConfig(comm=comm, balance="round_robin", max_tokens_per_microbatch=24)
    state = odcfn.TrainState.create(
        params=params, model=model, optimizer=odcfn.sgd(0.0), transport=transport, config=config
    )
    return odcfn.grad_step(state, batch)


def _rel_err(g: dict, ref: dict) -> float:
    return max(float((g[k].float().cpu() - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12)) for k in ref)


def _init(rank: int, world: int, port: int, backend: str):
    store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world)
    return store


def _device(rank: int, dev_kind: str) -> torch.device:
    if dev_kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())  # several ranks may share one GPU
    torch.cuda.set_device(device)
    return device


# --- CUDA-IPC -------------------------------------------------------------------------------
def ipc_rank_main(rank: int, world: int, port: int, dev_kind: str, backend: str, q) -> None:
    phase = "grads"
    try:
        torch.set_num_threads(1)
        import odcfn
        from odcfn.models import QwenConfig, init_params, qwen_model
        from odcfn.transport.collective import TorchCollectives
        from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport

        device = _device(rank, dev_kind)
        store = _init(rank, world, port, backend)
        cfg = QwenConfig(**_CFG)
        model, full = qwen_model(cfg), init_params(cfg, seed=3)
        batch = odcfn.random_batch(_LENGTHS, cfg.vocab_size, seed=4)
        _, g_ref = odcfn.reference_value_and_grad(model, full, batch)
        mesh = odcfn.Mesh(world, rank)
        coll = TorchCollectives(mesh, device if backend == "nccl" else "cpu")
        ref = odcfn.shard(g_ref, model, mesh)
        rows: dict[str, dict] = {}
        for mode in ("remote_add", "landing"):
            tr = cuda_ipc_transport(
                mesh,
                store,
                coll,
                device=device,
                mode=mode,
                slot_elems=1024,
                timeout=60,
                prefix=f"chk-{mode}",
                host_grads=True,  # the runtime computes on CPU today
            )
            got = {}
            for comm in ("odc", "collective"):
                t0 = time.perf_counter()
                g, m = _grads(full, batch, model=model, transport=tr, comm=comm)
                ms = (time.perf_counter() - t0) * 1e3
                got[comm] = g
                rows[f"{mode}/{comm}"] = {
                    "err_vs_reference": _rel_err(g, ref),
                    "syncs": m.counters.syncs,
                    "ms": ms,
                }
            rows[f"{mode}/odc_vs_collective"] = {"err": _rel_err(got["odc"], got["collective"])}
            tr.close()
        q.put((rank, "grads", None, rows))
        phase = "bandwidth"
        bw = _transport_bandwidth(mesh, store, coll, device)
        torch.distributed.destroy_process_group()
        q.put((rank, "bandwidth", None, bw))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, phase, traceback.format_exc(), None))


def _transport_bandwidth(mesh, store, coll, device) -> dict:
    """One step of a bf16 model over device buffers, every unit gathered once and scattered
    once, per scatter mode: seconds and peer bytes per rank (the parent turns them into GB/s)."""
    from odcfn.models import QwenConfig, qwen_model
    from odcfn.sharding import make_layout
    from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport

    big = device.type == "cuda"
    cfg = QwenConfig(
        vocab_size=32000 if big else 64,
        d_model=1024 if big else 32,
        n_layers=2,
        n_heads=8 if big else 4,
        n_kv_heads=8 if big else 2,
        d_ff=4096 if big else 48,
    )
    layout = make_layout(qwen_model(cfg), mesh)
    shards = {u.name: torch.randn(u.shard_size) for u in layout.units}
    bufs = {u.name: torch.empty(u.padded_numel, dtype=torch.bfloat16, device=device) for u in layout.units}
    grads = {u.name: torch.randn(u.padded_numel, device=device).bfloat16() for u in layout.units}
    peer_bytes = sum(u.shard_size * 2 * (mesh.shard_count - 1) for u in layout.units)
    sync = torch.cuda.synchronize if big else (lambda: None)
    out: dict[str, Any] = {"peer_bytes": peer_bytes}
    for mode in ("remote_add", "landing"):
        tr = cuda_ipc_transport(mesh, store, coll, device=device, mode=mode, timeout=120, prefix=f"bw-{mode}")
        for _rep in range(2):  # the first round pays for compilation and mapping
            tr.begin_step(layout, shards, torch.bfloat16)
            tr.sync(torch.zeros(2, dtype=torch.float64))  # everyone published: time transfers only
            sync()
            t0 = time.perf_counter()
            for u in layout.units:
                tr.gather(u.name, bufs[u.name])
            sync()
            t1 = time.perf_counter()
            for u in layout.units:
                tr.scatter_accumulate(u.name, grads[u.name])
            tr.flush()
            t2 = time.perf_counter()
            tr.sync(torch.zeros(2, dtype=torch.float64))
        out[mode] = {"gather_s": t1 - t0, "scatter_s": t2 - t1}
        tr.close()
    return out


# --- NVSHMEM --------------------------------------------------------------------------------
def nvshmem_rank_main(rank: int, world: int, port: int, q) -> None:
    """World 1: every NVSHMEM device kernel against this PE itself (get, put+signal, signal).
    World >= 2: the NVSHMEM transport end to end, grads vs the reference; with fewer GPUs than
    PEs, several PEs share one GPU (NVSHMEM's multiple-PEs-per-GPU mode, see docs/gpu.md)."""
    phase = "grads" if world > 1 else "kernels"
    try:
        torch.set_num_threads(1)
        # one node: bootstrap over loopback, no network transport to probe for
        os.environ.setdefault("NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME", "lo")
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
        import odcfn
        from odcfn.transport.collective import TorchCollectives

        ndev = torch.cuda.device_count()
        device = _device(rank, "cuda")
        backend = "nccl" if ndev >= world else "gloo"  # nccl refuses two ranks on one GPU
        store = _init(rank, world, port, backend)
        mesh = odcfn.Mesh(world, rank)
        out = (
            _nvshmem_kernels(mesh, device)
            if world == 1
            else _nvshmem_grads(mesh, store, TorchCollectives(mesh, device if backend == "nccl" else "cpu"))
        )
        torch.distributed.destroy_process_group()
        q.put((rank, phase, None, out))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, phase, traceback.format_exc(), None))


def _nvshmem_kernels(mesh, device) -> dict:
    from odcfn.transport.gpu import _nvshmem_device as K
    from odcfn.transport.gpu.nvshmem import NvshmemFabric, _launch

    out: dict[str, bool] = {}
    fab = NvshmemFabric(mesh, device)
    fab.setup(1 << 20, 16, "smoke")
    fab.arena[: 1 << 16].copy_(torch.arange(1 << 16, device=device).to(torch.uint8))
    torch.cuda.synchronize()
    dst = torch.zeros(3 << 16, dtype=torch.uint8, device=device)
    pes = torch.zeros(3, dtype=torch.int32, device=device)
    pos = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    _launch(
        K.nvshmem_gather_kernel, (3, 1), dst, fab.arena.data_ptr(), pes, pos, 1 << 16, CHUNK_BYTES=1 << 16
    )
    torch.cuda.synchronize()
    out["get"] = bool((dst.view(3, -1) == fab.arena[: 1 << 16]).all())
    src = torch.full((4096,), 7, dtype=torch.uint8, device=device)
    vals = torch.tensor([12345], dtype=torch.int64, device=device)
    _launch(
        K.nvshmem_put_signal_kernel,
        (1,),
        src,
        0,
        4096,
        fab.arena.data_ptr() + (1 << 17),
        fab.sig.data_ptr() + 8 * 3,
        vals,
        torch.zeros(1, dtype=torch.int32, device=device),
        0,
    )
    torch.cuda.synchronize()
    out["put_signal"] = (
        bool((fab.arena[1 << 17 : (1 << 17) + 4096] == 7).all()) and fab.signal_read(3) == 12345
    )
    fab.signal_write(0, 5, 777)
    out["signal"] = fab.signal_read(5) == 777
    fab.close()
    return out


def _nvshmem_grads(mesh, store, coll) -> dict:
    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.transport.gpu.nvshmem import nvshmem_transport

    cfg = QwenConfig(**_CFG)
    model, full = qwen_model(cfg), init_params(cfg, seed=3)
    batch = odcfn.random_batch(_LENGTHS, cfg.vocab_size, seed=4)
    _, g_ref = odcfn.reference_value_and_grad(model, full, batch)
    ref = odcfn.shard(g_ref, model, mesh)
    tr = nvshmem_transport(mesh, store, coll, slot_elems=1024, host_grads=True)
    rows = {}
    for comm in ("odc", "collective"):
        g, m = _grads(full, batch, model=model, transport=tr, comm=comm)
        rows[comm] = {"err_vs_reference": _rel_err(g, ref), "syncs": m.counters.syncs}
    tr.close()
    return rows
