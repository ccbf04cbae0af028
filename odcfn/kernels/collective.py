"""The FSDP baseline over torch.distributed: all-gather / reduce-scatter per unit (gloo on CPU,
nccl on GPU), plus the one all-reduce ``sync``.

``DistOps`` owns the process groups and every torch.distributed call odcfn makes, so that both
``CollectiveTransport`` and ``ShmTransport`` (whose collective ops and sync are these) wrap
failures into ``TransportError`` the same way and count each call they issue (``calls``): the
"one sync per minibatch" tests count on the real wire, not on a bookkeeping field.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from odcfn.kernels.base import Counters, Done, Handle, TransportError, all_reduce_flat
from odcfn.sharding import Layout, Mesh

__all__ = ["CollectiveTransport", "DistOps", "ensure_process_group"]

# torch 2.13 deprecates the *_into_tensor/_tensor names in favour of *_single; older torch lacks
# the new names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def ensure_process_group(mesh: Mesh, timeout: float, backend: str) -> bool:
    """Initialise the default process group from the torchrun environment unless it exists.
    Returns whether this call created it. A group that exists must match ``mesh``."""
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (mesh.world_size, mesh.rank):
            raise ValueError(
                f"the default process group has world size {dist.get_world_size()} and rank "
                f"{dist.get_rank()}, but the transport was given {mesh}"
            )
        return False
    mesh.check_env()  # a mesh the launcher did not start would wait for the store timeout
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"cannot initialise torch.distributed: {', '.join(missing)} not set "
            "(run under odcfn.launch or torchrun, or call dist.init_process_group yourself)"
        )
    dist.init_process_group(
        backend, rank=mesh.rank, world_size=mesh.world_size, timeout=timedelta(seconds=timeout)
    )
    return True


class DistOps:
    """Process groups for ``mesh`` and the collectives on them, errors wrapped, calls counted."""

    def __init__(self, mesh: Mesh, timeout: float, backend: str | None = None) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be an odcfn.Mesh, got {type(mesh).__name__}")
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.mesh, self.timeout = mesh, float(timeout)
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        self.device = (
            torch.device("cuda", mesh.local_rank) if self.backend == "nccl" else torch.device("cpu")
        )
        self.calls: Counter[str] = Counter()
        self.owns_default = ensure_process_group(mesh, self.timeout, self.backend)
        self._created: list[Any] = []
        td = timedelta(seconds=self.timeout)
        # our own timeout even when someone else created the default group
        self.world = None if self.owns_default else self._new_group(None, td)
        self.shard_group, self.replica_group = self.world, None
        if mesh.sharding == "hybrid":
            # new_group is collective over the whole world: every rank creates every group, in order
            probe = mesh.with_rank(0)
            for node in range(mesh.num_nodes):
                g = self._new_group(list(probe.with_rank(node * mesh.node_size).shard_group), td)
                if node == mesh.node:
                    self.shard_group = g
            for local in range(mesh.node_size):
                g = self._new_group(list(probe.with_rank(local).replica_group), td)
                if local == mesh.local_rank:
                    self.replica_group = g

    def _new_group(self, ranks: list[int] | None, td: timedelta) -> Any:
        g = dist.new_group(ranks=ranks, timeout=td, backend=self.backend)
        self._created.append(g)
        return g

    def _call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            out = fn(*args, **kwargs)
        except RuntimeError as e:  # gloo/nccl errors (DistBackendError is a RuntimeError)
            raise TransportError(
                f"rank {self.mesh.rank}: {op} failed (a peer died, timed out after "
                f"{self.timeout}s, or diverged): {e}"
            ) from e
        self.calls[op] += 1
        return out

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    # --- collectives --------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, src: torch.Tensor) -> None:
        o = self._dev(out)
        self._call("all_gather", _ALL_GATHER, o, self._dev(src.contiguous()), group=self.shard_group)
        if o is not out:
            out.copy_(o)

    def reduce_scatter_add(self, acc: torch.Tensor, grad: torch.Tensor) -> None:
        """acc += this rank's shard of the sum of ``grad`` over the shard group (summed in fp32)."""
        piece = torch.empty(acc.numel(), dtype=torch.float32, device=self.device)
        g = self._dev(grad).to(torch.float32).contiguous()
        self._call("reduce_scatter", _REDUCE_SCATTER, piece, g, group=self.shard_group)
        acc.add_(piece.to(acc.device))

    def replica_all_reduce(self, grads: Mapping[str, torch.Tensor]) -> int:
        """Sum gradient shards over the replica group in place; returns the bytes moved."""
        if self.replica_group is None or len(self.mesh.replica_group) == 1:
            return 0

        def reduce(flat: torch.Tensor) -> torch.Tensor:
            flat = self._dev(flat)
            self._call("replica_all_reduce", dist.all_reduce, flat, group=self.replica_group)
            return flat

        return all_reduce_flat(grads, reduce)

    def all_reduce(self, stats: torch.Tensor) -> torch.Tensor:
        out = self._dev(stats.detach().clone())
        self._call("all_reduce", dist.all_reduce, out, group=self.world)
        return out.to(stats.device)

    def barrier(self) -> None:
        # an all-reduce of one element rather than dist.barrier: gloo's barrier ignores the
        # group timeout in some versions, and this one is counted like everything else
        t = torch.zeros(1, device=self.device)
        self._call("barrier", dist.all_reduce, t, group=self.world)

    def close(self) -> None:
        for g in self._created:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort on a broken group
                pass
        self._created.clear()


class CollectiveTransport:
    """FSDP over torch.distributed: ``all_gather``/``reduce_scatter``/``sync`` only.

    ``with CollectiveTransport(odcfn.Mesh.from_env()) as tr: odcfn.train_step(..., comm="collective")``
    """

    def __init__(self, mesh: Mesh, *, timeout: float = 60.0, backend: str | None = None) -> None:
        self.dist = DistOps(mesh, timeout, backend)
        self.mesh, self.timeout = mesh, float(timeout)
        self.counters = Counters()
        self.step = 0
        self.layout: Layout | None = None
        self._pub: dict[str, torch.Tensor] = {}
        self._acc: dict[str, torch.Tensor] = {}

    def begin_step(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], compute_dtype: torch.dtype
    ) -> None:
        self.layout = layout
        self.step += 1
        for u in layout.units:
            pub = self._pub.get(u.name)
            if pub is None or pub.dtype != compute_dtype or pub.numel() != u.shard_size:
                self._pub[u.name] = torch.empty(u.shard_size, dtype=compute_dtype)
            self._pub[u.name].copy_(shards[u.name])
            acc = self._acc.get(u.name)
            if acc is None or acc.numel() != u.shard_size:
                self._acc[u.name] = torch.zeros(u.shard_size, dtype=torch.float32)
            else:
                acc.zero_()

    def _unit(self, unit: str) -> Any:
        if self.layout is None:
            raise TransportError("begin_step must come before any communication")
        return self.layout[unit]

    def all_gather(self, unit: str, out: torch.Tensor) -> None:
        self._unit(unit)
        self.dist.all_gather(out, self._pub[unit])
        self.counters.collectives += 1
        self.counters.collective_bytes += out.numel() * out.element_size()

    def reduce_scatter(self, unit: str, grad: torch.Tensor) -> None:
        self._unit(unit)
        self.dist.reduce_scatter_add(self._acc[unit], grad)
        self.counters.collectives += 1
        self.counters.collective_bytes += grad.numel() * grad.element_size()

    def flush(self) -> None:
        return None  # every collective completed in place

    def replica_all_reduce(self, grads: Mapping[str, torch.Tensor]) -> None:
        moved = self.dist.replica_all_reduce(grads)
        if moved:
            self.counters.collectives += 1
            self.counters.collective_bytes += moved

    def sync(self, stats: torch.Tensor) -> torch.Tensor:
        out = self.dist.all_reduce(stats)
        self.counters.syncs += 1
        return out

    def grad_shards(self) -> dict[str, torch.Tensor]:
        return self._acc

    def _no_odc(self, op: str) -> None:
        raise NotImplementedError(
            f"CollectiveTransport has no one-sided {op}: use comm='collective', or ShmTransport "
            "for comm='odc'"
        )

    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        self._no_odc("gather")
        return Done()

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        self._no_odc("scatter_accumulate")
        return Done()

    def fetch_add(self, counter: int, n: int = 1) -> int:
        self._no_odc("fetch_add")
        return 0

    def close(self) -> None:
        self.dist.close()

    def __enter__(self) -> CollectiveTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
