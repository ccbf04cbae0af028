"""Inter-node GPU transport: NVSHMEM symmetric memory driven from Triton kernels.

- Init: ``nvshmem4py`` bootstrapped over torch.distributed: rank 0 creates the unique id, a
  ``broadcast`` of its fixed-size bytes (a tensor, never pickle) ships it, every rank calls
  ``nvshmem.core.init(uid=...)``.
- Memory: each rank's arena and signal words are symmetric tensors
  (``nvshmem.core.interop.torch.tensor``): the same local address names the same region on
  every PE, so a peer's region is just (address, PE).
- Gather: peers on this node through their ``nvshmem_ptr`` mapping (plain device copies, the
  CUDA-IPC path); peers on other nodes through ONE launch of ``nvshmem_gather_kernel``
  (``nvshmemx_getmem_block`` per chunk, one-sided).
- Scatter-accumulate: landing slots only (NVSHMEM has no bulk remote float add): the header and
  data go out with ``nvshmemx_putmem_signal_nbi_block`` in one kernel, which sets the owner's
  SLOT word after the bytes; the owner's drain thread accumulates on a side stream and returns a
  credit with ``nvshmemx_signal_op``. Request ids follow ``_gpu_protocol.SeqIds`` (Z/2^32,
  equality waits), so sender and receiver wrap identically.
- Signals (VERSION, FIN, CREDIT) go out with ``nvshmem_signal_kernel``; ``sync`` and the
  collective baseline use torch.distributed (nccl).

Each kernel module that calls NVSHMEM is registered with ``nvshmemx_cumodule_init`` before its
first launch (``_launch``). Everything here is compiled for sm_90 in CI (tests/transport/test_gpu_compile)
and the protocol runs on CPU through the IPC fabric; THIS FILE HAS NOT YET RUN ON GPU HARDWARE.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from odcfn.sharding import Mesh
from odcfn.transport.base import Collectives
from odcfn.transport.collective import TorchCollectives
from odcfn.transport.gpu._engine import ArenaTransport
from odcfn.transport.gpu.cuda_ipc import require_cuda

__all__ = [
    "NvshmemFabric",
    "init_nvshmem",
    "nvshmem_transport",
    "require_nvshmem",
    "require_nvshmem_module",
    "uid_from_bytes",
    "uid_to_bytes",
]

_STATE: dict[str, Any] = {"initialised": False, "modules": {}}
_COMPILE_LOCK = threading.Lock()


def require_nvshmem_module() -> Any:
    """Import ``nvshmem.core`` or fail with what to install."""
    try:
        import nvshmem.core as nv  # type: ignore[import-not-found]
        import nvshmem.core.interop.torch  # noqa: F401  # type: ignore[import-not-found]
    except ImportError as e:
        raise RuntimeError(
            f"the NVSHMEM transport needs nvshmem4py ({e}); install the 'gpu' extra: pip install 'odcfn[gpu]'"
        ) from e
    return nv


def require_nvshmem() -> Any:
    """``nvshmem.core``, or a clear error if nvshmem4py or a CUDA device is missing."""
    nv = require_nvshmem_module()
    require_cuda("the NVSHMEM transport", "Multi-process CPU runs use the CUDA-IPC fabric with device='cpu'.")
    return nv


def uid_to_bytes(uid: Any) -> bytes:
    """An NVSHMEM unique id as bytes (what rank 0 broadcasts; nvshmem4py's own MPI path sends
    the same int8 view of ``uid._data``)."""
    import numpy as np

    return uid._data.view(np.int8).tobytes()


def uid_from_bytes(data: bytes) -> Any:
    import numpy as np

    nv = require_nvshmem_module()
    uid = nv.get_unique_id(empty=True)
    view = uid._data.view(np.int8)
    if len(data) != view.nbytes:
        raise ValueError(f"NVSHMEM unique id must be {view.nbytes} bytes, got {len(data)}")
    view[:] = np.frombuffer(data, dtype=np.int8)
    return uid


def init_nvshmem(mesh: Mesh, device: torch.device) -> None:
    """Initialise NVSHMEM once per process over an initialised torch.distributed group."""
    if _STATE["initialised"]:
        return
    import torch.distributed as dist
    from cuda.core import Device  # type: ignore[import-not-found]

    nv = require_nvshmem()
    if not dist.is_initialized():
        raise RuntimeError(
            "init_nvshmem: call torch.distributed.init_process_group first (the uid travels over it)"
        )
    dev = Device(device.index)
    dev.set_current()
    # the id's fixed-size bytes as a tensor (broadcast_object_list would unpickle what arrives)
    size = len(uid_to_bytes(nv.get_unique_id(empty=True)))
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    if mesh.rank == 0:
        box = torch.frombuffer(bytearray(uid_to_bytes(nv.get_unique_id())), dtype=torch.uint8).to(on)
    else:
        box = torch.zeros(size, dtype=torch.uint8, device=on)
    dist.broadcast(box, src=0)
    uid = uid_from_bytes(box.cpu().numpy().tobytes())
    nv.init(device=dev, uid=uid, rank=mesh.rank, nranks=mesh.world_size, initializer_method="uid")
    _STATE["initialised"] = True


def _bitcode_arch(capability: tuple[int, int]) -> int:
    """The newest NVSHMEM device bitcode (70, 80, 89, 90, 100 ship) this GPU can run."""
    cc = 10 * capability[0] + capability[1]
    return max(a for a in (70, 80, 89, 90, 100) if a <= cc) if cc >= 70 else 70


def _launch(kernel: Any, grid: tuple[int, ...], *args: Any, **consts: Any) -> None:
    """Launch a Triton kernel that calls NVSHMEM; register its CUmodule with NVSHMEM first.

    Every *specialisation* triton compiles (an int arriving as i32 or i64, a pointer 16-byte
    aligned or not) is its own CUmodule, and each needs ``nvshmemx_cumodule_init``: so the
    compiled kernel for these exact arguments is looked up (``warmup`` compiles at most once,
    then hits the cache) and registered the first time it is seen."""
    from nvshmem import bindings  # type: ignore[import-not-found]

    from odcfn.transport.gpu._nvshmem_device import extern_libs

    # a tuple of pairs (hashable: it becomes part of triton's kernel cache key)
    libs = extern_libs(_bitcode_arch(torch.cuda.get_device_capability()))
    with _COMPILE_LOCK:  # the main and drain threads may both reach a first launch
        compiled = kernel.warmup(*args, grid=grid, extern_libs=libs, **consts)
        key = (id(compiled), torch.cuda.current_device())
        if key not in _STATE["modules"]:
            compiled._init_handles()
            status = bindings.cumodule_init(int(compiled.module))
            if status not in (None, 0):
                raise RuntimeError(f"nvshmemx_cumodule_init failed ({status}) for {kernel.fn.__name__}")
            _STATE["modules"][key] = compiled  # keeps it alive: the id stays unique
    kernel[grid](*args, extern_libs=libs, **consts)


class NvshmemFabric:
    """Arena + signals on the NVSHMEM symmetric heap (see module doc). Full or hybrid meshes."""

    CHUNK_BYTES = 1 << 16

    def __init__(self, mesh: Mesh, device: torch.device | str | None = None) -> None:
        self.nv = require_nvshmem()
        from odcfn.kernels import triton_ops
        from odcfn.transport.gpu import _nvshmem_device as dev_kernels

        self.ops, self.k = triton_ops, dev_kernels
        self.device = (
            torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        )
        torch.cuda.set_device(self.device)
        init_nvshmem(mesh, self.device)
        self.mesh, self.group = mesh, mesh.shard_group
        self.side_stream = torch.cuda.Stream(self.device)
        self.arena = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.sig = torch.empty(0, dtype=torch.int64, device=self.device)
        self.peer_views: dict[int, torch.Tensor] = {}  # same-node peers, through nvshmem_ptr
        self._staging = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._pes: dict[tuple, torch.Tensor] = {}
        self._poll = threading.local()

    def _same_node(self, rank: int) -> bool:
        return rank // self.mesh.node_size == self.mesh.node

    def setup(self, nbytes: int, words: int, key: str) -> None:
        from nvshmem.core.interop import torch as nvt  # type: ignore[import-not-found]

        self.close()
        # symmetric allocation is collective: every PE allocates the same sizes in the same order
        self.arena = nvt.tensor((nbytes,), dtype=torch.uint8)
        self.sig = nvt.tensor((words,), dtype=torch.int64)
        self.arena.zero_()
        self.sig.zero_()
        torch.cuda.current_stream().synchronize()
        self.nv.barrier_all(stream=torch.cuda.current_stream())  # nobody signals un-zeroed words
        torch.cuda.current_stream().synchronize()
        for r in self.group:
            if r == self.mesh.rank:
                self.peer_views[r] = self.arena
            elif self._same_node(r):
                try:
                    view = nvt.get_peer_tensor(self.arena, r)
                except Exception:  # noqa: BLE001 - not P2P reachable: fall back to NVSHMEM get
                    view = None
                if view is not None and view.data_ptr() != 0:
                    self.peer_views[r] = view
        self._pes = {}

    # --- signals ------------------------------------------------------------------------------
    def _poll_state(self) -> Any:
        """This thread's poll stream and pinned word (the main and drain threads both poll)."""
        st = getattr(self._poll, "state", None)
        if st is None:
            cuda = self.device.type == "cuda"
            stream = torch.cuda.Stream(self.device)
            host = torch.empty(1, dtype=torch.int64, pin_memory=cuda)
            st = self._poll.state = (stream, host)
        return st

    def signal_read(self, idx: int) -> int:
        # Not ``.item()`` on the current stream: that copy queues behind every kernel already
        # launched there, so each poll would wait for the queued compute. A copy on this
        # thread's own stream (torch's pool streams are cudaStreamNonBlocking: no implicit
        # ordering with the compute stream) into pinned memory waits for the word only. The
        # word is written remotely by NVSHMEM (not by any stream here), so no ordering is lost.
        stream, host = self._poll_state()
        with torch.cuda.stream(stream):
            host.copy_(self.sig[idx : idx + 1], non_blocking=True)
        stream.synchronize()
        return int(host[0])

    def signal_write(self, rank: int, idx: int, value: int) -> None:
        self.fence()
        _launch(self.k.nvshmem_signal_kernel, (1,), self.sig.data_ptr() + 8 * idx, int(value), int(rank))
        self.fence()

    # --- data ---------------------------------------------------------------------------------
    def _i32(self, xs: list[int]) -> torch.Tensor:
        key = tuple(xs)
        t = self._pes.get(key)
        if t is None:
            t = self._pes[key] = torch.tensor(xs, dtype=torch.int32, device=self.device)
        return t

    def get(self, owners: tuple[int, ...], offset: int, out: torch.Tensor) -> None:
        n = out.numel() // len(owners)
        nbytes = n * out.element_size()
        remote_pes, remote_pos = [], []
        for i, o in enumerate(owners):
            view = self.peer_views.get(o)
            if view is not None:  # same node: a device copy over NVLink / within the GPU
                out[i * n : (i + 1) * n].copy_(view[offset : offset + nbytes].view(out.dtype))
            else:
                remote_pes.append(o)
                remote_pos.append(i)
        if remote_pes:
            grid = (len(remote_pes), -(-nbytes // self.CHUNK_BYTES))
            _launch(
                self.k.nvshmem_gather_kernel,
                grid,
                out.view(torch.uint8),
                self.arena.data_ptr() + offset,
                self._i32(remote_pes),
                self._i32(remote_pos),
                nbytes,
                CHUNK_BYTES=self.CHUNK_BYTES,
            )

    def put_signal(self, rank: int, parts: list[tuple[int, torch.Tensor]], idx: int, value: int) -> None:
        view = self.peer_views.get(rank)
        if view is not None:  # same node: stores through the mapping, fence, then the signal
            for off, t in parts:
                b = t.contiguous().view(torch.uint8).reshape(-1)
                view[off : off + b.numel()].copy_(b, non_blocking=True)
            self.signal_write(rank, idx, value)
            return
        base = parts[0][0]
        end = max(off + t.numel() * t.element_size() for off, t in parts)
        if self._staging.numel() < end - base:
            self._staging = torch.empty(end - base, dtype=torch.uint8, device=self.device)
        for off, t in parts:
            b = t.contiguous().view(torch.uint8).reshape(-1)
            self._staging[off - base : off - base + b.numel()].copy_(b, non_blocking=True)
        vals = torch.tensor([value], dtype=torch.int64, device=self.device)
        _launch(
            self.k.nvshmem_put_signal_kernel,
            (1,),
            self._staging,
            0,
            end - base,
            self.arena.data_ptr() + base,
            self.sig.data_ptr() + 8 * idx,
            vals,
            self._i32([rank]),
            0,
        )
        self.fence()  # the kernel quiets: bytes and signal are delivered, staging reusable

    def scatter_add(self, owners: tuple[int, ...], offset: int, grad: torch.Tensor) -> None:
        raise ValueError("the NVSHMEM transport supports mode='landing' only (no bulk remote float add)")

    def accumulate(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        self.ops.accumulate(acc, x)

    def cast_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.ops.cast_copy(dst, src.to(dst.device).contiguous())

    def fence(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        if self.arena.numel():
            from nvshmem.core.interop import torch as nvt  # type: ignore[import-not-found]

            self.peer_views = {}
            nvt.free_tensor(self.arena)
            nvt.free_tensor(self.sig)
            self.arena = torch.empty(0, dtype=torch.uint8, device=self.device)
            self.sig = torch.empty(0, dtype=torch.int64, device=self.device)


def nvshmem_transport(
    mesh: Mesh,
    store: Any,
    collectives: Collectives | None = None,
    *,
    device: torch.device | str | None = None,
    slots: int = 8,
    slot_elems: int = 1 << 20,
    timeout: float = 300.0,
    prefix: str = "odcfn",
    host_grads: bool = False,
) -> ArenaTransport:
    """The NVSHMEM transport for ``mesh.rank`` (after ``torch.distributed.init_process_group``).
    ``store``: the torch.distributed store (``fetch_add``); ``collectives``: by default
    ``TorchCollectives`` (nccl) for ``mesh``, on the caller's process group if there is one."""
    fabric = NvshmemFabric(mesh, device)
    own = collectives is None
    if own:
        collectives = TorchCollectives(mesh, fabric.device, timeout=timeout)
    return ArenaTransport(
        mesh,
        fabric,
        store,
        collectives,
        mode="landing",
        slots=slots,
        slot_elems=slot_elems,
        timeout=timeout,
        prefix=prefix,
        host_grads=host_grads,
        own_collectives=own,
    )
