"""One RL iteration's trainer side (train_step + gather_params), bf16 compute, 2 processes on
ShmTransport: the cost of the weight sync publishing in another dtype than the step.

    python bench/rl_iteration.py                       # gather_params' default dtype
    python bench/rl_iteration.py --gather-dtype model  # the full-precision gather (as before)

``gather_params`` used to publish the shards in the model's dtype (fp32) while ``train_step``
publishes them in the compute dtype (bf16), so each iteration remapped the /dev/shm segments
twice (a rendezvous with two barriers, a new file per rank, accumulators zeroed). Printed: the
median over the timed iterations of the slower rank's times, and the segment mappings made.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def worker(a: argparse.Namespace) -> dict:
    import torch

    import odcfn
    from odcfn.models import QwenConfig, init_params, qwen_model
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    cfg = QwenConfig(vocab_size=8192, d_model=a.d_model, n_layers=4, n_heads=8, n_kv_heads=4,
                     d_ff=3 * a.d_model)
    model, mesh = qwen_model(cfg), odcfn.Mesh.from_env()
    batch = odcfn.random_batch([128, 96, 160, 64], cfg.vocab_size, seed=0)
    with ShmTransport(mesh, timeout=60) as tr:
        maps = 0
        inner = tr._map

        def counted(*args):
            nonlocal maps
            maps += 1
            return inner(*args)

        tr._map = counted
        state = odcfn.TrainState.create(
            params=init_params(cfg, seed=0), model=model, optimizer=odcfn.adamw(1e-4), transport=tr,
            config=odcfn.StepConfig(compute_dtype=torch.bfloat16),
        )
        dtype = model.dtype if a.gather_dtype == "model" else None
        step_s, gather_s = [], []
        for _ in range(a.warmup + a.iters):
            t0 = time.perf_counter()
            state, _ = odcfn.train_step(state, batch)
            t1 = time.perf_counter()
            odcfn.gather_params(state, dst=0, dtype=dtype)
            step_s.append(t1 - t0)
            gather_s.append(time.perf_counter() - t1)
        return {"step": step_s[a.warmup:], "gather": gather_s[a.warmup:], "maps": maps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gather-dtype", choices=["default", "model"], default="default")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tree", default=None, help="import odcfn from this checkout")
    a = ap.parse_args()
    if a.tree:
        sys.path.insert(0, a.tree)
    from odcfn.launch import launch

    out = launch(worker, 2, args=(a,), timeout=120)
    med = lambda key: statistics.median(max(o[key][i] for o in out) for i in range(a.iters))  # noqa: E731
    it = statistics.median(max(o["step"][i] + o["gather"][i] for o in out) for i in range(a.iters))
    print(f"gather dtype {a.gather_dtype}: iteration {it:.3f} s (train_step {med('step'):.3f} s, "
          f"gather_params {med('gather'):.3f} s), segment mappings per rank {out[0]['maps']} "
          f"over {a.warmup + a.iters} iterations")


if __name__ == "__main__":
    main()
