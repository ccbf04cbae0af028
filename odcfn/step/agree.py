"""Do all ranks train the same units? Checked when a transport first sees a layout, before the
first gather.

The minibatch fingerprint (``odcfn.step.fingerprint``) rides the step's one sync, at its end:
too late for ranks that disagree on what is trained. A rank that trains a unit pushes its
gradient into the owner's accumulator, which an owner that freezes the unit does not have (a
``KeyError`` there, a timeout on its peer), and in collective mode the ranks would issue
different reduce-scatters. So when a transport first meets a layout, every rank puts a digest
of its units and one of its frozen flags into one small all-reduce of the transport's
collectives (not the step's sync: once per layout, as ``ShmTransport``'s own layout check is).
Every rank sees the same sums and raises the same error; only then, to name every rank's frozen
set, comes a second all-reduce of the flags themselves."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from odcfn.sharding import Layout, Mesh
from odcfn.transport.base import world_group

__all__ = ["check_trained_units"]

_BITS = 48  # flags per float64 word (exact below 2**53)


def _digest(x: object) -> float:
    return float(int.from_bytes(hashlib.sha256(repr(x).encode()).digest()[:6], "little"))


def _described(frozen: list[set[str]]) -> str:
    common = set.intersection(*frozen)
    said = []
    for p, f in enumerate(frozen):
        if not f:
            said.append(f"rank {p} trains every unit")
        elif len(f) <= 8:
            said.append(f"rank {p} freezes {sorted(f)}")
        else:
            odd = sorted(f - common)[:8]
            said.append(f"rank {p} freezes {len(f)} units, {odd} of them not on every rank")
    return "; ".join(said)


def check_trained_units(transport: Any, layout: Layout, mesh: Mesh) -> None:
    """A ``ValueError`` on every rank alike if the ranks' layouts differ in their units or in
    which units are frozen (``TrainState.create(trainable=...)``, ``Model.frozen``)."""
    names = [u.name for u in layout.units]
    flags = [bool(u.frozen) for u in layout.units]
    key = (tuple((u.name, u.shard_size) for u in layout.units), tuple(flags))
    coll = getattr(transport, "collectives", None)
    if mesh.world_size == 1 or coll is None or getattr(transport, "_agreed_units", None) == key:
        return  # (no collectives: the sync's fingerprint is the only check there is)
    w, r, group = mesh.world_size, mesh.rank, world_group(mesh)
    mine = torch.zeros(w, 2, dtype=torch.float64)
    mine[r] = torch.tensor([_digest(key[0]), _digest(key[1])], dtype=torch.float64)
    got = coll.all_reduce(group, mine.reshape(-1)).view(w, 2)
    if len(set(got[:, 0].tolist())) > 1:
        raise ValueError(
            "ranks disagree on the parameter layout (a different model, world or sharding?): "
            "their units' names and shard sizes differ"
        )
    if len(set(got[:, 1].tolist())) > 1:
        n = -(-len(names) // _BITS)
        bits = torch.zeros(w, n, dtype=torch.float64)
        for i, f in enumerate(flags):
            if f:
                bits[r, i // _BITS] += float(1 << (i % _BITS))
        every = coll.all_reduce(group, bits.reshape(-1)).view(w, n).tolist()
        frozen = [{x for i, x in enumerate(names) if int(row[i // _BITS]) >> (i % _BITS) & 1}
                  for row in every]
        raise ValueError(
            f"ranks disagree on the trained units: {_described(frozen)}. Every rank must train the "
            "same units (the same TrainState.create(trainable=...) and Model.frozen)"
        )
    try:
        transport._agreed_units = key
    except AttributeError:  # pragma: no cover - a transport with __slots__: check every step
        pass
