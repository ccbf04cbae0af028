"""The ODC protocol over an *arena fabric*: what the CUDA-IPC and NVSHMEM transports share.

A fabric gives each rank an arena of bytes peers can reach and an int64 signal array peers
write (layouts in ``_gpu_protocol``). On top of it this module implements the transport
protocol of ``kernels/base.py`` with the same semantics as ``LocalTransport``:

- ``begin_step``: zero the accumulators, *then* publish shards, fence, then write the new
  version into every shard-group peer's VERSION word (so no push can land before the zeroing);
- ``gather``: wait until every owner's VERSION word reached this step, then pull one-sided;
- ``scatter_accumulate``: "remote_add" (atomic adds by the writer straight into the owners'
  accumulators; the owner does nothing) or "landing" (put into a per-client slot with a signal;
  the owner's drain thread adds it on a side stream and returns a credit);
- ``flush``: fence, tell every owner ``FIN = (step, last request id)``, wait until every client's
  FIN for this step arrived and (landing) everything up to its last id was drained;
- ``fetch_add``: an atomic add on the rendezvous store;
- ``publish_secondary`` / ``gather_group``: hierarchical shards (hpZ) in a reserved arena region,
  stamped in signal words (``_hpz``).

The collective half (``sync``, the FSDP baseline, the hybrid replica reduce) is
``base.StepCollectives`` over the ``Collectives`` the transport is given (``TorchCollectives``
across processes, ``LocalCollectives`` between threads).
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from odcfn.sharding import Layout, Mesh
from odcfn.transport.base import (
    MAX_COUNTERS,
    Collectives,
    Counters,
    Done,
    Handle,
    StepCollectives,
    TransportError,
    check_counter,
)
from odcfn.transport.gpu._fabric import Fabric
from odcfn.transport.gpu._hpz import ArenaSecondary
from odcfn.transport.gpu._protocol import (
    HEADER_BYTES,
    STEP_BITS,
    ArenaLayout,
    SeqIds,
    SignalLayout,
    SlotReceiver,
    SlotSender,
    pack_fin,
    unpack_fin,
)

__all__ = ["ArenaTransport", "Fabric", "MODES"]

MODES = ("landing", "remote_add")


class ArenaTransport(ArenaSecondary, StepCollectives):
    max_counters = MAX_COUNTERS

    def __init__(
        self,
        mesh: Mesh,
        fabric: Fabric,
        store: Any,
        collectives: Collectives,
        *,
        mode: str = "landing",
        slots: int = 4,
        slot_elems: int = 1 << 20,
        timeout: float = 300.0,
        poll_s: float = 50e-6,
        prefix: str = "odcfn",
        id_bits: int = 32,
        host_grads: bool = False,
        own_collectives: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mesh, self.fabric, self.store, self.collectives = mesh, fabric, store, collectives
        self.mode, self.slots, self.slot_elems = mode, slots, slot_elems
        self.timeout, self.poll_s = timeout, poll_s
        # Store keys of this transport: ranks create their transports in the same order, so the
        # per-rank instance count agrees across ranks and two transports never share keys.
        instance = int(store.add(f"{prefix}/instances/{mesh.rank}", 1))
        self.prefix = f"{prefix}/{instance}"
        # host_grads: grad_shards() are CPU copies taken at flush (for a CPU-side optimizer /
        # the current CPU runtime); else the device accumulators themselves
        self.host_grads = host_grads
        self._own_collectives = own_collectives  # made for this transport: closed with it
        self._host: dict[str, torch.Tensor] = {}
        self.counters = Counters()
        self.ids = SeqIds(id_bits)  # 32 in production; tests shrink it to force wraps
        self.group = mesh.shard_group
        self.me = mesh.shard_index
        self.sig = SignalLayout(len(self.group), slots)
        self.step = 0
        self._touched: set[int] = set()  # counters this rank used this step (their keys go next step)
        self.layout: Layout | None = None
        self.arena_layout: ArenaLayout | None = None
        self.generation = 0
        self.senders = [SlotSender(slots, self.ids) for _ in self.group]
        self.receivers = [SlotReceiver(slots, self.ids) for _ in self.group]
        self._seen = [0] * len(self.group)  # highest VERSION seen per owner (cache)
        self._acc_lock = threading.Lock()  # the drain thread and self-pushes share acc
        self._drain: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._unit_index: dict[str, int] = {}
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.dtype: torch.dtype | None = None
        # gathered bytes by source rank: primary shards, and hpZ group shards (gather_group)
        self.peer_bytes: Counter[int] = Counter()
        self.group_bytes: Counter[int] = Counter()
        self._hpz_k, self._sec_built = 0, {}  # reserve_secondary's k; unit -> step its slice was built

    # --- setup ------------------------------------------------------------------------------
    def _ensure_arena(self, layout: Layout, dtype: torch.dtype) -> None:
        sizes = tuple(u.shard_size for u in layout.units)
        frozen = tuple(u.frozen for u in layout.units)
        isz = torch.empty((), dtype=dtype).element_size()
        sec = self._secondary_sizes(layout)  # hpZ slices, once reserved (_hpz)
        al = self.arena_layout
        if al is not None and (al.shard_sizes, al.frozen, al.secondary) == (sizes, frozen, sec) \
                and self.dtype == dtype:
            return
        self._stop_drain()
        self.generation += 1
        al = ArenaLayout.build(sizes, isz, isz, len(self.group), self.slots, self.slot_elems, frozen, sec)
        self.sig = SignalLayout(len(self.group), self.slots, len(sec))
        self._sec_built = {}
        self.fabric.setup(al.nbytes, self.sig.words, f"{self.prefix}/arena/{self.generation}")
        self.arena_layout, self.dtype = al, dtype
        self._unit_index = {u.name: i for i, u in enumerate(layout.units)}
        self._views = {}
        a = self.fabric.arena
        for i, u in enumerate(layout.units):
            p = a[al.param_offsets[i] : al.param_offsets[i] + u.shard_size * isz].view(dtype)
            o = al.acc_offsets[i]
            g = None if o is None else a[o : o + u.shard_size * 4].view(torch.float32)
            self._views[u.name] = (p, g)
        self.senders = [SlotSender(self.slots, self.ids) for _ in self.group]
        self.receivers = [SlotReceiver(self.slots, self.ids) for _ in self.group]
        self._seen = [0] * len(self.group)

    # --- per step ---------------------------------------------------------------------------
    def begin_step(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], compute_dtype: torch.dtype
    ) -> None:
        self._raise_if_failed()
        self._ensure_arena(layout, compute_dtype)
        self.layout = layout
        # every rank has passed the last step's sync, after its last fetch_add of that step:
        # drop the store keys this rank touched then, or they pile up (N + 4W per step)
        for counter in self._touched:
            self.store.delete_key(self._counter_key(self.step, counter))
        self._touched.clear()
        self.step += 1
        al = self.arena_layout
        self.fabric.arena[al.params_end : al.acc_end].zero_()  # accumulators first ...
        for u in layout.units:
            pub, _ = self._views[u.name]
            self.fabric.cast_copy(pub, shards[u.name].detach())  # ... then the new shards
        self.fabric.fence()
        for peer in self.group:  # ... then the version, visible only after both
            self.fabric.signal_write(peer, self.sig.version(self.me), self.step)
        if self.mode == "landing" and len(self.group) > 1 and self._drain is None:
            self._stop.clear()
            self._drain = threading.Thread(
                target=self._drain_loop, name=f"odcfn-drain-{self.mesh.rank}", daemon=True
            )
            self._drain.start()
            # a drain thread still inside a torch op while the interpreter exits aborts it
            # ("terminate called without an active exception"): stop it first if close() was not
            me = weakref.ref(self)
            atexit.register(lambda: (t := me()) is not None and t._stop_drain())

    def _wait(self, pred, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        nap = self.poll_s
        while not pred():
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TransportError(
                    f"rank {self.mesh.rank}: timed out after {self.timeout}s waiting for {what}"
                )
            time.sleep(nap)  # sleeping, not spinning: a polling thread holding the GIL stalls compute
            nap = min(2 * nap, 1e-3)

    def _wait_version(self, i: int) -> None:
        if self._seen[i] >= self.step:
            return

        def ok() -> bool:
            self._seen[i] = self.fabric.signal_read(self.sig.version(i))
            return self._seen[i] >= self.step

        self._wait(ok, f"rank {self.group[i]} to publish step {self.step}")

    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        i_u = self._unit_index[unit]
        size = self.layout[unit].shard_size
        for i in range(len(self.group)):
            self._wait_version(i)
        dev = (
            out
            if out.device == self.fabric.device
            else torch.empty(out.numel(), dtype=out.dtype, device=self.fabric.device)
        )
        self.fabric.get(self.group, self.arena_layout.param_offsets[i_u], dev)
        if dev is not out:
            out.copy_(dev)
        self.counters.gathers += 1
        self.counters.gather_bytes += (len(self.group) - 1) * size * out.element_size()
        for owner in self.group:
            if owner != self.mesh.rank:
                self.peer_bytes[owner] += size * out.element_size()
        return Done()

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        i_u = self._unit_index[unit]
        if self.arena_layout.acc_offsets[i_u] is None:
            raise ValueError(f"unit {unit!r} is frozen: it has no accumulator to scatter into")
        size = self.layout[unit].shard_size
        for i in range(len(self.group)):  # never push into an owner before it zeroed (cached)
            self._wait_version(i)
        grad = grad.to(self.fabric.device, self.dtype).contiguous()
        if self.mode == "remote_add":
            self.fabric.scatter_add(self.group, self.arena_layout.acc_offsets[i_u], grad)
        else:
            for i, owner in enumerate(self.group):
                piece = grad[i * size : (i + 1) * size]
                if i == self.me:
                    self._accumulate(self._views[unit][1], piece)
                    continue
                for lo, n in self.arena_layout.chunks(size):
                    self._push(i, owner, i_u, lo, piece[lo : lo + n])
        self.counters.scatters += 1
        self.counters.scatter_bytes += (len(self.group) - 1) * size * grad.element_size()
        return Done()

    def _push(self, i: int, owner: int, unit: int, lo: int, data: torch.Tensor) -> None:
        snd = self.senders[i]
        if not snd.can_send():
            self._wait(
                lambda: snd.on_credit(self.fabric.signal_read(self.sig.credit(i))) or snd.can_send(),
                f"credit from rank {owner}",
            )
        rid, slot = snd.next()
        header = torch.tensor([unit, lo, data.numel(), rid], dtype=torch.int64)
        off = self.arena_layout.landing_offset(self.me, slot)
        parts = [(off, header), (off + HEADER_BYTES, data)]
        self.fabric.put_signal(owner, parts, self.sig.slot(self.me, slot), rid)

    def _accumulate(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        # Self-pushes (main stream) and the drain thread (side stream) add into the same
        # accumulators: each add completes before the lock is released, so the two streams
        # never read-modify-write one region at once, and "drained" implies "landed".
        with self._acc_lock:
            self.fabric.accumulate(acc, x)
            self.fabric.fence()

    def _drain_once(self) -> bool:
        al, progressed = self.arena_layout, False
        for c, client in enumerate(self.group):
            if c == self.me:
                continue
            rcv = self.receivers[c]
            rid, slot = rcv.expected()
            if not rcv.ready(self.fabric.signal_read(self.sig.slot(c, slot))):
                continue
            base = al.landing_offset(c, slot)
            hdr = self.fabric.arena[base : base + 32].view(torch.int64).tolist()
            unit, lo, n, hrid = hdr
            if hrid % self.ids.modulus != rid:
                raise TransportError(
                    f"rank {self.mesh.rank}: slot ({c},{slot}) header id {hrid} != signal id {rid}"
                )
            name = self.layout.units[unit].name
            x = self.fabric.arena[base + HEADER_BYTES : base + HEADER_BYTES + n * al.grad_itemsize].view(
                self.dtype
            )
            self._accumulate(self._views[name][1][lo : lo + n], x)
            rcv.consume()
            self.fabric.signal_write(client, self.sig.credit(self.me), rid)
            progressed = True
        return progressed

    def _drain_loop(self) -> None:
        side = self.fabric.side_stream
        ctx = torch.cuda.stream(side) if side is not None else contextlib.nullcontext()
        try:
            with ctx:
                nap = self.poll_s
                while not self._stop.is_set():
                    if self._drain_once():
                        nap = self.poll_s
                    else:  # back off while idle (between steps), stay quick while pushes flow
                        time.sleep(nap)
                        nap = min(2 * nap, 2e-3)
        except BaseException as e:  # noqa: BLE001 - surfaced by the next wait on the main thread
            self._error = e

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TransportError(
                f"rank {self.mesh.rank}: drain thread failed: {self._error!r}"
            ) from self._error

    def _stop_drain(self) -> None:
        if self._drain is not None:
            self._stop.set()
            self._drain.join(timeout=10)
            self._drain = None

    def flush(self) -> None:
        self.fabric.fence()
        for i, owner in enumerate(self.group):
            self.fabric.signal_write(
                owner, self.sig.fin(self.me), pack_fin(self.step, self.senders[i].issued, self.ids)
            )
        step = self.step % (1 << STEP_BITS)

        def done(c: int) -> bool:
            st, last = unpack_fin(self.fabric.signal_read(self.sig.fin(c)), self.ids)
            return st == step and (
                self.mode == "remote_add" or c == self.me or self.receivers[c].caught_up(last)
            )

        for c in range(len(self.group)):
            self._wait(
                lambda c=c: done(c), f"rank {self.group[c]} to finish pushing into rank {self.mesh.rank}"
            )
        if self.host_grads:
            self._host = {name: acc.cpu() for name, (_, acc) in self._views.items() if acc is not None}

    # --- the collective half: base.StepCollectives over these buffers (and _accumulate) -------
    def _published(self, unit: str) -> torch.Tensor:
        return self._views[unit][0]

    def _accumulator(self, unit: str) -> torch.Tensor:
        acc = self._views[unit][1]
        if acc is None:
            raise ValueError(f"unit {unit!r} is frozen: it has no accumulator")
        return acc

    def grad_shards(self) -> dict[str, torch.Tensor]:
        if self.host_grads:
            return self._host
        return {name: acc for name, (_, acc) in self._views.items() if acc is not None}

    def _counter_key(self, step: int, counter: int) -> str:
        return f"{self.prefix}/c/{step}/{counter}"

    def fetch_add(self, counter: int, n: int = 1) -> int:
        check_counter(counter, self.max_counters, "ArenaTransport")
        # store.add returns the value after the add; a missing key counts as 0 (fresh each step)
        self._touched.add(counter)
        return int(self.store.add(self._counter_key(self.step, counter), n)) - n

    def close(self) -> None:
        self._stop_drain()
        self.fabric.close()
        if self._own_collectives:
            self._own_collectives = False
            self.collectives.close()
