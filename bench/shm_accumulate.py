"""Scatter-accumulate over /dev/shm: which design, measured.

P processes each own an fp32 accumulator of ``--numel`` elements in shared memory. Every process
pushes, ``--rounds`` times, a slice of ones into every owner (itself included), cut into chunks of
``--chunk`` elements. Designs:

- ``plain``:  writer does ``acc[chunk].add_(data)`` with no lock: the baseline that loses updates.
- ``lock``:   writer-side accumulate under a per-(owner, chunk) OFD byte-range lock (kernel lock,
  released if the holder dies) - what ``odcfn.transport.shm`` does.
- ``thread``: the paper's design: writer copies the chunk into one of ``--slots`` bounded landing
  slots it has in the owner's segment and raises a flag; an accumulate thread in the owner polls
  the flags, adds the landed chunk, and acknowledges so the slot can be reused.

``--design transport`` instead times whole-unit ops on the real ``ShmTransport`` (one-sided
gather, locked scatter-accumulate) against its gloo all-gather / reduce-scatter, via odcfn.launch.

Every design is checked: the totals must equal P * rounds exactly (ones sum exactly in fp32).
Run:  python bench/shm_accumulate.py --procs 4 --numel 262144 --chunk 16384 --rounds 10 --repeat 5
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
import uuid

import numpy as np
import torch

from odcfn.transport.shm_sync import RangeLock, Segment, shm_dir


def _layout(p: int, numel: int, chunk: int, slots: int) -> tuple[int, int, int]:
    """Byte offsets in one owner's segment: accumulator, flags (P x slots x 2 int64: seq, ack;
    plus target offset), landing slots (P x slots x chunk fp32)."""
    acc = 0
    flags = acc + numel * 4
    land = flags + p * slots * 3 * 8
    return flags, land, land + p * slots * chunk * 4


def _worker(rank: int, args: argparse.Namespace, paths: list[str], barrier, out) -> None:
    torch.set_num_threads(1)
    p, numel, chunk, slots = args.procs, args.numel, args.chunk, args.slots
    flags_off, land_off, size = _layout(p, numel, chunk, slots)
    segs = [Segment(path, size, create=False) for path in paths]
    accs = [s.view(0, numel, torch.float32) for s in segs]
    flags = [s.view(flags_off, p * slots * 3, torch.int64).numpy().reshape(p, slots, 3) for s in segs]
    lands = [s.view(land_off, p * slots * chunk, torch.float32).view(p, slots, chunk) for s in segs]
    data = torch.ones(chunk)
    stop = threading.Event()

    def accumulate_thread() -> None:  # owner side: drain every client's landing slots
        f, acc, land = flags[rank], accs[rank], lands[rank]
        pause = 1e-5
        while True:
            busy = False
            for c in range(p):
                for k in range(slots):
                    seq, ack, off = f[c, k]
                    if seq > ack:
                        n = min(chunk, numel - off)
                        acc[off : off + n].add_(land[c, k, :n])
                        f[c, k, 1] = seq
                        busy = True
            if busy:
                pause = 1e-5
            elif stop.is_set():
                return
            else:
                time.sleep(pause)
                pause = min(pause * 2, 2e-4)

    th = None
    if args.design == "thread":
        th = threading.Thread(target=accumulate_thread, daemon=True)
        th.start()
    seqs = np.zeros((p, slots), dtype=np.int64)
    times, lost = [], 0
    for _ in range(args.repeat):
        accs[rank].zero_()
        barrier.wait()  # everyone zeroed before anyone pushes
        t0 = time.perf_counter()
        _push(rank, args, segs, accs, flags, lands, seqs, data)
        times.append(time.perf_counter() - t0)
        barrier.wait()  # every push (and every ack) landed
        lost += int((float(p * args.rounds) - accs[rank]).abs().sum().item())
    if th is not None:
        stop.set()
        th.join()
    out.put((rank, times, lost))


def _push(rank, args, segs, accs, flags, lands, seqs, data) -> None:
    p, numel, chunk, slots = args.procs, args.numel, args.chunk, args.slots
    for _ in range(args.rounds):
        for i in range(p):
            o = (rank + i) % p  # start at different owners to spread contention
            for off in range(0, numel, chunk):
                n = min(chunk, numel - off)
                if args.design == "plain":
                    accs[o][off : off + n].add_(data[:n])
                elif args.design == "lock":
                    with RangeLock(segs[o].fd, off // chunk, 60.0, "bench"):
                        accs[o][off : off + n].add_(data[:n])
                else:
                    k = int(seqs[o].argmin())  # the slot used longest ago
                    f = flags[o]
                    pause = 1e-5
                    while f[rank, k, 1] < seqs[o, k]:  # wait until the owner drained it
                        time.sleep(pause)
                        pause = min(pause * 2, 2e-4)
                    lands[o][rank, k, :n].copy_(data[:n])
                    f[rank, k, 2] = off
                    seqs[o, k] = seqs[o].max() + 1
                    f[rank, k, 0] = seqs[o, k]  # data, then flag (x86-64 keeps store order)
    if args.design == "thread":  # done = every landed chunk acknowledged
        for o in range(p):
            for k in range(slots):
                while flags[o][rank, k, 1] < seqs[o, k]:
                    time.sleep(1e-5)


def run(args: argparse.Namespace) -> dict:
    p = args.procs
    _, _, size = _layout(p, args.numel, args.chunk, args.slots)
    tag = uuid.uuid4().hex[:8]
    paths = [os.path.join(shm_dir(), f"odcfn-bench-{tag}-{r}") for r in range(p)]
    owners = [Segment(path, size, create=True) for path in paths]
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(p), ctx.Queue()
    try:
        procs = [ctx.Process(target=_worker, args=(r, args, paths, barrier, out)) for r in range(p)]
        for pr in procs:
            pr.start()
        rows = [out.get(timeout=300) for _ in range(p)]
        for pr in procs:
            pr.join()
    finally:
        for s in owners:
            s.close()
    # a repetition ends when its slowest rank is done
    per_rep = sorted(max(r[1][i] for r in rows) for i in range(args.repeat))
    best, median = per_rep[0], per_rep[len(per_rep) // 2]
    pushed = p * p * args.rounds * args.numel * 4  # bytes accumulated, all ranks together
    return {
        "design": args.design, "procs": p, "chunk": args.chunk, "best_s": round(best, 4),
        "median_s": round(median, 4), "GB/s_best": round(pushed / best / 1e9, 3),
        "GB/s_median": round(pushed / median / 1e9, 3), "lost_elements": sum(r[2] for r in rows),
        "chunks": p * p * args.rounds * -(-args.numel // args.chunk),
    }


def _identity(p, x, mb):
    return x


def transport_worker(numel: int, reps: int) -> dict:
    """Median seconds per op on the real transports: ShmTransport's one-sided gather and locked
    scatter-accumulate vs the gloo all-gather / reduce-scatter of the same unit."""
    import odcfn
    from odcfn.model import Model, Unit
    from odcfn.sharding import make_layout
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    model = Model((Unit("u", _identity, {"w": torch.Size([numel * mesh.world_size])}),))
    layout = make_layout(model, mesh)
    u = layout["u"]
    out, grad = torch.empty(u.padded_numel), torch.ones(u.padded_numel)
    ops = {
        "gather (shm, one-sided)": lambda tr: tr.gather("u", out),
        "all_gather (gloo)": lambda tr: tr.all_gather("u", out),
        "scatter_accumulate (shm, locked)": lambda tr: tr.scatter_accumulate("u", grad),
        "reduce_scatter (gloo)": lambda tr: tr.reduce_scatter("u", grad),
    }
    times = {}
    with ShmTransport(mesh, timeout=120) as tr:
        tr.begin_step(layout, {"u": torch.randn(u.shard_size)}, torch.float32)
        for name, op in ops.items():
            ts = []
            for _ in range(reps):
                tr.dist.barrier()  # all ranks issue the op together
                t0 = time.perf_counter()
                op(tr)
                ts.append(time.perf_counter() - t0)
            times[name] = sorted(ts)[len(ts) // 2]
        tr.flush()
        tr.sync(torch.zeros(1, dtype=torch.float64))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--numel", type=int, default=262144)
    ap.add_argument("--chunk", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--design", choices=["plain", "lock", "thread", "all", "transport"], default="all")
    args = ap.parse_args()
    if args.design == "transport":  # whole-unit ops on the real transports, via odcfn.launch
        from odcfn.launch import launch

        res = launch(transport_worker, args.procs, args=(args.numel, args.repeat))
        mib = args.numel * args.procs * 4 / 2**20
        for name in res[0]:
            t = max(r[name] for r in res)
            print({"op": name, "procs": args.procs, "unit_MiB": round(mib, 2), "median_ms": round(t * 1e3, 3),
                   "GB/s (unit bytes / time)": round(mib * 2**20 / t / 1e9, 3)}, flush=True)
        return
    designs = ["plain", "lock", "thread"] if args.design == "all" else [args.design]
    for d in designs:
        print(run(argparse.Namespace(**{**vars(args), "design": d})), flush=True)


if __name__ == "__main__":
    main()
