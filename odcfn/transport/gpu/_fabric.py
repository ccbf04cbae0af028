"""What the arena transports need from the memory under them (``_engine.ArenaTransport`` drives it;
``cuda_ipc.IpcFabric`` and ``nvshmem.NvshmemFabric`` are the two). Layouts: ``_protocol``."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Fabric"]


class Fabric(Protocol):
    """Memory peers can reach. Ranks are global; ``group`` is the shard group (in order)."""

    device: torch.device
    arena: torch.Tensor  # uint8, this rank's
    side_stream: Any  # where owner-side accumulation runs (None: same thread, CPU)

    def setup(self, nbytes: int, words: int, key: str) -> None:
        """Collective over the shard group: allocate a zeroed arena of ``nbytes`` and ``words``
        signal words, and make every peer's reachable (``key`` names the rendezvous)."""

    def signal_read(self, idx: int) -> int:
        """This rank's signal word ``idx``."""

    def signal_write(self, rank: int, idx: int, value: int) -> None:
        """Set ``rank``'s word ``idx``, visible only after this rank's earlier writes to it."""

    def get(self, owners: tuple[int, ...], offset: int, out: torch.Tensor) -> None:
        """Block i of ``out`` (``out.numel() // len(owners)`` elements) <- owner i's arena bytes
        at ``offset``: a one-sided pull."""

    def put_signal(self, rank: int, parts: list[tuple[int, torch.Tensor]], idx: int, value: int) -> None:
        """Write each (byte offset, tensor) into ``rank``'s arena, then set its signal word
        ``idx`` to ``value``; the word must become visible only after all the bytes."""

    def scatter_add(self, owners: tuple[int, ...], offset: int, grad: torch.Tensor) -> None:
        """Owner i's fp32 words at ``offset`` += block i of ``grad``, atomically (remote add)."""

    def accumulate(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        """Local ``acc += x`` (fp32 accumulator, x upcast)."""

    def cast_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst <- src`` with the cast fused (publishing shards in the compute dtype)."""

    def fence(self) -> None:
        """Complete every device write this thread issued so far."""

    def close(self) -> None: ...
