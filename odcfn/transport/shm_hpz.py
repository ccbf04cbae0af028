"""Hierarchical shards (hpZ, ``ScheduleOptions(reshard_after_forward=k)``) across local processes:
``ShmTransport.publish_secondary`` / ``gather_group``, with ``LocalTransport``'s semantics.

After a unit's forward, the rank at position j of its k-rank group (``Mesh.secondary_group``)
keeps slice j of the gathered copy in its own segment's ``sec`` region (``shm_layout``), then
stamps the unit's ``(k, step)`` words: the data first, then k, then the step ("data, then flag",
as ``ShmTransport`` publishes its shards; x86-64 keeps stores in order and other machines are
refused at construction). A peer of the group that gathers the unit for its backward waits until
every member's stamp reached this step, checks that the member built it for the same k, and
copies the slices itself (one-sided; the builder does nothing). The waits are the transport's:
a member that died, aborted or made no progress for the world's timeout ends them in
``TransportError``, never a hang.

- A second ``publish_secondary`` of a unit in the same step is a no-op: parameters do not change
  inside a minibatch, and peers may be reading the slice.
- A slice is overwritten only at the next step, after the step's sync: every member has then
  finished its reads. At that sync the slices' pages go back to the kernel (``punch_hole``), so
  a rank holds its 1/k of the resharded units for the rest of the minibatch only.
- Slices hold the gathered copy in the compute dtype, as ``LocalTransport`` keeps them: under a
  low-precision ``gather_format`` the forward's gather dequantized them already, so the group
  gather moves compute-dtype bytes and reads exactly the values the forward used.
- Counters as ``LocalTransport``'s: ``gather_bytes`` and ``gathers`` for the group gathers, and
  the bytes per source rank in ``group_bytes`` (the primary gathers' in ``peer_bytes``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from odcfn.transport.base import Done, Handle, TransportError
from odcfn.transport.shm_sync import punch_hole

__all__ = ["ShmSecondary"]

K, STEP = 0, 1  # the two stamp words of a unit: group size, step


class ShmSecondary:
    """The hpZ half of one ``ShmTransport`` (its segments, waits and counters)."""

    def __init__(self, transport: Any) -> None:
        self.tr = transport
        self._dirty = False  # slices written since the last release

    def _stamps(self, rank: int) -> np.ndarray:
        seg = self.tr._seg
        n = len(seg.key[0])
        return self.tr._segs[rank].view(seg.stamps, 2 * n, torch.int64).numpy().reshape(n, 2)

    def _slice(self, rank: int, unit: str, numel: int) -> torch.Tensor:
        seg = self.tr._seg
        return self.tr._segs[rank].view(seg.sec[unit], numel, seg.key[1])

    def _check(self, unit: str, t: torch.Tensor, group: int, what: str) -> tuple[int, int]:
        """(unit index, slice elements) after checking ``t`` is the unit's gathered copy."""
        tr = self.tr
        if unit not in tr._seg.sec:
            raise ValueError(f"{what}: unknown unit {unit!r}")
        padded, dtype = tr.layout[unit].padded_numel, tr._seg.key[1]
        if t.dtype != dtype or t.numel() != padded:
            raise TypeError(
                f"{what}({unit!r}): expects the unit's gathered copy ({padded} elements of {dtype}), "
                f"got {t.numel()} of {t.dtype}"
            )
        tr.mesh.secondary_group(group)  # ValueError naming reshard_after_forward if k does not divide
        return [n for n, *_ in tr._seg.key[0]].index(unit), padded // group

    def publish(self, unit: str, full: torch.Tensor, group: int) -> None:
        tr, me = self.tr, self.tr.mesh.rank
        i, n = self._check(unit, full, group, "publish_secondary")
        stamps = self._stamps(me)
        if stamps[i, STEP] == tr.step:  # built already this step: peers may be reading it
            return
        j = tr.mesh.secondary_group(group).index(me)
        self._slice(me, unit, n).copy_(full.detach()[j * n : (j + 1) * n])
        self._dirty = True
        stamps[i, K] = group  # data, then k, then the step
        stamps[i, STEP] = tr.step

    def gather(self, unit: str, out: torch.Tensor, group: int) -> Handle:
        tr, me, step = self.tr, self.tr.mesh.rank, self.tr.step
        i, n = self._check(unit, out, group, "gather_group")
        for j, peer in enumerate(tr.mesh.secondary_group(group)):
            stamps = self._stamps(peer)
            if peer != me:
                tr._wait(lambda s=stamps: s[i, STEP] >= step,
                         f"rank {peer} to build its group shard of {unit!r}", (peer,))
            built, k = int(stamps[i, STEP]), int(stamps[i, K])
            if built != step or k != group:
                said = f"step {built} with k={k}" if built else "nothing"
                raise TransportError(
                    f"rank {me}: gather_group({unit!r}) at step {step} with reshard_after_forward="
                    f"{group}, but rank {peer}'s group shard holds {said} (ranks disagree on "
                    "ScheduleOptions.reshard_after_forward, or a plan read a slice it never built)"
                )
            src = self._slice(peer, unit, n)
            out[j * n : (j + 1) * n].copy_(src)
            if peer != me:
                nbytes = src.numel() * src.element_size()
                tr.counters.gather_bytes += nbytes
                tr.group_bytes[peer] += nbytes
        tr.counters.gathers += 1
        return Done()

    def release(self) -> None:
        """Give this rank's slices' pages back (call once every rank is past its reads: the
        sync). The stamps stay: a slice reads as built only for the step that wrote it."""
        if self._dirty and self.tr._segs:
            lo, hi = self.tr._seg.sec_span
            punch_hole(self.tr._segs[self.tr.mesh.rank].fd, lo, hi - lo)  # else: kept, harmless
            self._dirty = False
