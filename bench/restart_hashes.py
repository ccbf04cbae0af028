"""How many files each rank of a W-rank restart hashes: two snapshots in a memory tier, then
every rank resumes (choosing the newest verified snapshot) and reads its shards from it.

    PYTHONPATH=. python bench/restart_hashes.py 4
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import odcfn
from odcfn.checkpoint import memory_tier, verify
from odcfn.checkpoint.memory_tier import MemoryTier
from odcfn.checkpoint.sharded import read_shards
from odcfn.models import QwenConfig, init_params, qwen_model

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def main(W: int) -> None:
    tmp = Path(tempfile.mkdtemp())
    os.environ["ODCFN_SHM_DIR"] = str(tmp / "shm")
    model, tier = qwen_model(CFG), MemoryTier(tmp / "run")

    def save(rank: int, tr: Any) -> None:
        st = odcfn.TrainState.create(params=init_params(CFG, seed=0), model=model,
                                     optimizer=odcfn.adamw(1e-2), transport=tr)
        for s in (3, 4):
            odcfn.save(tier.path(s), st.replace(step=s))

    odcfn.run_local(save, W)
    time.sleep(2.5)  # a restart reads snapshots written before it
    seen: Counter = Counter()
    real = verify.sha256

    def counted(p: Path) -> str:
        seen[threading.get_ident()] += 1
        return real(p)

    verify.sha256 = counted
    if hasattr(memory_tier, "sha256"):  # odcfn before this script's commit imported it there
        memory_tier.sha256 = counted

    def restart(rank: int, tr: Any) -> int:
        try:
            t = MemoryTier(tmp / "run", mesh=tr.mesh, collectives=tr.collectives)
        except TypeError:  # before: no collective resume
            t = MemoryTier(tmp / "run")
        read_shards(t.resume(tmp / "disk"), model=model, mesh=tr.mesh)
        return threading.get_ident()

    tids = odcfn.run_local(restart, W)
    print(f"W={W}: files hashed per rank {[seen[t] for t in tids]}, total {sum(seen.values())}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
