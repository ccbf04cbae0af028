"""How long a sharded save takes from the call to the commit, W in-process ranks, 5 saves.

    python bench/save_time.py --world 4                   # this checkout
    python bench/save_time.py --world 4 --tree /tmp/old   # another checkout (git worktree)

Each rank saves its params and AdamW-sized moments (a d=512, 4-layer, V=8192 model: 240 MiB in
all at W=4) into /dev/shm with ``write_shards``; printed: the median over the saves of the
slowest rank's time. Run two trees back to back to compare them (e.g. the committer hashing
every file vs each writer hashing its own).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--tree", default=None, help="import odcfn from this checkout")
    a = ap.parse_args()
    if a.tree:
        sys.path.insert(0, a.tree)
    import odcfn
    from odcfn.checkpoint.sharded import write_shards
    from odcfn.models import QwenConfig, init_params, qwen_model

    cfg = QwenConfig(vocab_size=8192, d_model=512, n_layers=4, n_heads=8, n_kv_heads=4, d_ff=1536)
    root = tempfile.mkdtemp(dir="/dev/shm")

    def rank(_: int, tr) -> list[float]:
        model = qwen_model(cfg)
        state = odcfn.TrainState.create(params=init_params(cfg, seed=0), model=model,
                                        optimizer=odcfn.adamw(1e-3), transport=tr)
        moments = {"count": 0, "mu": {k: v.clone() for k, v in state.params.items()},
                   "nu": {k: v.clone() for k, v in state.params.items()}}
        took = []
        for i in range(a.saves):
            t0 = time.perf_counter()
            write_shards(f"{root}/save{i}", state.params, moments, i, model=model, mesh=tr.mesh)
            took.append(time.perf_counter() - t0)
        return took

    try:
        out = odcfn.run_local(rank, a.world)
        size = sum(os.path.getsize(f"{root}/save0/{f}") for f in os.listdir(f"{root}/save0"))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = statistics.median(max(o[i] for o in out) for i in range(a.saves))
    print(f"{odcfn.__file__}: W={a.world}, {size / 2**20:.0f} MiB per save, median save {med:.4f} s")


if __name__ == "__main__":
    main()
