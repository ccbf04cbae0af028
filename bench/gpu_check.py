"""GPU check: kernels vs references, the CUDA-IPC transport with W processes on the GPU(s),
gradient parity with the single-process reference and the collective path, kernel bandwidth
against the device's own copy bandwidth, NVSHMEM where two GPUs exist. Prints a table last.

    python bench/gpu_check.py                 # on a GPU machine (bench/gpu_check.sh wraps it)
    TRITON_INTERPRET=1 python bench/gpu_check.py --device cpu   # dry run of this script on CPU

Exit code 0 when every check passed (or there is no GPU: skipped), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROWS: list[tuple[str, str, str]] = []  # (check, result, detail)
TRANSPORT_BW: list[tuple[str, float, float]] = []  # (what, gather GB/s, scatter GB/s), slowest rank


def row(check: str, ok: bool | None, detail: str = "") -> None:
    ROWS.append((check, {True: "PASS", False: "FAIL", None: "skip"}[ok], detail))
    print(f"[{ROWS[-1][1]}] {check} {detail}", flush=True)


# --- 1. kernels vs references --------------------------------------------------------------
def check_kernels(dev: torch.device) -> None:
    from odcfn.kernels import triton_ops as T

    gen = torch.Generator().manual_seed(0)
    sizes = [1, 1000, 1024, 4097, 123457] if dev.type == "cuda" else [1, 1000, 1025]
    for dtype in (torch.float32, torch.bfloat16):
        ok = True
        for n in sizes:
            for w in (1, 3, 8):
                srcs = [torch.randn(n, generator=gen).to(dev, dtype) for _ in range(w)]
                out = torch.empty(w * n, dtype=dtype, device=dev)
                T.gather(T.pointer_table(srcs, dev), out)
                ok &= torch.equal(out, T.gather_ref(srcs, torch.empty_like(out)))
                accs = [torch.randn(n, generator=gen).to(dev) for _ in range(w)]
                refs = [a.clone() for a in accs]
                g = torch.randn(w * n, generator=gen).to(dev, dtype)
                T.scatter_add(T.pointer_table(accs, dev), g)
                T.scatter_add_ref(refs, g)
                ok &= all(torch.equal(a, r) for a, r in zip(accs, refs))
            acc = torch.randn(n, generator=gen).to(dev)
            x = torch.randn(n, generator=gen).to(dev, dtype)
            ref = acc.clone().add_(x.float())
            ok &= torch.equal(T.accumulate(acc, x), ref)
            s32 = torch.randn(n, generator=gen).to(dev) * 100
            d = torch.empty(n, dtype=torch.bfloat16, device=dev)
            ok &= torch.equal(T.cast_copy(d, s32).view(torch.int16), s32.to(torch.bfloat16).view(torch.int16))
        row(f"kernels == references ({str(dtype)[6:]})", bool(ok), f"sizes {sizes}, W in 1,3,8")
    # concurrent atomic adds: many programs into ONE accumulator
    n = 1 << 16 if dev.type == "cuda" else 2048
    acc = torch.zeros(n, device=dev)
    T.scatter_add(T.pointer_table([acc] * 16, dev), torch.ones(16 * n, device=dev))
    row("scatter_add: 16 writers into one owner lose nothing", bool((acc == 16).all()), f"n={n}")


# --- 2. bandwidth ----------------------------------------------------------------------------
def make_state(params, model, transport, **config):
    """A TrainState over ``transport`` (plain SGD: the checks read gradients, not updates)."""
    import odcfn

    return odcfn.TrainState.create(
        params=params, model=model, optimizer=odcfn.sgd(0.0), transport=transport,
        config=odcfn.StepConfig(balance="round_robin", **config),
    )


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


def bandwidth(dev: torch.device) -> list[tuple[str, float, float]]:
    from odcfn.kernels import triton_ops as T

    total = (256 << 20) if dev.type == "cuda" else (1 << 16)  # bytes of fp32 output
    n, w, reps = total // 4, 8, (20 if dev.type == "cuda" else 1)
    src = torch.randn(n, device=dev)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), reps)
    base = 2 * total / copy_s / 1e9
    out = [("torch copy_ (device baseline)", base, 1.0)]
    shards = [torch.randn(n // w, device=dev) for _ in range(w)]
    table = T.pointer_table(shards, dev)
    t = _time(lambda: T.gather(table, dst), reps)
    out.append((f"gather {w} shards fp32 (1 launch)", 2 * total / t / 1e9, 0))
    sb = [s.bfloat16() for s in shards]
    dstb = torch.empty(n, dtype=torch.bfloat16, device=dev)
    table_b = T.pointer_table(sb, dev)  # built once: its H2D copy is not what we time
    t = _time(lambda: T.gather(table_b, dstb), reps)
    out.append((f"gather {w} shards bf16 (1 launch)", 2 * total / 2 / t / 1e9, 0))
    xb = src.bfloat16()
    t = _time(lambda: T.accumulate(dst, xb), reps)
    out.append(("accumulate fp32 += bf16", (8 + 2) * n / t / 1e9, 0))
    t = _time(lambda: T.accumulate(dst, src), reps)
    out.append(("accumulate fp32 += fp32", 12 * n / t / 1e9, 0))
    accs = [torch.zeros(n // w, device=dev) for _ in range(w)]
    at = T.pointer_table(accs, dev)
    t = _time(lambda: T.scatter_add(at, xb), reps)
    out.append((f"scatter_add bf16 -> {w} fp32 owners (atomic)", (2 + 8) * n / t / 1e9, 0))
    t = _time(lambda: T.cast_copy(dstb, src), reps)
    out.append(("cast_copy fp32 -> bf16", 6 * n / t / 1e9, 0))
    return [(name, gbs, gbs / base) for name, gbs, _ in out]


# --- 3. CUDA-IPC transport: W processes -----------------------------------------------------
def _rank_main(rank: int, world: int, port: int, dev_kind: str, backend: str, q) -> None:
    try:
        torch.set_num_threads(1)
        import odcfn
        from odcfn.kernels.cuda_ipc import TorchCollectives, cuda_ipc_transport
        from odcfn.models import QwenConfig, init_params, qwen_model

        if dev_kind == "cuda":
            ndev = torch.cuda.device_count()
            device = torch.device("cuda", rank % ndev)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120)
        )
        torch.distributed.init_process_group(backend, store=store, rank=rank, world_size=world)
        cfg = QwenConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
        model, full = qwen_model(cfg), init_params(cfg, seed=3)
        batch = odcfn.random_batch([9, 17, 5, 12, 7, 20, 3], cfg.vocab_size, seed=4)
        _, g_ref = odcfn.reference_value_and_grad(model, full, batch)
        mesh = odcfn.Mesh(world, rank)
        coll = TorchCollectives(mesh, device if backend == "nccl" else "cpu")
        ref = odcfn.shard(g_ref, model, mesh)
        worst, results = 0.0, {}
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
                host_grads=True,  # the runtime computes on CPU today; its optimizer reads CPU grads
            )
            for comm in ("odc", "collective"):
                p = odcfn.shard(full, model, mesh)
                t0 = time.perf_counter()
                state = make_state(p, model, tr, comm=comm, max_tokens_per_microbatch=24)
                g, m = odcfn.grad_step(state, batch)
                dt = time.perf_counter() - t0
                err = max(
                    float((g[k].float().cpu() - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12))
                    for k in ref
                )
                worst = max(worst, err)
                results[f"{mode}/{comm}"] = (err, m.counters.syncs, dt)
            tr.close()
        results.update(_transport_bandwidth(mesh, store, coll, device))
        torch.distributed.destroy_process_group()
        q.put((rank, None, worst, results))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, traceback.format_exc(), None, None))


def _transport_bandwidth(mesh, store, coll, device) -> dict:
    """The measurement that picks the scatter mode: one step of a bf16 model, device buffers,
    every unit gathered once and scattered once, per mode; GB/s of peer bytes per rank."""
    from odcfn.kernels.cuda_ipc import cuda_ipc_transport
    from odcfn.models import QwenConfig, qwen_model
    from odcfn.sharding import make_layout

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
    out = {}
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
        out[f"bw/{mode}"] = (peer_bytes / (t1 - t0) / 1e9, peer_bytes / (t2 - t1) / 1e9)
        tr.close()
    return out


def _spawn(target, world: int, label: str, *args) -> list | None:
    """Run ``target(rank, world, port, *args, queue)`` in ``world`` spawned processes; each puts
    one tuple on the queue. Returns the tuples, or None (after a failed row) if some never came."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in range(world):
            got.append(q.get(timeout=240))
    except Exception as e:  # noqa: BLE001
        row(label, False, f"no answer from all ranks: {e!r}")
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return got if len(got) == world else None


def check_ipc(dev: torch.device, world: int) -> None:
    ndev = torch.cuda.device_count() if dev.type == "cuda" else 0
    backend = "nccl" if dev.type == "cuda" and ndev >= world else "gloo"
    got = _spawn(_rank_main, world, f"CUDA-IPC W={world}", dev.type, backend)
    if got is None:
        return
    errs = [g for g in got if g[1]]
    where = f"{world} procs on {ndev or 'cpu'} device(s), collectives over {backend}"
    if errs:
        row(f"CUDA-IPC W={world}", False, f"{where}: rank {errs[0][0]} failed:\n{errs[0][1][-2000:]}")
        return
    worst = max(g[2] for g in got)
    res = {k: v for k, v in got[0][3].items() if not k.startswith("bw/")}
    detail = ", ".join(f"{k}: err {v[0]:.1e} syncs {v[1]} {v[2] * 1e3:.0f} ms" for k, v in res.items())
    row(f"CUDA-IPC W={world} grads == reference", worst < 1e-4, f"{where}; rank0 {detail}")
    for mode in ("remote_add", "landing"):
        g_bw, s_bw = min(g[3][f"bw/{mode}"][0] for g in got), min(g[3][f"bw/{mode}"][1] for g in got)
        TRANSPORT_BW.append((f"IPC W={world} {mode}: gather / scatter+flush", g_bw, s_bw))


# --- 4. NVSHMEM ------------------------------------------------------------------------------
def _nvshmem_rank_main(rank: int, world: int, port: int, q) -> None:
    """World 1: every NVSHMEM kernel against this PE itself (get, put+signal, signal). World
    >= 2 (one GPU each): the NVSHMEM transport end to end, grads vs the reference."""
    try:
        torch.set_num_threads(1)
        import odcfn
        from odcfn.kernels import _gpu_nvshmem_device as K
        from odcfn.kernels.cuda_ipc import TorchCollectives
        from odcfn.kernels.nvshmem import NvshmemFabric, _launch, nvshmem_transport

        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        store = torch.distributed.TCPStore(
            "127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120)
        )
        torch.distributed.init_process_group("nccl", store=store, rank=rank, world_size=world)
        mesh = odcfn.Mesh(world, rank)
        out: dict = {}
        if world == 1:
            fab = NvshmemFabric(mesh, device)
            fab.setup(1 << 20, 16, "smoke")
            fab.arena[: 1 << 16].copy_(torch.arange(1 << 16, device=device).to(torch.uint8))
            torch.cuda.synchronize()
            dst = torch.zeros(3 << 16, dtype=torch.uint8, device=device)
            pes = torch.zeros(3, dtype=torch.int32, device=device)
            pos = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
            _launch(
                K.nvshmem_gather_kernel,
                (3, 1),
                dst,
                fab.arena.data_ptr(),
                pes,
                pos,
                1 << 16,
                CHUNK_BYTES=1 << 16,
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
        else:
            from odcfn.models import QwenConfig, init_params, qwen_model

            cfg = QwenConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
            model, full = qwen_model(cfg), init_params(cfg, seed=3)
            batch = odcfn.random_batch([9, 17, 5, 12, 7, 20, 3], cfg.vocab_size, seed=4)
            _, g_ref = odcfn.reference_value_and_grad(model, full, batch)
            ref = odcfn.shard(g_ref, model, mesh)
            tr = nvshmem_transport(
                mesh, store, TorchCollectives(mesh, device), slot_elems=1024, host_grads=True
            )
            for comm in ("odc", "collective"):
                state = make_state(full, model, tr, comm=comm, max_tokens_per_microbatch=24)
                g, m = odcfn.grad_step(state, batch)
                err = max(
                    float((g[k].float().cpu() - ref[k]).abs().max() / (ref[k].abs().max() + 1e-12))
                    for k in ref
                )
                out[comm] = err < 1e-4 and m.counters.syncs == 1
            tr.close()
        torch.distributed.destroy_process_group()
        q.put((rank, None, out))
    except BaseException:  # noqa: BLE001 - reported by the parent
        q.put((rank, traceback.format_exc(), None))


def check_nvshmem(dev: torch.device) -> None:
    if dev.type != "cuda":
        row("NVSHMEM", None, "needs CUDA; not run")
        return
    try:
        import nvshmem.core  # noqa: F401
    except ImportError as e:
        row("NVSHMEM", None, f"nvshmem4py missing ({e}); not run")
        return
    ndev = torch.cuda.device_count()
    for world in sorted({1, min(ndev, 4)}):
        got = _spawn(_nvshmem_rank_main, world, f"NVSHMEM W={world}")
        if got is None:
            continue
        errs = [g for g in got if g[1]]
        if errs:
            row(f"NVSHMEM W={world}", False, f"rank {errs[0][0]} failed:\n{errs[0][1][-2000:]}")
            continue
        what = "device kernels against this PE" if world == 1 else "transport grads == reference"
        res = got[0][2]
        row(f"NVSHMEM W={world} {what}", all(res.values()), str(res))
    if ndev < 2:
        row("NVSHMEM transport across GPUs", None, "needs >= 2 GPUs (one PE per GPU); not run")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--world", type=int, nargs="*", default=[2, 4])
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU visible to torch {torch.__version__}: skipped (exit 0)")
        return 0
    dev = torch.device(args.device)
    if dev.type == "cpu" and not os.environ.get("TRITON_INTERPRET"):
        print(
            "gpu_check --device cpu needs TRITON_INTERPRET=1 (dry run of this script through the interpreter)"
        )
        return 2
    t0 = time.time()
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (triton interpreter dry run)"
    print(f"gpu_check on {name}; torch {torch.__version__}", flush=True)
    for step in (lambda: check_kernels(dev), *[lambda w=w: check_ipc(dev, w) for w in args.world]):
        try:
            step()
        except Exception:  # noqa: BLE001
            row("check crashed", False, traceback.format_exc()[-2000:])
    check_nvshmem(dev)
    bw = []
    try:
        bw = bandwidth(dev)
    except Exception:  # noqa: BLE001
        row("bandwidth", False, traceback.format_exc()[-2000:])
    print(f"\n=== gpu_check summary ({time.time() - t0:.0f} s, {name}) ===")
    for check, res, detail in ROWS:
        print(f"{res:5} {check}: {detail.splitlines()[0] if detail else ''}")
    if bw:
        print(f"\n{'kernel':45} {'GB/s':>9} {'x copy_':>8}")
        for k, gbs, rel in bw:
            print(f"{k:45} {gbs:9.3g} {rel:8.3g}")
    if TRANSPORT_BW:
        print(f"\n{'transport (peer bytes per rank, bf16)':45} {'gather':>9} {'scatter':>8}  GB/s")
        for k, g_bw, s_bw in TRANSPORT_BW:
            print(f"{k:45} {g_bw:9.3g} {s_bw:8.3g}")
    return 1 if any(r == "FAIL" for _, r, _ in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
