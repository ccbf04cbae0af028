"""One rank's offloaded owner state (``StepConfig(offload=Offload(...))``): the fp32 master
shard and the optimizer leaves of every trained unit in a slower tier, and the resident
published copy that gathers read.

The tier is a backing of bytes: a file under ``Offload.path`` (unlinked once mapped: its space
is held while the state lives and freed when it dies, crash included) or, with ``path=None``,
a host buffer (pinned on CUDA). Each unit owns one 4 KiB-aligned region: its master shard, then
its optimizer leaves in name order, so loading a unit is one read. The state's tensors
(``TrainState.params`` of trained units, the optimizer leaves) are views of that backing, so
``torch.equal``, ``odcfn.save`` and every reader see the values without copying the whole state
in; the update does not touch those views: it reads each unit into a bounded buffer, updates
it there and writes it back (``odcfn.step.offload``). File writes go through the page cache,
which the views map, so a view sees a write as soon as it returns.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

from odcfn.step.offload_config import Offload, check_budget, check_space

__all__ = ["MASTER", "Store", "place", "store_of"]

MASTER = "params"  # a unit's region starts with its master shard
_ALIGN = 4096
_CHUNK = 1 << 28  # bytes per read/write call (Linux moves at most ~2 GiB per call)
_ATTR = "_odcfn_offload"  # the store a view belongs to (an attribute of the view tensor)


def _round(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _groups(opt_state: Any, units: list[str]) -> tuple[dict[str, Any], list[str]]:
    """The optimizer state's scalars and the names of its per-unit groups (``{"mu": {unit:
    tensor}}``): the shape odcfn's optimizers use, which the offloaded update needs."""
    if not isinstance(opt_state, Mapping):
        raise TypeError(
            "Offload needs an optimizer state that is a dict (odcfn.adamw / odcfn.sgd), got "
            f"{type(opt_state).__name__}"
        )
    scalars, groups = {}, []
    for key, v in opt_state.items():
        if isinstance(v, Mapping):
            odd = sorted(set(v) ^ set(units))
            if odd or not all(isinstance(t, torch.Tensor) for t in v.values()):
                raise TypeError(
                    f"Offload: optimizer state group {key!r} must map every trained unit to a tensor "
                    f"(units that differ: {odd[:4]})"
                )
            groups.append(key)
        elif isinstance(v, torch.Tensor):
            raise TypeError(f"Offload: optimizer state leaf {key!r} is a tensor outside a per-unit group")
        else:
            scalars[key] = v
    return scalars, sorted(groups)


class Store:
    """The backing, each unit's region and entries, and the resident published copies."""

    def __init__(
        self, offload: Offload, specs: dict[str, list[tuple[str, tuple, torch.dtype]]], pinned: bool
    ) -> None:
        self.offload, self.pinned = offload, pinned
        self.entries: dict[str, list[tuple[str, int, tuple, torch.dtype]]] = {}
        self.region: dict[str, tuple[int, int]] = {}
        off = 0
        for unit, spec in specs.items():
            start, at, entries = off, 0, []
            for name, shape, dtype in spec:
                n = dtype.itemsize * int(torch.Size(shape).numel())
                entries.append((name, at, shape, dtype))
                at += -(-n // 64) * 64
            self.entries[unit], self.region[unit] = entries, (start, at)
            off = start + _round(at)
        self.size = max(off, _ALIGN)
        check_budget(offload, {u: n for u, (_, n) in self.region.items()})
        d = check_space(offload, self.size)
        self.fd = -1
        if d is None:
            whole = torch.zeros(self.size, dtype=torch.uint8, pin_memory=pinned)
        else:
            self.fd, p = tempfile.mkstemp(prefix=f"odcfn-offload-{os.getpid()}-", dir=d)
            try:
                os.unlink(p)  # the space lives as long as the mapping and the descriptor
                try:
                    os.posix_fallocate(self.fd, 0, self.size)  # ENOSPC now, not mid-step
                except OSError as e:
                    if e.errno == 28:
                        raise ValueError(
                            f"Offload.path={offload.path!r}: no space for the offloaded "
                            f"state ({self.size / 2**30:.3f} GiB)"
                        ) from e
                    os.ftruncate(self.fd, self.size)  # a filesystem without fallocate
                whole = torch.frombuffer(mmap.mmap(self.fd, self.size), dtype=torch.uint8)
            except BaseException:
                os.close(self.fd)
                raise
        self.whole = whole
        self.published: dict[str, torch.Tensor] = {}
        self.scalars: dict[str, Any] = {}
        self.mapped: dict[str, dict[str, torch.Tensor]] = {}  # the state's views, unit by unit

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)

    @property
    def units(self) -> list[str]:
        return list(self.region)

    def nbytes(self, unit: str) -> int:
        return self.region[unit][1]

    def views(self, unit: str, buf: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A unit's entries as tensors: views of the backing, or of ``buf`` (a unit's bytes)."""
        base = self.whole[self.region[unit][0] :] if buf is None else buf
        out = {}
        for name, at, shape, dtype in self.entries[unit]:
            n = dtype.itemsize * int(torch.Size(shape).numel())
            out[name] = base[at : at + n].view(dtype).view(shape)
        return out

    def read(self, unit: str, buf: torch.Tensor) -> None:
        """The unit's region into ``buf`` (uint8, its size)."""
        start, n = self.region[unit]
        if self.fd < 0:
            buf.copy_(self.whole[start : start + n])
            return
        mv = memoryview(buf.numpy())
        done = 0
        while done < n:
            got = os.preadv(self.fd, [mv[done : min(n, done + _CHUNK)]], start + done)
            if got <= 0:
                raise OSError(f"Offload.path={self.offload.path!r}: short read of unit {unit!r}")
            done += got

    def write(self, unit: str, buf: torch.Tensor) -> None:
        """``buf`` (the unit's bytes) back into its region."""
        start, n = self.region[unit]
        if self.fd < 0:
            self.whole[start : start + n].copy_(buf)
            return
        mv = memoryview(buf.numpy())
        done = 0
        while done < n:
            done += os.pwritev(self.fd, [mv[done : min(n, done + _CHUNK)]], start + done)

    def state(self, params: Mapping[str, torch.Tensor], groups: list[str]) -> tuple[dict, dict]:
        """``(params, opt_state)`` with every trained tensor a view of the backing, marked as
        this store's; frozen units' params stay as given."""
        views = self.mapped = {u: self.views(u) for u in self.units}
        for v in views.values():
            for t in v.values():
                setattr(t, _ATTR, self)
        out = dict(params)
        out.update({u: v[MASTER] for u, v in views.items()})
        opt = dict(self.scalars)
        opt.update({g: {u: views[u][g] for u in self.units} for g in groups})
        return out, opt


def store_of(params: Mapping[str, torch.Tensor], opt_state: Any, trained: list[str]) -> Store | None:
    """The store every trained tensor of a state is a view of, or None (a state to place)."""
    stores = {id(getattr(params[u], _ATTR, None)) for u in trained}
    store = getattr(params[trained[0]], _ATTR, None) if trained else None
    if store is None or len(stores) != 1 or store.units != trained:
        return None
    for u in trained:
        if params[u] is not store.mapped[u][MASTER]:
            return None
    if not isinstance(opt_state, Mapping):
        return None
    for g, group in opt_state.items():
        if isinstance(group, Mapping):
            if any(group.get(u) is not store.mapped[u].get(g) for u in trained):
                return None
        elif store.scalars.get(g, object()) != group:
            store.scalars[g] = group  # a scalar the caller set (the step count): taken as given
    return store


def place(
    offload: Offload,
    params: Mapping[str, torch.Tensor],
    trained: list[str],
    init: Any,
    opt_state: Any,
    compute_dtype: torch.dtype,
    device: torch.device | None = None,
) -> tuple[dict, dict]:
    """``(params, opt_state)`` moved into a new store, one unit at a time. ``opt_state`` None:
    each unit's fresh state from ``init`` (``optimizer.init`` on that unit alone), so the whole
    optimizer state is never resident. Checks the budget and the path first. ``device``: where
    the published copies go (where the step computes); default the frozen units' device (they
    stay resident), else the params'. The store is pinned host memory when that is a GPU."""
    if device is None:
        resident = [t for u, t in params.items() if u not in trained]
        first = resident[0] if resident else next(iter(params.values()), None)
        device = first.device if first is not None else torch.device("cpu")
    meta = init({u: params[u].detach().to("meta") for u in trained}) if opt_state is None else opt_state
    scalars, groups = _groups(meta, trained)
    specs = {
        u: [(MASTER, tuple(params[u].shape), params[u].dtype)]
        + [(g, tuple(meta[g][u].shape), meta[g][u].dtype) for g in groups]
        for u in trained
    }
    store = Store(offload, specs, pinned=device.type == "cuda")
    store.scalars = dict(scalars)
    for u in trained:
        given = {g: opt_state[g][u] for g in groups} if opt_state is not None else None
        leaves = (
            given
            if given is not None
            else {g: v[u] for g, v in init({u: params[u]}).items() if isinstance(v, Mapping)}
        )
        buf = torch.zeros(store.nbytes(u), dtype=torch.uint8)  # written with write(): the
        views = store.views(u, buf)  # mapping's pages are never touched, so never resident
        views[MASTER].copy_(params[u].detach())
        for g in groups:
            views[g].copy_(leaves[g].detach())
        store.write(u, buf)
        store.published[u] = params[u].detach().to(device, compute_dtype, copy=True)
    return store.state(params, groups)
