"""One rank of a job of simulated one-rank nodes, each with its own snapshot directory: how the
memory tier across nodes is exercised on one machine (``odcfn bench --only recovery`` and
tests/checkpoint/test_recovery_nodes.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["node_worker"]


def node_worker(doc: dict, snapshots: str, lose: tuple[int, ...] = (), secret: str | None = None) -> dict:
    """One rank of a job of one-rank simulated nodes (whatever the launcher said), each node
    with its own snapshot directory under ``snapshots``; the nodes in ``lose`` come back from
    the first restart without their memory (a rebooted or new machine). ``secret``: the job's
    ``ODCFN_JOB_SECRET`` where the launcher sets none (the tests' worker pool)."""
    from odcfn.sft.config import config_from_dict
    from odcfn.sft.loop import process_worker

    rank = int(os.environ["RANK"])
    # one rank per "node" for the memory tier; training still shares this machine's /dev/shm
    os.environ.update({"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0", "GROUP_RANK": str(rank),
                       "ODCFN_ONE_MACHINE": "1"})
    if secret is not None:
        os.environ["ODCFN_JOB_SECRET"] = secret
    mine = Path(snapshots) / f"node{rank}"
    os.environ["ODCFN_SNAPSHOT_DIR"] = str(mine)
    if rank in lose and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
        shutil.rmtree(mine, ignore_errors=True)
    mine.mkdir(parents=True, exist_ok=True)
    out = process_worker(config_from_dict(doc))
    out.pop("shards", None)
    return out
