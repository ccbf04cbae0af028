"""The GPU transports' protocol pieces as pure functions: request ids across the wrap, the
slot ring, the FIN word, arena and signal layouts, and their errors."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odcfn.transport.gpu._protocol import (
    ALIGN,
    HEADER_BYTES,
    ArenaLayout,
    SeqIds,
    SignalLayout,
    SlotReceiver,
    SlotSender,
    pack_fin,
    pack_stamp,
    unpack_fin,
    unpack_stamp,
)

# --- request ids ------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(bits=st.integers(3, 64), a=st.integers(0, 2**64), n=st.integers(-(2**20), 2**20))
def test_seq_ids_distance_inverts_add_across_the_wrap(bits, a, n):
    ids = SeqIds(bits)
    a %= ids.modulus
    n = max(-(ids.modulus // 2), min(n, ids.modulus // 2 - 1))
    b = ids.add(a, n)
    assert 0 <= b < ids.modulus
    assert ids.diff(b, a) == n  # exact within half the ring, wherever the wrap falls


def test_slot_sequence_is_continuous_across_the_wrap_only_for_powers_of_two():
    ids = SeqIds(4)  # ids 0..15
    seq = [ids.add(14, k) for k in range(6)]  # 14 15 0 1 2 3
    assert [ids.slot(r, 4) for r in seq] == [2, 3, 0, 1, 2, 3]  # round robin never skips
    # with 3 slots the ring would jump (15 % 3 = 0, then 0 % 3 = 0: one slot used twice in a
    # row while another is skipped): rejected up front
    assert [r % 3 for r in seq][1:3] == [0, 0]
    with pytest.raises(ValueError, match="power of two"):
        ids.slot(0, 3)


def test_fin_word_carries_step_and_id_and_never_matches_an_old_step():
    ids = SeqIds()
    w = pack_fin(7, 2**32 - 1, ids)
    assert unpack_fin(w, ids) == (7, 2**32 - 1)
    assert 0 <= w < 2**63  # fits a non-negative int64 signal word
    assert unpack_fin(pack_fin(8, 0, ids), ids) != unpack_fin(pack_fin(7, 0, ids), ids)
    assert unpack_fin(pack_fin(2**31 + 3, 5, ids), ids) == (3, 5)  # steps wrap by design too


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), slots=st.sampled_from([1, 2, 4]), bits=st.integers(1, 3))
def test_slot_ring_delivers_every_request_once_in_order_through_many_wraps(seed, slots, bits):
    """A random interleaving of sends, drains and *delayed* credit reads (the sender sees some
    credit the owner wrote earlier, never one older than it already saw: single writer,
    coherent memory): every request arrives exactly once, in order, no slot is overwritten
    before it was drained, and the window never exceeds ``slots``."""
    ids = SeqIds(bits + slots.bit_length())  # the smallest rings that keep slots < 2^(bits-1)
    snd, rcv = SlotSender(slots, ids), SlotReceiver(slots, ids)
    rng = random.Random(seed)
    ring: dict[int, tuple[int, int]] = {}  # slot -> (signal word, payload)
    credits, seen, sent, got = [0], 0, 0, []  # every value the credit word took, in order
    total = 5 * ids.modulus  # wraps five times
    while len(got) < total:
        if sent < total and rng.random() < 0.6:
            seen = rng.randint(seen, len(credits) - 1)  # a possibly delayed, monotone read
            snd.on_credit(credits[seen])
            if snd.can_send():
                rid, slot = snd.next()
                assert slot not in ring, "overwrote an undrained slot"
                assert 0 < snd.in_flight() <= slots
                ring[slot] = (rid, sent)
                sent += 1
        else:
            rid, slot = rcv.expected()
            if slot in ring and rcv.ready(ring[slot][0]):
                got.append(ring.pop(slot)[1])
                credits.append(rcv.consume())
    assert got == list(range(total))
    assert rcv.caught_up(snd.issued)


def test_window_must_stay_below_half_the_id_ring():
    SlotSender(2, SeqIds(3))
    with pytest.raises(ValueError, match="4 slots need ids of more than 3 bits"):
        SlotSender(4, SeqIds(3))
    with pytest.raises(ValueError, match="power of two"):
        SlotReceiver(3, SeqIds(8))


def test_sender_rejects_a_credit_for_ids_never_sent():
    snd = SlotSender(4)
    snd.next()
    with pytest.raises(ValueError, match="only 1 were sent"):
        snd.on_credit(3)


# --- layouts ----------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=5),
    isz=st.sampled_from([2, 4]),
    clients=st.integers(1, 8),
    slots=st.sampled_from([1, 2, 4, 8]),
    slot_elems=st.integers(1, 3000),
    frozen_bits=st.integers(0, 31),
    hpz=st.sampled_from([0, 1, 2, 3]),
)
def test_arena_regions_are_aligned_disjoint_and_inside_the_arena(
    sizes, isz, clients, slots, slot_elems, frozen_bits, hpz
):
    frozen = [bool(frozen_bits >> i & 1) for i in range(len(sizes))]
    sec = [max(1, s * clients // hpz) for s in sizes] if hpz else []  # hpZ slices, reserved
    al = ArenaLayout.build(sizes, isz, isz, clients, slots, slot_elems, frozen, sec)
    regions = sorted(al.regions(), key=lambda r: r[1])
    assert len(regions) == 2 * len(sizes) - sum(frozen) + clients * slots + len(sec)
    assert [hi - lo for name, lo, hi in al.regions() if name.startswith("sec")] == [n * isz for n in sec]
    if not hpz:  # no reservation: the arena is the one it was before hpZ existed
        assert al.nbytes == al.acc_end + clients * slots * al.slot_bytes
    for (_, _, hi), (_, lo2, _) in zip(regions, regions[1:]):
        assert hi <= lo2  # disjoint
    for name, lo, hi in regions:
        assert lo % ALIGN == 0, name
        assert 0 <= lo < hi <= al.nbytes, name
    for c in range(clients):
        for k in range(slots):
            assert (al.landing_offset(c, k) + HEADER_BYTES) % 16 == 0  # data is vector aligned
    for s in sizes:  # chunks tile every shard exactly and each fits a slot
        ch = al.chunks(s)
        assert sum(n for _, n in ch) == s and all(n <= al.slot_elems for _, n in ch)
        assert [lo for lo, _ in ch] == [sum(n for _, n in ch[:i]) for i in range(len(ch))]


def test_frozen_units_get_no_accumulator_in_the_arena():
    """A frozen unit (LoRA base) is gather-only on every path: the arena reserves (and
    ``begin_step`` zeroes) fp32 accumulator bytes for trained units only."""
    sizes = [1000, 3000, 500, 2000]
    full = ArenaLayout.build(sizes, 2, 2, 2, 2, 256)
    lora = ArenaLayout.build(sizes, 2, 2, 2, 2, 256, frozen=[True, True, False, True])
    assert lora.acc_offsets[0] is None and lora.acc_offsets[1] is None and lora.acc_offsets[3] is None
    assert lora.acc_offsets[2] == lora.params_end  # the only accumulator, right after the params
    assert lora.acc_end - lora.params_end == -(-500 * 4 // ALIGN) * ALIGN
    assert full.nbytes - lora.nbytes == sum(-(-s * 4 // ALIGN) * ALIGN for s in (1000, 3000, 2000))
    assert [n for n, _, _ in lora.regions() if n.startswith("acc")] == ["acc[2]"]
    all_frozen = ArenaLayout.build(sizes, 2, 2, 2, 2, 256, frozen=[True] * 4)
    assert all_frozen.acc_end == all_frozen.params_end
    with pytest.raises(ValueError, match="3 frozen flags for 4 units"):
        ArenaLayout.build(sizes, 2, 2, 2, frozen=[True] * 3)


@pytest.mark.parametrize("units", [0, 2])
def test_signal_words_are_distinct_and_in_range(units):
    sl = SignalLayout(clients=3, slots=4, units=units)
    idx = [sl.version(i) for i in range(3)] + [sl.fin(i) for i in range(3)] + [sl.credit(i) for i in range(3)]
    idx += [sl.slot(c, k) for c in range(3) for k in range(4)]
    idx += [sl.secondary(u, m) for u in range(units) for m in range(3)]  # hpZ stamps
    assert sorted(idx) == list(range(sl.words))
    with pytest.raises(IndexError, match="hpZ stamp"):
        sl.secondary(units, 0)


def test_hpz_stamp_tells_not_yet_from_another_k():
    for step, k in [(1, 2), (5, 8), ((1 << 31) + 3, 4)]:
        assert unpack_stamp(pack_stamp(step, k)) == (step % (1 << 31), k)
    assert pack_stamp(2, 2) != pack_stamp(1, 2) and pack_stamp(1, 4) != pack_stamp(1, 2)
    assert unpack_stamp(0)[0] == 0  # a fresh signal word: built at no step


def test_layout_errors_name_the_culprit():
    with pytest.raises(ValueError, match="shard sizes must be positive"):
        ArenaLayout.build([3, 0], 4, 4, 2)
    with pytest.raises(ValueError, match="power of two"):
        ArenaLayout.build([3], 4, 4, 2, slots=6)
    with pytest.raises(IndexError, match="landing slot"):
        ArenaLayout.build([3], 4, 4, 2, slots=2).landing_offset(2, 0)


# --- devices: which GPU is which under per-rank CUDA_VISIBLE_DEVICES ---------------------------

GPUS = ["uuid:GPU-A", "uuid:GPU-B", "uuid:GPU-C", "uuid:GPU-D"]
P2P = {frozenset(p) for p in [("uuid:GPU-A", "uuid:GPU-B"), ("uuid:GPU-C", "uuid:GPU-D")]}  # NVLink pairs


def _setups() -> dict[str, list[tuple[list[str], int]]]:
    """Per scenario, per rank: (this process's visible GPUs in local index order, compute index)."""
    return {
        "all visible, cuda:rank": [(GPUS, r) for r in range(4)],
        "per-rank CUDA_VISIBLE_DEVICES": [([g], 0) for g in GPUS],
        "reversed order": [(GPUS[::-1], 3 - r) for r in range(4)],
        "two ranks per GPU": [([GPUS[r // 2]], 0) for r in range(4)],
        "pairs visible": [(GPUS[r // 2 * 2 : r // 2 * 2 + 2], r % 2) for r in range(4)],
    }


@pytest.mark.parametrize("scenario", sorted(_setups()))
def test_peer_handles_open_on_the_compute_device_in_every_index_space(scenario):
    from odcfn.transport.gpu._devices import open_device_for_peer

    ranks = _setups()[scenario]
    for me, (visible, compute) in enumerate(ranks):
        mine = visible[compute]
        for peer, (pvis, pcompute) in enumerate(ranks):
            if peer == me:
                continue
            peer_gpu = pvis[pcompute]  # what the peer records: its GPU's UUID, not its index
            asked: list[tuple[str, str]] = []

            def can_access(a, b, visible=visible, asked=asked):
                asked.append((visible[a], visible[b]))
                return frozenset((visible[a], visible[b])) in P2P

            reachable = peer_gpu == mine or frozenset((mine, peer_gpu)) in P2P
            if peer_gpu in visible and not reachable:
                with pytest.raises(Exception, match="cannot access the peer's GPU"):
                    open_device_for_peer(peer_gpu, compute, visible, can_access)
                continue
            assert open_device_for_peer(peer_gpu, compute, visible, can_access) == compute
            # the P2P query, when one is possible, is about the two PHYSICAL GPUs involved
            if peer_gpu != mine and peer_gpu in visible:
                assert asked == [(mine, peer_gpu)]
            else:
                assert asked == []


def test_open_cuda_maps_a_peer_handle_on_the_compute_device(monkeypatch):
    """Through ``_open_cuda`` with CUDA mocked: rank 1 of 'all visible' computes on cuda:1 and
    opens rank 0's handle (recorded as device 0) under cuda:1, not cuda:0; a refusal from CUDA
    for a GPU outside CUDA_VISIBLE_DEVICES becomes a TransportError that says so."""
    from types import SimpleNamespace

    import torch
    from torch.multiprocessing import reductions

    from odcfn.transport.base import TransportError
    from odcfn.transport.gpu import cuda_ipc
    from odcfn.transport.rdzv import b64

    visible = list(GPUS)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(visible))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=visible[i].split(":", 1)[1])
    )
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} in ({0, 1}, {2, 3}))
    opened: list[int] = []

    def rebuild(*args):
        opened.append(args[6])  # storage_device
        return torch.zeros(args[1], dtype=torch.uint8)

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    rec = {"device": 0, "device_id": GPUS[0], "handle": b64(b"h"), "size": 4096, "offset": 0,
           "rc_handle": b64(b"r"), "rc_offset": 0, "ev_handle": b64(b"e"), "ev_sync": False}  # fmt: skip
    cuda_ipc._open_cuda(rec, 1024, torch.device("cuda", 1))
    assert opened == [1]
    with pytest.raises(TransportError, match="cannot access the peer's GPU cuda:0"):
        cuda_ipc._open_cuda(rec, 1024, torch.device("cuda", 2))  # A and C: no P2P
    visible[:] = [GPUS[1]]  # per-rank CUDA_VISIBLE_DEVICES: A is invisible, B is cuda:0

    def refuse(*args):
        raise RuntimeError("CUDA error: peer access is not supported between these two devices")

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", refuse)
    with pytest.raises(TransportError, match="not visible in this process"):
        cuda_ipc._open_cuda(rec, 1024, torch.device("cuda", 0))
    with pytest.raises(TransportError, match="malformed"):
        cuda_ipc._open_cuda({k: v for k, v in rec.items() if k != "device_id"}, 1024, torch.device("cuda", 0))


def test_pointer_tables_refuse_misaligned_peer_bases():
    from odcfn.transport.base import TransportError
    from odcfn.transport.gpu._devices import check_aligned

    check_aligned([0x7F0000000000, 0x7F0000000100], (0, 1))
    with pytest.raises(TransportError, match=r"not 16-byte aligned: \[\(1, '0x7f0000000108'\)\]"):
        check_aligned([0x7F0000000000, 0x7F0000000108], (0, 1))
