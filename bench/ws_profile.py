"""Where work stealing's time goes when nobody is slow: LB-Mini and work-stealing variants run
``train_step`` side by side on the bench workload (2 processes, minibatches interleaved), with
per-rank CPU time, microbatch counts, the trace's time in gathers and pushes, and the calls and
time spent in ``fetch_add`` (work stealing's shared counters).

    python bench/ws_profile.py [--steps 6] [--samples-per-rank 4] [--slowdown 1.5]

CPU time (both ranks) is the figure that survives a shared machine: idle waits cost none of it.
"""

from __future__ import annotations

import argparse
import collections
import math
import time

import torch


def _variants() -> dict:
    from odcfn.schedule.steal import WorkStealing

    return {"lb_mini": "lb_mini", "ws (default)": WorkStealing(),
            "ws split_tail=1 (former default)": WorkStealing(split_tail=1.0),
            "ws packed lists": WorkStealing(split_tail=0.0, split_cost=math.inf)}


def worker(steps: int, spr: int, slowdown: float) -> list[dict]:
    import torch.distributed as dist

    import odcfn
    from odcfn.bench.workload import Workload, make_batch
    from odcfn.models import init_params, qwen_model
    from odcfn.models.slow import slow_model
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    w = Workload(samples_per_rank=spr)
    pols = _variants()
    out = []
    with ShmTransport(mesh, timeout=300) as tr:
        calls = {"n": 0, "s": 0.0}
        plain = tr.fetch_add

        def timed(counter: int, n: int = 1) -> int:
            t = time.perf_counter()
            try:
                return plain(counter, n)
            finally:
                calls["n"] += 1
                calls["s"] += time.perf_counter() - t

        tr.fetch_add = timed
        model = slow_model(qwen_model(w.model), slowdown if mesh.rank == mesh.world_size - 1 else 1.0)
        full = init_params(w.model, seed=0)
        states = {name: odcfn.TrainState.create(
            params=full, model=model, optimizer=odcfn.adamw(1e-3), transport=tr,
            config=odcfn.StepConfig(comm="odc", balance=bal,
                                    max_tokens_per_microbatch=w.max_tokens_per_microbatch))
            for name, bal in pols.items()}
        names = list(pols)
        for step in range(steps + 1):  # minibatch 0 warms up
            batch = make_batch(w, step)
            k = step % len(names)
            for name in names[k:] + names[:k]:
                dist.barrier()
                calls["n"], calls["s"] = 0, 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                states[name], m = odcfn.train_step(states[name], batch)
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                comm = sum(e.end - e.start for e in m.events if e.kind in ("gather", "scatter"))
                out.append({"policy": name, "step": step, "rank": mesh.rank, "wall": wall, "cpu": cpu,
                            "microbatches": len(m.plan.microbatches), "comm": comm,
                            "fetch_adds": calls["n"], "fetch_add_s": calls["s"]})
    return out


def main() -> None:
    from odcfn.launch import launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples-per-rank", type=int, default=4)
    p.add_argument("--slowdown", type=float, default=1.0, help="the last rank's compute slowdown")
    a = p.parse_args()
    res = launch(worker, 2, args=(a.steps, a.samples_per_rank, a.slowdown), timeout=3600)
    tot: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    walls: dict = collections.defaultdict(lambda: collections.defaultdict(float))
    for recs in res:
        for r in recs:
            if r["step"]:
                t = tot[r["policy"]]
                for k in ("cpu", "microbatches", "comm", "fetch_adds", "fetch_add_s"):
                    t[k] += r[k]
                walls[r["policy"]][r["step"]] = max(walls[r["policy"]][r["step"]], r["wall"])
    base_cpu = tot["lb_mini"]["cpu"]
    base_wall = sum(walls["lb_mini"].values())
    n = 2 * a.steps
    print(f"{'policy':34} {'CPU s':>7} {'LB-Mini/this CPU':>16} {'wall s':>7} {'LB-Mini/this wall':>17} "
          f"{'mb/rank':>7} {'gather+push s':>13} {'fetch_add/rank':>14} {'their s':>8}")
    for name in _variants():
        t, wall = tot[name], sum(walls[name].values())
        print(f"{name:34} {t['cpu']:7.2f} {base_cpu / t['cpu']:16.3f} {wall:7.2f} {base_wall / wall:17.3f} "
              f"{t['microbatches'] / n:7.2f} {t['comm']:13.3f} {t['fetch_adds'] / n:14.1f} "
              f"{t['fetch_add_s']:8.4f}")


if __name__ == "__main__":
    main()
