"""Intra-node GPU transport: every rank's arena mapped into every process of its shard group.

Data plane: the arena is one device allocation per rank, shared through CUDA IPC (torch's own
``reduce_tensor``/rebuild pair, the mechanism ``torch.multiprocessing`` uses; it works between
processes on one GPU as well as across the GPUs of a node). A gather is ONE Triton launch that
pulls every owner's shard through a table of mapped pointers; scatter-accumulate is either ONE
Triton launch of vectorised atomic adds into the owners' accumulators ("remote_add": the owner
is never involved) or a put into a per-client landing slot that the owner's drain thread adds
on a side stream ("landing"). Control plane: int64 signal words in host shared memory
(``/dev/shm``), each written by exactly one peer after a stream synchronize, so no word ever
needs a cross-process read-modify-write; ``fetch_add`` uses the rendezvous store's atomic add.

The same fabric runs on CPU tensors (arena in ``/dev/shm`` too): with ``TRITON_INTERPRET=1``
through the very same Triton kernels, otherwise through their torch references. That is how
the protocol is tested on machines without a GPU. NOT YET RUN ON GPU HARDWARE.
"""

from __future__ import annotations

import hashlib
import os
import platform
import secrets
import sys
import time
import uuid
import weakref
from typing import Any

import torch

from odcfn.sharding import Mesh
from odcfn.transport.base import Collectives, TransportError
from odcfn.transport.collective import TorchCollectives
from odcfn.transport.gpu._devices import check_aligned, device_id, open_device_for_peer
from odcfn.transport.gpu._engine import ArenaTransport
from odcfn.transport.local import LocalCollectives  # noqa: F401 - re-exported: where callers found it
from odcfn.transport.rdzv import b64, check_shm_path, job_secret, seal, unb64, unseal

__all__ = ["IpcFabric", "LocalCollectives", "TorchCollectives", "cuda_ipc_transport", "require_cuda"]


def require_cuda(what: str = "the CUDA-IPC transport", hint: str = "") -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{what} needs a CUDA GPU, but torch {torch.__version__} sees none (CPU build or no "
            f"driver).{' ' + hint if hint else ''}"
        )


def _triton_ops(device: torch.device):
    """The Triton kernels when they can run here (CUDA, or interpreter on CPU), else None."""
    if (
        device.type == "cpu"
        and "odcfn.kernels.triton_ops" not in sys.modules
        and not os.environ.get("TRITON_INTERPRET")
    ):
        return None  # importing triton (seconds) only to find it cannot run here
    try:
        from odcfn.kernels import triton_ops
    except ImportError:
        if device.type == "cuda":
            raise RuntimeError("the CUDA-IPC transport needs triton: pip install 'odcfn[gpu]'") from None
        return None
    return triton_ops if device.type == "cuda" or triton_ops.interpreting() else None


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def _shm(path: str, nbytes: int, create: bool) -> torch.Tensor:
    if create:  # 0600 and exclusive: no other user may read the arena or pre-create the file
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled
        finally:
            os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _secret_name(prefix: str, key: str, group: tuple[int, ...], nonce: bytes = b"") -> str:
    """The node-local secret file's name: the same on every rank of this rendezvous (see rdzv)."""
    job = "|".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))
    h = hashlib.sha256(f"{os.getuid()}|{job}|{key}|{group}|{nonce.hex()}".encode()).hexdigest()[:16]
    return f"{prefix}secret-{h}"


def _rendezvous_nonce(store: Any, key: str, group: tuple[int, ...], rank: int) -> bytes:
    """Random bytes the group's first rank draws and the others read from this job's store, for
    the secret file's name. Without them two jobs on one node whose uid, torchrun env, key and
    group coincide (the threads of two test runs; jobs without torchrun's env) share one file:
    the first to finish unlinks it, a late rank of the other then makes a new secret, and its
    peers' records fail authentication (issue 40). Only hashed into a name: a forged value can
    at worst fail the rendezvous, which anyone who reaches the store can do anyway."""
    name = f"{key}/nonce/{group[0]}"
    if rank == group[0]:
        store.set(name, secrets.token_bytes(16))
    return bytes(store.get(name))  # waits for it (the store's timeout)


def _share_cuda(t: torch.Tensor) -> dict[str, Any]:
    """The IPC handle of ``t``'s allocation as plain data (what torch's own reduction sends)."""
    from torch.multiprocessing.reductions import StorageWeakRef, shared_cache

    shared = t.untyped_storage()._share_cuda_()
    device, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = shared

    shared_cache[handle] = StorageWeakRef(t._typed_storage())  # as reduce_tensor does: keep it alive
    return {
        "device": int(device), "handle": b64(handle), "size": int(size), "offset": int(offset),
        "rc_handle": b64(rc_handle), "rc_offset": int(rc_offset), "ev_handle": b64(ev_handle),
        "ev_sync": bool(ev_sync), "device_id": device_id(int(device)),
    }


def _open_cuda(rec: dict[str, Any], nbytes: int, compute: torch.device) -> torch.Tensor:
    """A peer's arena from its plain-data handle, through torch's fixed rebuild function,
    opened on the COMPUTE device (see ``open_device_for_peer``): the peer's own index
    (``rec["device"]``) is an index in the peer's CUDA_VISIBLE_DEVICES space, meaningless here."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        peer_id = rec["device_id"]
        if not isinstance(peer_id, str):
            raise TypeError("device_id is not a string")
        size, offset = int(rec["size"]), int(rec["offset"])
        rc_offset, ev_sync = int(rec["rc_offset"]), bool(rec["ev_sync"])
        handle, rc_handle, ev_handle = unb64(rec["handle"]), unb64(rec["rc_handle"]), unb64(rec["ev_handle"])
    except (KeyError, TypeError, ValueError) as e:
        raise TransportError(f"a peer's CUDA IPC record is malformed: {e}") from None
    if size < nbytes:
        raise TransportError(f"a peer's CUDA IPC allocation has {size} bytes, the arena needs {nbytes}")
    visible = [device_id(i) for i in range(torch.cuda.device_count())]
    device = open_device_for_peer(peer_id, compute.index, visible, torch.cuda.can_device_access_peer)
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, (nbytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8, device, handle,
            size, offset, False, rc_handle, rc_offset, ev_handle, ev_sync,
        )
    except RuntimeError as e:  # e.g. cudaErrorPeerAccessUnsupported for a GPU not visible here
        where = "visible here" if peer_id in visible else "not visible in this process (CUDA_VISIBLE_DEVICES)"
        raise TransportError(
            f"cannot map the peer's arena on GPU {peer_id} ({where}) into cuda:{compute.index} "
            f"({visible[compute.index]}): {e}. CUDA IPC needs P2P between the two GPUs."
        ) from e


class IpcFabric:
    """Arena + signals of one rank of an intra-node shard group (see module doc)."""

    def __init__(
        self,
        mesh: Mesh,
        store: Any,
        device: torch.device | str,
        *,
        shm_dir: str = "/dev/shm",
        timeout: float = 300.0,
    ) -> None:
        mesh.check_env()
        self.device = torch.device(device)
        if self.device.type == "cuda":
            require_cuda()
            if self.device.index is None:  # handles are opened on it: it must be one device
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif self.device.type != "cpu":
            raise ValueError(f"IpcFabric: device must be cuda or cpu, got {self.device}")
        elif platform.machine() not in ("x86_64", "AMD64"):
            raise RuntimeError(
                f"IpcFabric: a CPU arena relies on x86-64 store order; this is {platform.machine()}"
            )
        if mesh.sharding == "full" and mesh.num_nodes > 1:
            raise ValueError(
                f"IpcFabric: a full-shard group spans {mesh.num_nodes} nodes; CUDA IPC reaches one node "
                "(use sharding='hybrid' or the NVSHMEM transport)"
            )
        self.mesh, self.store, self.shm_dir, self.timeout = mesh, store, shm_dir, timeout
        self.group = mesh.shard_group
        self.ops = _triton_ops(self.device)
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.arena = torch.empty(0, dtype=torch.uint8)
        self.peers: dict[int, torch.Tensor] = {}
        self.peer_sigs: dict[int, torch.Tensor] = {}
        self.sig = torch.empty(0, dtype=torch.int64)
        self._own_files: list[str] = []
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}

    # --- rendezvous: map every shard-group peer's arena and signal words ----------------------
    def setup(self, nbytes: int, words: int, key: str) -> None:
        self.close()
        r = self.mesh.rank
        # under odcfn.launch / the test pool, the job's prefix: its sweep also finds our files
        prefix = f"{os.environ.get('ODCFN_SHM_PREFIX', 'odcfn')}-ipc-"
        tag = f"{prefix}{uuid.uuid4().hex[:12]}-{r}"
        sig_path = os.path.join(self.shm_dir, f"{tag}.sig")
        self._own_files = [sig_path]
        if self.device.type == "cpu":
            self._own_files.append(os.path.join(self.shm_dir, f"{tag}.arena"))
        secret_file = _secret_name(prefix, key, self.group, _rendezvous_nonce(self.store, key, self.group, r))
        # if this process dies before the rendezvous unlinks them, exit still removes the files
        weakref.finalize(self, _unlink_all, [*self._own_files, os.path.join(self.shm_dir, secret_file)])
        secret = job_secret(secret_file, self.shm_dir)
        self.sig = _shm(sig_path, words * 8, create=True).view(torch.int64)
        if self.device.type == "cpu":
            arena_path = self._own_files[1]
            self.arena = _shm(arena_path, nbytes, create=True)
            blob: dict[str, Any] = {"kind": "file", "path": arena_path}
        else:
            self.arena = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            blob = {"kind": "cuda", **_share_cuda(self.arena)}
        # plain JSON, authenticated: the store is reachable by anyone (see rdzv)
        info = {"rank": r, "sig": sig_path, "arena": blob, "nbytes": nbytes}
        self.store.set(f"{key}/{r}", seal(secret, f"{key}/{r}", info))
        for peer in self.group:
            if peer == r:
                self.peer_sigs[peer], self.peers[peer] = self.sig, self.arena
                continue
            info = unseal(secret, f"{key}/{peer}", self.store.get(f"{key}/{peer}"), f"rank {peer}")
            if info.get("rank") != peer or info.get("nbytes") != nbytes:
                raise TransportError(
                    f"rank {peer} laid out {info.get('nbytes')} arena bytes (record of rank "
                    f"{info.get('rank')}), rank {r} {nbytes}"
                )
            peer_sig = check_shm_path(info.get("sig"), self.shm_dir, prefix)
            self.peer_sigs[peer] = _shm(peer_sig, words * 8, False).view(torch.int64)
            arena = info.get("arena")
            kind = "file" if self.device.type == "cpu" else "cuda"
            if not isinstance(arena, dict) or arena.get("kind") != kind:
                raise TransportError(f"rank {peer}'s arena record is not a {kind} arena (refused)")
            if kind == "file":
                path = check_shm_path(arena.get("path"), self.shm_dir, prefix)
                self.peers[peer] = _shm(path, nbytes, False)
            else:
                self.peers[peer] = _open_cuda(arena, nbytes, self.device)
        # everyone has mapped everyone: the files can go (mappings stay valid, a crash leaks nothing)
        mapped = f"{key}/mapped/{self.group[0]}"  # one counter per shard group
        self.store.add(mapped, 1)
        deadline = time.monotonic() + self.timeout
        while int(self.store.add(mapped, 0)) < len(self.group):
            if time.monotonic() > deadline:
                raise TransportError(f"rank {r}: peers did not map the arenas within {self.timeout}s")
            time.sleep(1e-3)
        if r == self.group[0]:  # every rank has read the secret before it could count as mapped
            _unlink_all([os.path.join(self.shm_dir, secret_file)])
        self._unlink()

    def _unlink(self) -> None:
        _unlink_all(self._own_files)
        self._own_files = []

    # --- signals ------------------------------------------------------------------------------
    def signal_read(self, idx: int) -> int:
        return int(self.sig[idx])

    def signal_write(self, rank: int, idx: int, value: int) -> None:
        # every byte this thread wrote to the peer lands before the word: on CUDA the stream
        # synchronize completes the device writes; on the CPU arena, x86-64's store order does
        # (a CPU arena on aarch64 would need a fence that Python cannot issue: not supported)
        self.fence()
        self.peer_sigs[rank][idx] = value

    # --- data ---------------------------------------------------------------------------------
    def _table(self, owners: tuple[int, ...], offset: int) -> torch.Tensor:
        key = (*owners, offset)
        t = self._tables.get(key)
        if t is None:
            ptrs = [self.peers[o].data_ptr() + offset for o in owners]
            check_aligned(ptrs, owners)
            t = self._tables[key] = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        return t

    def get(self, owners: tuple[int, ...], offset: int, out: torch.Tensor) -> None:
        n = out.numel() // len(owners)
        if self.ops is not None:
            self.ops.gather(self._table(owners, offset), out)
            return
        nbytes = n * out.element_size()
        for i, o in enumerate(owners):
            out[i * n : (i + 1) * n].copy_(self.peers[o][offset : offset + nbytes].view(out.dtype))

    def put_signal(self, rank: int, parts: list[tuple[int, torch.Tensor]], idx: int, value: int) -> None:
        dst = self.peers[rank]
        for off, t in parts:
            b = t.contiguous().view(torch.uint8).reshape(-1)
            dst[off : off + b.numel()].copy_(b, non_blocking=True)
        self.signal_write(rank, idx, value)

    def scatter_add(self, owners: tuple[int, ...], offset: int, grad: torch.Tensor) -> None:
        if self.ops is None:
            raise RuntimeError(
                "mode='remote_add' needs triton atomics: a CUDA device, or TRITON_INTERPRET=1 on CPU "
                "(plain torch add_ from several processes loses updates)"
            )
        self.ops.scatter_add(self._table(owners, offset), grad)

    def accumulate(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        if self.ops is not None:
            self.ops.accumulate(acc, x)
        else:
            acc.add_(x)

    def cast_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        src = src.to(dst.device).contiguous()
        if self.ops is not None and src.dtype in (torch.float32, torch.bfloat16, torch.float16):
            self.ops.cast_copy(dst, src)
        else:
            dst.copy_(src)

    def fence(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self._unlink()
        self.peers, self.peer_sigs, self._tables = {}, {}, {}


def cuda_ipc_transport(
    mesh: Mesh,
    store: Any,
    collectives: Collectives | None = None,
    *,
    device: torch.device | str | None = None,
    mode: str | None = None,
    slots: int = 4,
    slot_elems: int = 1 << 20,
    timeout: float = 300.0,
    prefix: str = "odcfn",
    id_bits: int = 32,
    host_grads: bool = False,
) -> ArenaTransport:
    """The CUDA-IPC transport for ``mesh.rank``. ``store``: a torch.distributed Store shared by
    the ranks (rendezvous + ``fetch_add``); ``collectives``: by default ``TorchCollectives``
    for ``mesh`` (which uses the caller's process group if there is one), ``LocalCollectives``
    for threads. ``device`` defaults to ``cuda:{local_rank % count}``, so W
    processes on a one-GPU machine share that GPU. ``mode``: "remote_add" or "landing"; by
    default "remote_add" where triton atomics run (CUDA, interpreter), else "landing"."""
    if device is None:
        require_cuda(
            hint="For CPU tests pass device='cpu' (shared memory; triton interpreter or torch references)."
        )
        device = torch.device("cuda", mesh.local_rank % torch.cuda.device_count())
    fabric = IpcFabric(mesh, store, device, timeout=timeout)
    if mode is None:
        mode = "landing" if fabric.ops is None else "remote_add"
    if mode == "remote_add" and fabric.ops is None:
        fabric.scatter_add((), 0, torch.empty(0))  # raises the clear error
    own = collectives is None
    if own:
        collectives = TorchCollectives(mesh, fabric.device, timeout=timeout)
    return ArenaTransport(
        mesh,
        fabric,
        store,
        collectives,
        mode=mode,
        slots=slots,
        slot_elems=slot_elems,
        timeout=timeout,
        prefix=prefix,
        id_bits=id_bits,
        host_grads=host_grads,
        own_collectives=own,
    )
