"""Hierarchical shards (hpZ, ``ScheduleOptions(reshard_after_forward=k)``) on the arena transports
(CUDA IPC, NVSHMEM): ``publish_secondary`` / ``gather_group`` with ``LocalTransport``'s semantics,
over the same arena and signal words as the published shards (``_protocol``).

- Memory: device memory is not sparse, so the arena holds an hpZ region only once the group size
  is known: ``reserve_secondary(k)`` (the step calls it before ``begin_step`` when its options ask
  for hpZ) sizes ``sec[u]`` to 1/k of each unit's gathered copy, in the compute dtype; the next
  ``begin_step`` re-lays the arena if that changed (a collective over the shard group, as a new
  layout or dtype is). The reservation stays until another k is reserved.
- ``publish_secondary``: copy slice j (this rank's place in its k-rank group) of the gathered copy
  into ``sec[u]``, fence, then write ``pack_stamp(step, k)`` into the unit's SEC word of every
  member of the group: the word becomes visible only after the bytes, as VERSION after a shard.
  Again in the same step: a no-op (peers may be reading).
- ``gather_group``: wait until every member's SEC word of the unit holds this step (the
  transport's bounded wait: ``TransportError`` after its timeout, never a hang), refuse a member
  that built it for another k, then pull the k slices one-sided, in one ``Fabric.get`` (the IPC
  pointer-table gather, or NVSHMEM's node-local copies and remote gets), as ``gather`` pulls the
  owners' shards.
- A slice is overwritten only at the next step, after the step's sync (every member is done
  reading then). Counters as ``LocalTransport``'s: ``gather_bytes``, ``gathers`` and the bytes per
  source rank in ``group_bytes``.

The protocol runs on CPU through the IPC fabric (threads, ``device="cpu"``); NOT YET RUN ON GPU
HARDWARE.
"""

from __future__ import annotations

import torch

from odcfn.sharding import Layout
from odcfn.transport.base import Done, Handle, TransportError
from odcfn.transport.gpu._protocol import pack_stamp, unpack_stamp

__all__ = ["ArenaSecondary"]


class ArenaSecondary:
    """The hpZ half of ``ArenaTransport`` (a mixin: it uses the transport's arena, signals,
    waits and counters; ``_hpz_k``, ``_sec_built`` and ``group_bytes`` are set in its init)."""

    def reserve_secondary(self, group: int) -> None:
        """Lay out room for k = ``group`` hpZ slices from the next ``begin_step`` on (every rank
        of the shard group alike: the arena is re-laid collectively)."""
        self.mesh.secondary_group(group)  # ValueError naming reshard_after_forward unless k divides
        self._hpz_k = group

    def _secondary_sizes(self, layout: Layout) -> tuple[int, ...]:
        k = self._hpz_k
        return tuple(u.padded_numel // k for u in layout.units) if k else ()

    def _slice_of(self, unit: str, t: torch.Tensor, group: int, what: str) -> tuple[int, int]:
        """(unit index, slice elements) after checking the reservation and ``t``."""
        al = self.arena_layout
        if al is None or self.layout is None:
            raise TransportError("begin_step must come before any communication")
        if group != self._hpz_k or not al.secondary:
            raise TransportError(
                f"rank {self.mesh.rank}: {what}(group={group}) but the arena holds "
                f"{f'k={self._hpz_k} slices' if al.secondary else 'no hpZ slices'}: call "
                f"reserve_secondary({group}) on every rank before begin_step"
            )
        i = self._unit_index[unit]
        n = al.secondary[i]
        if t.dtype != self.dtype or t.numel() != n * group:
            raise TypeError(
                f"{what}({unit!r}): expects the unit's gathered copy ({n * group} elements of "
                f"{self.dtype}), got {t.numel()} of {t.dtype}"
            )
        return i, n

    def publish_secondary(self, unit: str, full: torch.Tensor, group: int) -> None:
        i, n = self._slice_of(unit, full, group, "publish_secondary")
        if self._sec_built.get(unit) == self.step:  # built already this step: peers may be reading
            return
        members = self.mesh.secondary_group(group)
        j = members.index(self.mesh.rank)
        off = self.arena_layout.secondary_offsets[i]
        dst = self.fabric.arena[off : off + n * full.element_size()].view(self.dtype)
        self.fabric.cast_copy(dst, full.detach()[j * n : (j + 1) * n])
        self.fabric.fence()
        stamp = pack_stamp(self.step, group)
        for peer in members:  # signal_write orders the word after this thread's writes
            self.fabric.signal_write(peer, self.sig.secondary(i, self.me), stamp)
        self._sec_built[unit] = self.step

    def gather_group(self, unit: str, out: torch.Tensor, group: int) -> Handle:
        i, n = self._slice_of(unit, out, group, "gather_group")
        members = self.mesh.secondary_group(group)
        step = self.step % (1 << 31)  # as pack_stamp keeps it
        for peer in members:
            word = self.sig.secondary(i, self.group.index(peer))
            self._wait(
                lambda w=word: unpack_stamp(self.fabric.signal_read(w))[0] == step,
                f"rank {peer} to build its group shard of {unit!r} at step {self.step}",
            )
            k = unpack_stamp(self.fabric.signal_read(word))[1]
            if k != group:
                raise TransportError(
                    f"rank {self.mesh.rank}: gather_group({unit!r}) with reshard_after_forward={group}, "
                    f"but rank {peer} built its group shard for k={k} (ranks disagree on "
                    "ScheduleOptions.reshard_after_forward)"
                )
        dev = out if out.device == self.fabric.device else torch.empty(
            out.numel(), dtype=out.dtype, device=self.fabric.device)
        self.fabric.get(members, self.arena_layout.secondary_offsets[i], dev)
        if dev is not out:
            out.copy_(dev)
        self.counters.gathers += 1
        for peer in members:
            if peer != self.mesh.rank:
                self.counters.gather_bytes += n * out.element_size()
                self.group_bytes[peer] += n * out.element_size()
        return Done()
