"""Which GPU is which across the processes of a node, and what a peer pointer table must
satisfy: the CUDA-IPC fabric's device logic, as plain functions the tests drive with mocked
device lists (tests/transport/test_gpu_protocol.py: per-rank CUDA_VISIBLE_DEVICES and P2P matrices).

Why: a rank started with ``CUDA_VISIBLE_DEVICES=<its GPU>`` calls its GPU cuda:0, as does
every other rank, so a device index sent to a peer names the peer's OWN GPU there. Handles are
therefore identified by the GPU's UUID (stable node-wide) and always opened on the receiver's
compute device, whose kernels dereference the mapped pointers. NOT YET RUN ON GPU HARDWARE.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from odcfn.transport.base import TransportError

__all__ = ["check_aligned", "device_id", "open_device_for_peer"]


def device_id(index: int) -> str:
    """A GPU's name that every process of the node agrees on whatever its CUDA_VISIBLE_DEVICES
    (torchrun setups often give each rank only its own GPU, so "cuda:0" names a different
    GPU in every process): the UUID, else the PCI domain:bus:device."""
    p = torch.cuda.get_device_properties(index)
    uuid = str(getattr(p, "uuid", "") or "")
    if uuid:
        return f"uuid:{uuid}"
    pci = tuple(getattr(p, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if None in pci:
        raise RuntimeError(f"cuda:{index}: torch reports neither a UUID nor a PCI bus id")
    return "pci:{:04x}:{:02x}:{:02x}".format(*pci)


def open_device_for_peer(
    peer_id: str, compute: int, visible: list[str], can_access: Callable[[int, int], bool]
) -> int:
    """The local device index under which to open a peer's IPC handle: ALWAYS the compute
    device, because the mapping a handle open creates lives in that device's context (it is
    the compute device's kernels that dereference the pointer). ``visible``: this process's
    ``device_id`` per local index; ``can_access(a, b)``: ``torch.cuda.can_device_access_peer``.

    Same GPU: nothing to enable. A peer GPU visible here at local index j: refused unless the
    compute device can access j (P2P over NVLink/PCIe). A peer GPU not visible here
    (per-rank CUDA_VISIBLE_DEVICES): nothing can be queried; the open itself (torch passes
    cudaIpcMemLazyEnablePeerAccess) enables access or fails, and ``_open_cuda`` words that."""
    if peer_id == visible[compute]:
        return compute
    if peer_id in visible:
        j = visible.index(peer_id)
        if not can_access(compute, j):
            raise TransportError(
                f"cuda:{compute} ({visible[compute]}) cannot access the peer's GPU cuda:{j} ({peer_id}) "
                "directly (no P2P between them): CUDA IPC needs peer access; use the NVSHMEM "
                "transport or place these ranks' shard group on P2P-connected GPUs"
            )
    return compute


def check_aligned(ptrs: list[int], owners: tuple[int, ...]) -> None:
    """The kernels read and atomically add 16 bytes at a time (and triton specialises on a
    16-byte divisible base): a table entry off that grid would fault or tear. The arena's
    regions are ALIGN-aligned from its base, so this fails only if a mapping's base is not."""
    bad = [(o, hex(p)) for o, p in zip(owners, ptrs) if p % 16]
    if bad:
        raise TransportError(f"peer arena pointers not 16-byte aligned: {bad} (rank, address)")
