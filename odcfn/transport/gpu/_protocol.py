"""The data layout and signal protocol shared by the GPU transports; pure, CPU-testable.

Every rank owns one *arena* (device bytes peers can reach: CUDA-IPC mapping or NVSHMEM
symmetric heap) and one *signal array* (int64 words peers write). Every rank computes the same
``ArenaLayout`` from the same inputs, so an offset means the same thing in every arena.

Arena (byte offsets, each region 256-byte aligned so every kernel sees 16-byte aligned bases):
  params[u]   this rank's shard of unit u in the compute dtype   (peers *read*: gather)
  acc[u]      this rank's fp32 gradient accumulator of unit u     (peers add: remote-add mode);
              none for a frozen unit (gather-only, e.g. a LoRA base: never scattered into)
  landing[c][s]  slot s of client c: a 256-byte header (unit, element offset, count, request
              id as int64) then ``slot_elems`` grad elements   (peers *write*: landing mode)
  sec[u]      hpZ (``reshard_after_forward=k``): this rank's slice of unit u's k-rank group copy,
              compute dtype (the peers of its group *read*: ``gather_group``); only when reserved

Signals (int64 words, each written by exactly ONE peer, so no remote read-modify-write):
  VERSION[o]  owner o's published step (o writes it into every shard-group peer)
  FIN[c]      client c is done pushing to me this step: ``pack_fin(step, last request id)``
  SLOT[c][s]  request id that filled landing[c][s]   (written by c after header and data)
  CREDIT[o]   highest request id owner o has drained from my pushes (o writes it into me)
  SEC[u][m]   hpZ: ``pack_stamp(step, k)`` of member m's slice of unit u (m writes it into every
              member of its group after the slice's bytes)

Request ids are per (client, owner) pair, start at 1 and live in Z/2^32 on BOTH sides
(``SeqIds``): a receiver waits for ``SLOT == expected`` exactly (equality is wrap-safe), the
slot of id k is ``k % slots`` with ``slots`` a power of two (so the slot sequence never jumps
at the wrap), and in-flight windows compare by modular distance, never by ``>=``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "HEADER_WORDS",
    "ArenaLayout",
    "STEP_BITS",
    "SeqIds",
    "SignalLayout",
    "SlotReceiver",
    "SlotSender",
    "pack_fin",
    "pack_stamp",
    "unpack_fin",
    "unpack_stamp",
]

ALIGN = 256
HEADER_BYTES = ALIGN  # header words first, data stays ALIGN-aligned
HEADER_WORDS = 4  # unit index, element offset, element count, request id
ID_BITS = 32
STEP_BITS = 31  # pack_fin keeps the word a non-negative int64: 31 + 32 bits


@dataclass(frozen=True)
class SeqIds:
    """Serial-number arithmetic in Z/2^bits (RFC 1982 style)."""

    bits: int = ID_BITS

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    def add(self, a: int, n: int = 1) -> int:
        return (a + n) % self.modulus

    def diff(self, a: int, b: int) -> int:
        """Signed distance a - b, in [-2^(bits-1), 2^(bits-1))."""
        d = (a - b) % self.modulus
        return d - self.modulus if d >= self.modulus // 2 else d

    def slot(self, rid: int, slots: int) -> int:
        if slots < 1 or slots & (slots - 1) or slots > self.modulus:
            raise ValueError(f"slots must be a power of two <= 2^{self.bits}, got {slots}")
        return rid % slots


def pack_fin(step: int, last_id: int, ids: SeqIds = SeqIds()) -> int:
    """One signal word: (step mod 2^31) << 32 | last request id. A FIN of an earlier step can
    then never be mistaken for this step's, even when a client sent nothing this step."""
    return ((step % (1 << STEP_BITS)) << ids.bits) | (last_id % ids.modulus)


def unpack_fin(word: int, ids: SeqIds = SeqIds()) -> tuple[int, int]:
    return word >> ids.bits, word % ids.modulus


def pack_stamp(step: int, k: int) -> int:
    """An hpZ slice's signal word: the step it was built for (mod 2^31, as ``pack_fin``) and the
    group size k it was cut for, so a reader can tell "not yet" from "built for another k"."""
    return pack_fin(step, k)


def unpack_stamp(word: int) -> tuple[int, int]:
    return unpack_fin(word)


def _up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class ArenaLayout:
    """Byte offsets of every region of a rank's arena (identical on every rank)."""

    shard_sizes: tuple[int, ...]  # per unit, elements
    param_itemsize: int  # compute dtype
    grad_itemsize: int  # dtype of the pushed gradient slices
    clients: int  # shard-group size: how many peers may push into this rank
    slots: int  # landing slots per client (power of two)
    slot_elems: int  # elements per landing slot
    frozen: tuple[bool, ...] = ()  # per unit (empty: none); a frozen unit has no accumulator
    secondary: tuple[int, ...] = ()  # per unit, elements of its hpZ slice (empty: no hpZ region)

    @classmethod
    def build(
        cls,
        shard_sizes: Sequence[int],
        param_itemsize: int,
        grad_itemsize: int,
        clients: int,
        slots: int = 4,
        slot_elems: int = 1 << 20,
        frozen: Sequence[bool] | None = None,
        secondary: Sequence[int] = (),
    ) -> ArenaLayout:
        if not shard_sizes or any(int(s) < 1 for s in shard_sizes):
            raise ValueError(f"ArenaLayout: shard sizes must be positive, got {list(shard_sizes)}")
        if clients < 1:
            raise ValueError(f"ArenaLayout: clients must be >= 1, got {clients}")
        SeqIds().slot(0, slots)  # validates power of two
        if slot_elems < 1:
            raise ValueError(f"ArenaLayout: slot_elems must be >= 1, got {slot_elems}")
        fz = tuple(bool(f) for f in frozen) if frozen is not None else (False,) * len(shard_sizes)
        if len(fz) != len(shard_sizes):
            raise ValueError(f"ArenaLayout: {len(fz)} frozen flags for {len(shard_sizes)} units")
        if secondary and (len(secondary) != len(shard_sizes) or any(int(n) < 1 for n in secondary)):
            raise ValueError(f"ArenaLayout: secondary slices {list(secondary)} for {len(shard_sizes)} units")
        # a slot never needs to be larger than the largest shard
        slot_elems = min(slot_elems, max(shard_sizes))
        return cls(
            tuple(int(s) for s in shard_sizes), param_itemsize, grad_itemsize, clients, slots, slot_elems, fz,
            tuple(int(n) for n in secondary),
        )

    def is_frozen(self, unit: int) -> bool:
        return bool(self.frozen) and self.frozen[unit]

    @functools.cached_property  # computed once: the engine asks per chunk
    def param_offsets(self) -> tuple[int, ...]:
        offs, at = [], 0
        for s in self.shard_sizes:
            offs.append(at)
            at += _up(s * self.param_itemsize)
        return tuple(offs)

    @functools.cached_property
    def params_end(self) -> int:
        return self.param_offsets[-1] + _up(self.shard_sizes[-1] * self.param_itemsize)

    @functools.cached_property
    def _acc(self) -> tuple[tuple[int | None, ...], int]:
        # frozen units take no bytes: the CPU transports hold no accumulator for them either
        offs: list[int | None] = []
        at = self.params_end
        for u, s in enumerate(self.shard_sizes):
            if self.is_frozen(u):
                offs.append(None)
            else:
                offs.append(at)
                at += _up(s * 4)
        return tuple(offs), at

    @property
    def acc_offsets(self) -> tuple[int | None, ...]:
        """Byte offset of each unit's accumulator; None for a frozen unit."""
        return self._acc[0]

    @property
    def acc_end(self) -> int:
        return self._acc[1]

    @functools.cached_property
    def slot_bytes(self) -> int:
        return HEADER_BYTES + _up(self.slot_elems * self.grad_itemsize)

    def landing_offset(self, client: int, slot: int) -> int:
        if not (0 <= client < self.clients and 0 <= slot < self.slots):
            raise IndexError(f"landing slot ({client}, {slot}) outside {self.clients} x {self.slots}")
        return self.acc_end + (client * self.slots + slot) * self.slot_bytes

    @functools.cached_property
    def secondary_offsets(self) -> tuple[int, ...]:
        """Byte offset of each unit's hpZ slice (after the landing slots); empty: none."""
        offs, at = [], self.acc_end + self.clients * self.slots * self.slot_bytes
        for n in self.secondary:
            offs.append(at)
            at += _up(n * self.param_itemsize)
        return tuple(offs)

    @functools.cached_property
    def nbytes(self) -> int:
        end = self.acc_end + self.clients * self.slots * self.slot_bytes
        if self.secondary:
            end = self.secondary_offsets[-1] + _up(self.secondary[-1] * self.param_itemsize)
        return end

    def regions(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of every region, in address order (for checks and debugging)."""
        out = []
        for u, (o, s) in enumerate(zip(self.param_offsets, self.shard_sizes)):
            out.append((f"params[{u}]", o, o + s * self.param_itemsize))
        for u, (o, s) in enumerate(zip(self.acc_offsets, self.shard_sizes)):
            if o is not None:
                out.append((f"acc[{u}]", o, o + s * 4))
        for c in range(self.clients):
            for k in range(self.slots):
                o = self.landing_offset(c, k)
                out.append((f"landing[{c}][{k}]", o, o + HEADER_BYTES + self.slot_elems * self.grad_itemsize))
        for u, (o, n) in enumerate(zip(self.secondary_offsets, self.secondary)):
            out.append((f"sec[{u}]", o, o + n * self.param_itemsize))
        return out

    def chunks(self, count: int) -> list[tuple[int, int]]:
        """Split a push of ``count`` elements into (offset, length) pieces that fit a slot."""
        return [(lo, min(self.slot_elems, count - lo)) for lo in range(0, count, self.slot_elems)]


@dataclass(frozen=True)
class SignalLayout:
    """Word indices into a rank's int64 signal array (identical on every rank)."""

    clients: int
    slots: int
    units: int = 0  # hpZ stamp words per unit and member; 0: no hpZ region

    def version(self, owner_index: int) -> int:
        return owner_index

    def fin(self, client_index: int) -> int:
        return self.clients + client_index

    def slot(self, client_index: int, slot: int) -> int:
        return 2 * self.clients + client_index * self.slots + slot

    def credit(self, owner_index: int) -> int:
        return 2 * self.clients + self.clients * self.slots + owner_index

    def secondary(self, unit: int, member_index: int) -> int:
        """The stamp of shard-group member ``member_index``'s hpZ slice of ``unit``."""
        if not (0 <= unit < self.units and 0 <= member_index < self.clients):
            raise IndexError(f"hpZ stamp ({unit}, {member_index}) outside {self.units} x {self.clients}")
        return 3 * self.clients + self.clients * self.slots + unit * self.clients + member_index

    @property
    def words(self) -> int:
        return 3 * self.clients + self.clients * self.slots + self.units * self.clients


def _check_window(slots: int, ids: SeqIds) -> None:
    ids.slot(0, slots)  # power of two
    # in-flight distances must stay in the positive half of the ring, or a full window of
    # 2^(bits-1) reads as -2^(bits-1) (found by the ring property test with 3-bit ids)
    if slots >= ids.modulus // 2:
        raise ValueError(f"{slots} slots need ids of more than {ids.bits} bits (slots < 2^(bits-1))")


class SlotSender:
    """Client side of one (client -> owner) landing ring: which id and slot the next push uses,
    and whether the window of ``slots`` un-drained pushes is full."""

    def __init__(self, slots: int, ids: SeqIds = SeqIds()) -> None:
        _check_window(slots, ids)
        self.slots, self.ids = slots, ids
        self.issued = 0  # last id sent
        self.acked = 0  # last id the owner drained (from its CREDIT word)

    def in_flight(self) -> int:
        return self.ids.diff(self.issued, self.acked)

    def can_send(self) -> bool:
        return self.in_flight() < self.slots

    def on_credit(self, acked: int) -> None:
        # credits only move forward; a stale read (smaller, modulo wrap) is ignored
        if self.ids.diff(acked, self.acked) > 0:
            if self.ids.diff(acked, self.issued) > 0:
                raise ValueError(f"owner acknowledged id {acked}, but only {self.issued} were sent")
            self.acked = acked

    def next(self) -> tuple[int, int]:
        if not self.can_send():
            raise RuntimeError("SlotSender.next: window full; wait for credit first")
        self.issued = self.ids.add(self.issued)
        return self.issued, self.ids.slot(self.issued, self.slots)


class SlotReceiver:
    """Owner side of one ring: the exact id it expects next, and in which slot."""

    def __init__(self, slots: int, ids: SeqIds = SeqIds()) -> None:
        _check_window(slots, ids)
        self.slots, self.ids = slots, ids
        self.drained = 0

    def expected(self) -> tuple[int, int]:
        rid = self.ids.add(self.drained)
        return rid, self.ids.slot(rid, self.slots)

    def ready(self, slot_word: int) -> bool:
        return slot_word % self.ids.modulus == self.expected()[0]

    def consume(self) -> int:
        self.drained = self.ids.add(self.drained)
        return self.drained

    def caught_up(self, last_id: int) -> bool:
        return self.drained == last_id % self.ids.modulus
