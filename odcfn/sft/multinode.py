"""How one rank of ``odcfn train`` under ``torchrun`` (or ``odcfn.launch``) picks its transport
from the launcher's environment (docs/multinode.md):

- ``WORLD_SIZE``, ``RANK``: the job; ``LOCAL_WORLD_SIZE`` (torchrun's ``--nproc-per-node``): the
  ranks per node (``odcfn.Mesh.from_env``);
- one node (``LOCAL_WORLD_SIZE`` = ``WORLD_SIZE``, or unset): ``ShmTransport``, every rank maps
  every peer's /dev/shm segment, full sharding;
- several nodes: hybrid sharding (parameters sharded inside a node, replicated across nodes) on
  the CPU IPC fabric (``cuda_ipc_transport(device="cpu")``), which maps only its own node's
  arenas and all-reduces the replicas over gloo. Its rendezvous and counters go through the
  store torchrun's agents host (``MASTER_ADDR``/``MASTER_PORT``, set for every worker by both
  the static and the c10d rendezvous); nothing else is needed from the environment.

``ODCFN_ONE_MACHINE=1`` keeps the one-node path whatever ``LOCAL_WORLD_SIZE`` says: ranks that
only pretend to be nodes on one machine (``odcfn.sft.simulated_nodes``, the memory tier's
recovery tests) share /dev/shm as before.
"""

from __future__ import annotations

import os
from contextlib import closing
from datetime import timedelta
from typing import Any

__all__ = ["job_mesh", "job_transport"]


def job_mesh() -> Any:
    """This rank's mesh from the launcher's environment: full sharding on one node, hybrid
    across nodes (a shard group must not span machines: its members map each other's memory)."""
    import odcfn

    mesh = odcfn.Mesh.from_env()
    return mesh if mesh.num_nodes == 1 or _one_machine() else odcfn.Mesh.from_env("hybrid")


def _one_machine() -> bool:
    return os.environ.get("ODCFN_ONE_MACHINE") == "1"


def job_transport(mesh: Any, timeout: float) -> Any:
    """The transport for ``mesh`` (a context manager: closing it frees its shared memory)."""
    if mesh.num_nodes == 1 or _one_machine():
        from odcfn.transport.shm import ShmTransport

        return ShmTransport(mesh, timeout=timeout)
    import torch.distributed as dist

    from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport

    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeError(f"odcfn train: {mesh.num_nodes} nodes but {key} is not set: launch with "
                               "torchrun (--rdzv-backend c10d --rdzv-endpoint HOST:PORT), which sets it for "
                               "every rank")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    return closing(cuda_ipc_transport(mesh, dist.PrefixStore("odcfn-train", store), device="cpu",
                                      mode="landing", timeout=timeout))
