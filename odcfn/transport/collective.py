"""torch.distributed behind odcfn: the one ``Collectives`` implementation (gloo on CPU, nccl on
GPU) and ``CollectiveTransport``, the FSDP baseline built on it alone.

``TorchCollectives`` owns every torch.distributed call odcfn makes, so every transport that
talks over torch.distributed (shared memory, the collective baseline, CUDA IPC, NVSHMEM) wraps
failures into ``TransportError`` the same way and counts each call it issues (``calls``): the
"one sync per minibatch" tests count on the real wire, not on a bookkeeping field.

Process groups: an existing default group (the caller's: torchrun, verl, Ray Train) is used as
it is; one is created from the torchrun environment only when none exists, and destroyed when
the last odcfn object using it closes. Subgroups (shard and replica groups, and a world group
carrying odcfn's timeout when the caller's default group has its own) are odcfn's and are
destroyed on ``close``; a group odcfn did not create is never destroyed.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from odcfn._check import check_number
from odcfn.kernels.quant import Wire, WireState, publish
from odcfn.sharding import Layout, Mesh
from odcfn.transport.base import Counters, StepCollectives, TransportError, mesh_groups, world_group

__all__ = ["CollectiveTransport", "TorchCollectives", "ensure_process_group"]

# torch 2.13 deprecates the *_into_tensor/_tensor names in favour of *_single; older torch lacks
# the new names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# the default group odcfn created, and how many open TorchCollectives use it
_OWNED: dict[str, Any] = {"group": None, "users": 0}


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
    td = timedelta(seconds=timeout)
    _forget_failed_init()
    dist.init_process_group(
        backend, store=_fresh_store(mesh, td), rank=mesh.rank, world_size=mesh.world_size, timeout=td
    )
    return True


def _forget_failed_init() -> None:
    """torch names the default group after a process-wide group counter that only destroying
    the default group resets; an ``init_process_group`` that failed half-way (a peer died
    during the rendezvous) leaves it at 1, and every later default group of this process would
    then look for its peers under another name and time out. With no default group there is no
    group at all, so the counter must be 0 (private torch state: guarded)."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and getattr(world, "group_count", 0):
        world.group_count = 0


# the job's store client (rank 0: also its server when no launcher hosts it), kept for the
# process's life: keyed by (address, port, restart count)
_STORE: dict[str, Any] = {"key": None, "store": None}


def _fresh_store(mesh: Mesh, td: timedelta) -> Any:
    """A key space of the job's store that no earlier default group of this job used.

    torch names a re-created default group's keys exactly as the first one's (its group counter
    restarts at 0), and the store outlives a group: a launcher's or torchrun agent's store lives
    for the job, and rank 0's own server is shared by every client in its process. A re-created
    group (a transport opened again, a restarted worker) would then read the previous
    incarnation's addresses and fail in gloo's connectFullMesh. So each incarnation gets its own
    prefix: the restart count (torchrun/odcfn.launch set ``TORCHELASTIC_RESTART_COUNT``) and a
    round agreed through the store itself: every rank adds 1 to a counter before joining, and a
    round's W joins all land before any rank of it can finish joining, so ``(count-1) // W``
    is the same on every rank of the round. The store is kept for the process's life: dropping
    rank 0's server between rounds would let a fast peer meet a dying server.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], restart, mesh.world_size)
    if _STORE["key"] != key:
        _STORE["store"] = None  # another job (the test pool's next task) or incarnation
        store, _, _ = next(dist.rendezvous("env://", rank=mesh.rank, world_size=mesh.world_size, timeout=td))
        _STORE["key"], _STORE["store"] = key, store
    store = _STORE["store"]
    store.set_timeout(td)
    base = f"odcfn/pg/{restart}/w{mesh.world_size}"
    joined = store.add(f"{base}/joins", 1)
    return dist.PrefixStore(f"{base}/round{(joined - 1) // mesh.world_size}/", store)


class TorchCollectives:
    """``Collectives`` over torch.distributed for ``mesh``: construct on every rank in the same
    order (group creation is collective). Tensors are staged through ``self.device`` (gloo wants
    CPU, nccl CUDA), so any transport works with either backend whatever device its buffers
    live on. ``backend`` defaults to nccl for a CUDA ``device`` (or, without a device, when
    CUDA is available), else gloo."""

    def __init__(
        self,
        mesh: Mesh,
        device: torch.device | str | None = None,
        *,
        backend: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be an odcfn.Mesh, got {type(mesh).__name__}")
        check_number(timeout, "timeout", positive=True, finite=False, want="a positive number of seconds")
        if backend is None:
            cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
            backend = "nccl" if cuda else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if device is None:
            gpus = max(torch.cuda.device_count(), 1)
            device = torch.device("cuda", mesh.local_rank % gpus) if backend == "nccl" else "cpu"
        self.mesh, self.timeout, self.backend = mesh, float(timeout), backend
        self.device = torch.device(device)
        self.calls: Counter[str] = Counter()
        if ensure_process_group(mesh, self.timeout, backend):
            # a fresh default group: any count left from an earlier one (destroyed by someone
            # else, e.g. between the test pool's tasks) no longer applies
            _OWNED["group"], _OWNED["users"] = dist.group.WORLD, 0
        self._uses_owned = _OWNED["group"] is not None and _OWNED["group"] is dist.group.WORLD
        if self._uses_owned:
            _OWNED["users"] += 1
        self._created: list[Any] = []
        td = timedelta(seconds=self.timeout)
        world = world_group(mesh)
        # the caller's default group keeps the caller's timeout and backend: ours gets its own
        self.groups: dict[tuple[int, ...], Any] = {
            world: None if self._uses_owned else self._new_group(None, td)
        }
        for g in mesh_groups(mesh):  # every rank creates every group, in the same order
            if g not in self.groups:
                self.groups[g] = self._new_group(list(g), td)

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

    def _group(self, group: tuple[int, ...]) -> Any:
        try:
            return self.groups[tuple(group)]
        except KeyError:
            raise ValueError(f"{tuple(group)} is not a group of {self.mesh}") from None

    def _staged(self, out: torch.Tensor) -> torch.Tensor:
        if out.device == self.device:
            return out
        return torch.empty(out.shape, dtype=out.dtype, device=self.device)

    # --- Collectives --------------------------------------------------------------------------
    def all_gather(self, group: tuple[int, ...], mine: torch.Tensor, out: torch.Tensor) -> None:
        o = self._staged(out)
        self._call("all_gather", _ALL_GATHER, o, mine.to(self.device).contiguous(), group=self._group(group))
        if o is not out:
            out.copy_(o)

    def reduce_scatter(self, group: tuple[int, ...], grad: torch.Tensor, out: torch.Tensor) -> None:
        o = self._staged(out)
        g = grad.to(self.device).contiguous()
        self._call("reduce_scatter", _REDUCE_SCATTER, o, g, group=self._group(group))
        if o is not out:
            out.copy_(o)

    def all_reduce(self, group: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        y = x.detach().to(self.device, copy=True)
        self._call("all_reduce", dist.all_reduce, y, group=self._group(group))
        return y.to(x.device)

    def barrier(self) -> None:
        # an all-reduce of one element rather than dist.barrier: gloo's barrier ignores the
        # group timeout in some versions, and this one is counted like everything else
        t = torch.zeros(1, device=self.device)
        self._call("barrier", dist.all_reduce, t, group=self.groups[world_group(self.mesh)])

    def close(self) -> None:
        for g in self._created:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort on a broken group
                pass
        self._created.clear()
        self.groups = {}
        if self._uses_owned:
            self._uses_owned = False
            _OWNED["users"] -= 1
            if _OWNED["users"] == 0 and dist.is_initialized() and _OWNED["group"] is dist.group.WORLD:
                _OWNED["group"] = None
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - best effort on a broken group
                    pass


class CollectiveTransport(StepCollectives):
    """FSDP over torch.distributed: the collective half only (``comm="collective"``); it has no
    point-to-point ops, so it cannot serve ``comm="odc"`` (``base.supports_odc`` is False).

    ``with CollectiveTransport(odcfn.Mesh.from_env()) as tr: ...``; ``collectives`` may be
    passed to share one ``TorchCollectives`` (it is then not closed here)."""

    def __init__(
        self,
        mesh: Mesh,
        *,
        timeout: float = 60.0,
        backend: str | None = None,
        collectives: TorchCollectives | None = None,
    ) -> None:
        self._owns_collectives = collectives is None
        self.collectives = collectives or TorchCollectives(mesh, backend=backend, timeout=timeout)
        self.mesh, self.timeout = mesh, float(timeout)
        self.counters = Counters()
        self.step = 0
        self.layout: Layout | None = None
        self._pub: dict[str, torch.Tensor] = {}
        self._acc: dict[str, torch.Tensor] = {}
        self._wire = WireState()

    supports_wire = True  # begin_step(..., wire=): quantized all-gathers (pushes: fp32 only)

    def begin_step(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], compute_dtype: torch.dtype,
        wire: Wire | None = None,
    ) -> None:
        self.layout = layout
        self.step += 1
        fmt = self._wire.use(wire).wire.gather_format
        for u in layout.units:
            self._pub[u.name] = publish(self._pub.get(u.name), shards[u.name], compute_dtype, fmt)
            if u.frozen:  # never reduce-scattered: no accumulator
                self._acc.pop(u.name, None)
                continue
            acc = self._acc.get(u.name)
            if acc is None or acc.numel() != u.shard_size:
                self._acc[u.name] = torch.zeros(u.shard_size, dtype=torch.float32)
            else:
                acc.zero_()

    def _check(self, unit: str) -> None:
        if self.layout is None:
            raise TransportError("begin_step must come before any communication")
        self.layout[unit]  # noqa: B018 - raises on an unknown unit

    def _published(self, unit: str) -> torch.Tensor:
        self._check(unit)
        return self._pub[unit]

    def _accumulator(self, unit: str) -> torch.Tensor:
        self._check(unit)
        return self._acc[unit]

    def flush(self) -> None:
        return None  # every collective completed in place

    def grad_shards(self) -> dict[str, torch.Tensor]:
        return self._acc

    def close(self) -> None:
        if self._owns_collectives:
            self.collectives.close()

    def __enter__(self) -> CollectiveTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
