"""Per-owner parameter versions for bounded staleness (τ >= 1), written once for every place.

The synchronous step (τ = 0) publishes one version per minibatch and meets once in ``sync``.
Here nothing is global:

- **Versions.** Owner ``o`` keeps its last ``R = τ_max + 1`` published versions in a ring
  (slot ``v % R``); version ``v`` is its shards after the updates of steps ``< v``.
- **Gathers.** The first gather of unit ``u`` in minibatch ``j`` pins a version: the newest
  version every owner of ``u`` has published, waiting only while that is ``< j - τ(u)``. Later
  gathers of ``u`` in ``j`` (the backward's re-gather, tied uses) read the same version, so a
  unit's forward and backward always see the same weights. What each gather read is recorded.
- **Pushes** of minibatch ``j`` go into the owners' accumulator slot ``j % R``, once the owner
  applied step ``j - R`` (the slot's previous tenant).
- **Completion.** After its last push of ``j`` a rank waits for the bound its gathers would have
  waited for (so a rank with no samples stays within τ too), deposits its stats and counts itself
  done at each owner. An owner whose step ``k`` every client completed applies it (the step
  layer's ``apply``: the optimizer), clears the slot and publishes ``k + 1``.

Why the ring is big enough: a reader in minibatch ``j`` pins ``v >= j - τ_max`` and an owner can
publish ``v + R`` only after step ``v + R - 1 >= j`` completed, which needs this reader's
``done(j)``, counted after its last gather. So no publish can overwrite a slot under a read.
Each slot also carries a **tag** (a seqlock): the version it holds, set to ``WRITING`` before a
publish writes the slot's data and to the new version after. A gather reads the tag before and
after its copy; a tag other than the pinned version on either side means the slot was (being)
rewritten under the copy, which the argument above rules out, so it raises ``TransportError``
rather than returning torn weights. (A seqlock reader would retry; here the pinned version is
gone once its slot is rewritten, so there is nothing to retry to.)

``VersionStore`` holds all of that. A place supplies the storage (its ``_hooks``): in-process
ranks share Python objects under a ``threading.Condition`` (``odcfn.transport.versions``),
processes share /dev/shm segments (``odcfn.transport.versions_shm``). Deterministic mode
(``ordered``) keeps one accumulator part per pushing rank, summed in rank order at apply
(``odcfn.transport.versions_det``); otherwise one part, added into in arrival order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from odcfn.sharding import Layout
from odcfn.transport.base import Done, Handle, TransportError, sum_squares
from odcfn.transport.versions_det import accumulate, rank_order_sum

__all__ = ["EMPTY", "WRITING", "Apply", "VersionStore", "bound", "rank_sum", "reuse_view"]

Apply = Callable[[int, dict[str, torch.Tensor], torch.Tensor], Mapping[str, torch.Tensor]]
WRITING = -1  # a slot's tag while a publish writes it
EMPTY = -2  # a slot's tag before its first publish


def bound(j: int, taus: Mapping[str, int], start: int) -> int:
    """The version every owner must have published before a rank completes minibatch ``j``:
    what its gathers would have waited for (``j - τ`` of the least stale unit), whatever its plan
    held, so that every rank, one with no samples included, stays within τ of its peers."""
    return max(j - min(taus.values(), default=0), start)


def rank_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts[0] + parts[1] + ...`` in rank order, into a fresh tensor: the same sum on every
    rank (the stats every owner checks and reports)."""
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


def reuse_view(view: Any, ring: int, ordered: bool, make: Callable[[], Any]) -> Any:
    """A transport's versions side: made on first use, then kept for the transport's life (it
    holds the owner's version ring), refusing a later config with another ring or another
    ``deterministic`` (rank-order sums)."""
    if view is None:
        return make()
    if view.ORDERED != ordered:
        raise ValueError(
            f"StepConfig.deterministic changed on this transport under staleness: its versions "
            f"were made with deterministic={view.ORDERED}"
        )
    if view.ring != ring:
        raise ValueError(
            f"StepConfig.staleness changed on this transport: it keeps {view.ring} versions, "
            f"the config asks for {ring}"
        )
    return view


class VersionStore:
    """Rank ``r``'s side of the versions; it also serves as the executor's transport for one
    minibatch (``gather``, ``scatter_accumulate``, ``fetch_add``, ``beat``) between ``open`` and
    ``complete``. The owner's ``apply(step, grads, stats)`` (given to ``start`` by the step
    layer) returns its new shards for version ``step + 1``."""

    max_counters: int

    def __init__(self, transport: Any, ring: int, start: int, ordered: bool, timeout: float) -> None:
        self.mesh, self.counters = transport.mesh, transport.counters
        self.collectives = transport.collectives
        self.timeout = timeout
        self.ring, self.start_version, self.rank = ring, start, self.mesh.rank
        self.ORDERED = ordered  # reuse_view compares it (the name the transports check)
        self.owners = self.mesh.shard_group
        self.owner: Any = None  # the step layer's owner state (params, optimizer state) lives here
        self.layout: Layout | None = None
        self.dtype: torch.dtype | None = None
        self.trained: list[str] = []
        self.sizes: dict[str, int] = {}
        self.j = start
        self.taus: dict[str, int] = {}
        self.pinned: dict[str, int] = {}
        self.reads: list[tuple[str, int]] = []  # (unit, version) of every gather of this minibatch
        self.wait_s = 0.0

    # --- storage hooks: one implementation per place ------------------------------------------
    def latest(self, owner: int) -> int:
        """``owner``'s newest published version."""
        raise NotImplementedError

    def _set_latest(self, owner: int, version: int) -> None:
        """Make ``version`` ``owner``'s newest (its slot and tag are written) and wake waiters."""
        raise NotImplementedError

    def _tag(self, owner: int, slot: int) -> int:
        raise NotImplementedError

    def _set_tag(self, owner: int, slot: int, tag: int) -> None:
        raise NotImplementedError

    def _shard(self, owner: int, slot: int, unit: str) -> torch.Tensor:
        """The published shard of ``unit`` in ``owner``'s ring slot (compute dtype)."""
        raise NotImplementedError

    def _write(self, owner: int, slot: int, unit: str, src: torch.Tensor) -> None:
        raise NotImplementedError

    def _parts(self, owner: int, slot: int) -> Sequence[MutableMapping[str, torch.Tensor]]:
        """``owner``'s accumulator parts of a slot: one per rank (ordered) or a single one."""
        raise NotImplementedError

    def _add_arrival(self, owner: int, slot: int, unit: str, piece: torch.Tensor) -> None:
        """Add ``piece`` into the single part, safe against concurrent adders."""
        raise NotImplementedError

    def _clear(self, owner: int, slot: int) -> None:
        """The slot's step was applied: ready its parts for the step ``R`` later."""
        raise NotImplementedError

    def _ready(self, owner: int) -> int | None:
        """The step ``owner`` should apply next if every client completed it, else None."""
        raise NotImplementedError

    def _rank_stats(self, k: int) -> list[torch.Tensor]:
        """Every rank's deposited stats of step ``k``, in rank order (all deposited: a bug if not)."""
        raise NotImplementedError

    def _applied(self, owner: int, k: int, norm2: float) -> None:
        """``owner`` applied step ``k``: record its gradient norm² for the reports."""
        raise NotImplementedError

    def _figures(self, k: int) -> tuple[list[torch.Tensor], list[float]] | None:
        """Step ``k``'s stats and norm² of every rank and owner, in rank order, once all landed."""
        raise NotImplementedError

    def _finish(self, j: int, stats: torch.Tensor) -> None:
        """Deposit this rank's stats of minibatch ``j`` (float64, flat), then count it done at
        every owner."""
        raise NotImplementedError

    def _setup(self, layout: Layout, dtype: torch.dtype, apply: Apply) -> None:
        """Storage for the ring and the owner's ``apply``, before the first publish."""
        raise NotImplementedError

    def _block(self, pred: Callable[[], bool], what: str) -> None:
        """Until ``pred()``; ``TransportError`` once the peers made no progress for ``timeout``
        seconds (``odcfn.transport.heartbeat``), or a peer aborted or died."""
        raise NotImplementedError

    def beat(self) -> None:
        """This rank made progress (the executor after each plan step, an applied update)."""
        raise NotImplementedError

    def service(self) -> int:
        """Apply what this rank applies, now; returns the number of steps applied."""
        raise NotImplementedError

    def fetch_add(self, counter: int, n: int = 1) -> int:
        raise NotImplementedError

    # --- versions ---------------------------------------------------------------------------
    def start(
        self, layout: Layout, shards: Mapping[str, torch.Tensor], dtype: torch.dtype, apply: Apply
    ) -> None:
        """Set up the ring, publish the starting version and register the owner's ``apply``
        (first stale step)."""
        self.layout, self.dtype = layout, dtype
        self.trained = [u.name for u in layout.units if not u.frozen]
        self.sizes = {u.name: u.shard_size for u in layout.units}
        self._setup(layout, dtype, apply)
        self.publish(self.rank, self.start_version, shards)

    def publish(self, owner: int, version: int, shards: Mapping[str, torch.Tensor]) -> None:
        """Make ``shards`` (fp32 masters) ``owner``'s ``version``, in the compute dtype: tag the
        slot as being written, write it, tag it with the version, then announce it."""
        slot = version % self.ring
        self._set_tag(owner, slot, WRITING)
        for u in self.layout.units:
            self._write(owner, slot, u.name, shards[u.name].detach())
        self._set_tag(owner, slot, version)
        self._set_latest(owner, version)

    @property
    def applied(self) -> int:
        """This owner's newest version (its shards after the updates of steps below it)."""
        return self.latest(self.rank)

    def _newest(self, owners: Sequence[int] | None = None) -> int:
        return min(self.latest(o) for o in (self.owners if owners is None else owners))

    def open(self, j: int, taus: Mapping[str, int]) -> None:
        """Begin minibatch ``j`` with each unit's bound ``taus``."""
        self.j, self.taus = j, dict(taus)
        self.pinned, self.reads, self.wait_s = {}, [], 0.0

    # --- waiting ----------------------------------------------------------------------------
    def wait(self, pred: Callable[[], bool], what: str) -> None:
        t0 = time.perf_counter()
        try:
            self._block(pred, f"{what} (rank {self.rank}, minibatch {self.j})")
        finally:
            self.wait_s += time.perf_counter() - t0

    def wait_applied(self, n: int) -> None:
        """Until every owner has applied every step below ``n``."""
        every = range(self.mesh.world_size)
        self.wait(lambda: self._newest(every) >= n, f"every owner to apply the steps below {n}")

    # --- applying ---------------------------------------------------------------------------
    def _apply_step(self, owner: int, k: int, apply: Apply) -> None:
        """Step ``k`` of ``owner`` (every client completed it): sum the ranks' stats and the
        gradient parts, run ``apply``, clear the slot, publish ``k + 1``."""
        stats = rank_sum(self._rank_stats(k))
        parts = self._parts(owner, k % self.ring)
        grads = rank_order_sum(parts, self.trained, self.sizes) if self.ORDERED else dict(parts[0])
        norm2 = float(sum_squares(grads.values()))
        shards = apply(k, grads, stats)
        self._clear(owner, k % self.ring)  # before the publish below frees the slot for step k + R
        self._applied(owner, k, norm2)
        self.publish(owner, k + 1, shards)
        self.beat()

    def report(self, k: int) -> tuple[torch.Tensor, float] | None:
        """Step ``k``'s summed stats and global gradient norm² once every rank and owner has
        delivered them, else None."""
        got = self._figures(k)
        if got is None:
            return None
        parts, norms = got
        return rank_sum(parts), sum(norms)

    # --- the executor's transport for minibatch j -------------------------------------------
    def gather(self, unit: str, out: torch.Tensor) -> Handle:
        size = self.layout[unit].shard_size
        v = self.pinned.get(unit)
        if v is None:
            need = max(self.j - self.taus.get(unit, 0), self.start_version)  # nothing older than the start
            self.wait(lambda: self._newest() >= need, f"version >= {need} of unit {unit!r}")
            v = self.pinned[unit] = self._newest()
        slot = v % self.ring
        for i, owner in enumerate(self.owners):
            self._check_tag(owner, slot, v, unit, "before")
            src = self._shard(owner, slot, unit)
            out[i * size : (i + 1) * size].copy_(src)
            self._check_tag(owner, slot, v, unit, "during")
            if owner != self.rank:
                self.counters.gather_bytes += src.numel() * src.element_size()
        self.reads.append((unit, v))
        self.counters.gathers += 1
        return Done()

    def _check_tag(self, owner: int, slot: int, v: int, unit: str, when: str) -> None:
        tag = self._tag(owner, slot)
        if tag != v:  # the ring protocol makes this impossible: a bug, never torn weights
            held = "being rewritten" if tag == WRITING else f"holding version {tag}"
            raise TransportError(
                f"torn read of {unit!r} version {v} from rank {owner}: its slot was {held} {when} "
                f"the copy (rank {self.rank}, minibatch {self.j})"
            )

    def scatter_accumulate(self, unit: str, grad: torch.Tensor) -> Handle:
        size, j, slot = self.layout[unit].shard_size, self.j, self.j % self.ring
        for i, owner in enumerate(self.owners):
            if self.latest(owner) < j - self.ring + 1:  # the slot still holds step j - R, unapplied
                self.wait(
                    lambda o=owner: self.latest(o) >= j - self.ring + 1,
                    f"rank {owner} to apply step {j - self.ring} (push of {unit!r})",
                )
            piece = grad[i * size : (i + 1) * size]
            if self.ORDERED:  # this rank's own part: no other writer, so no lock
                accumulate(self._parts(owner, slot)[self.rank], unit, piece)
            else:
                self._add_arrival(owner, slot, unit, piece)
            if owner != self.rank:
                self.counters.scatter_bytes += piece.numel() * piece.element_size()
        self.counters.scatters += 1
        return Done()

    def complete(self, stats: torch.Tensor) -> None:
        """This rank's pushes of minibatch ``j`` have landed: within the bound of its step,
        deposit its stats (they ride to the owners instead of a sync) and count it done."""
        need = bound(self.j, self.taus, self.start_version)
        # the bound a gather enforces, for a rank whose plan gathered nothing (fewer samples than
        # ranks): without it such a rank runs ahead without limit and outlaps the rings
        self.wait(lambda: self._newest() >= need, f"version >= {need} (the bound of a rank's step)")
        self._finish(self.j, stats.detach().to("cpu", torch.float64, copy=True).reshape(-1))

    def flush(self) -> None:  # pushes land synchronously; completion is ``complete``
        return None

    def close(self) -> None:
        return None
