"""Cross-process primitives over /dev/shm: segments, byte-range locks, bounded waits.

- ``Segment``: one rank's shared-memory file, mapped as a flat uint8 tensor. The creator maps it,
  peers map it between two barriers, then the creator unlinks it: the mappings stay valid and
  nothing survives a crash after setup.
- ``RangeLock``: an exclusive lock on one byte of a segment's file via open-file-description
  (OFD) ``fcntl`` locks. The kernel releases it when its holder dies, so a killed peer can never
  leave a lock held; OFD locks (unlike classic POSIX locks) are not dropped when some other fd
  of the same file is closed.
- ``check_store_order``: the protocols above publish "data, then flag" with plain stores, which is
  correct only where the CPU keeps stores in program order (x86-64's TSO); elsewhere (aarch64,
  POWER) a peer could see the flag before the data, so they refuse to start.
- ``wait_until``: poll a predicate with a short, growing sleep (a pure busy-poll would starve the
  other rank's thread of the GIL and of a CPU on a 2-core machine), checking on the way that the
  peers are alive and have not aborted; raise ``TransportError`` once the peers made no
  progress for ``timeout`` seconds (``odcfn.transport.heartbeat``: a busy peer is not a dead one).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import struct
import time
from collections.abc import Callable, Sequence

import torch

from odcfn.transport.base import TransportError
from odcfn.transport.heartbeat import Patience

__all__ = [
    "RangeLock", "Segment", "check_store_order", "map_segments", "pid_alive", "punch_hole", "shm_dir",
    "wait_until",
]

# struct flock on Linux x86-64/aarch64: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid (+ padding); l_pid must be 0 for OFD locks.
_FLOCK = "hhqqi4x"


_TSO = ("x86_64", "AMD64", "amd64", "i686", "i386")  # the names Python reports for x86


def check_store_order(who: str) -> None:
    """Refuse, before any segment exists, a CPU that may reorder stores: the flag of a
    "data, then flag" publication could become visible before the data (a torn read, silently)."""
    machine = platform.machine()
    if machine not in _TSO:
        raise RuntimeError(
            f"{who} relies on x86-64 store ordering (data written before its flag is seen first); "
            f"this machine is {machine or 'unknown'}, where it could read torn shards. Use a "
            "transport without shared-memory flags (odcfn.transport.collective, comm='collective')"
        )


def shm_dir() -> str:
    return os.environ.get("ODCFN_SHM_DIR", "/dev/shm")


class Segment:
    """A shared-memory file mapped as ``self.bytes`` (uint8 tensor) plus an fd for locks."""

    def __init__(self, path: str, nbytes: int, *, create: bool) -> None:
        self.path, self.nbytes, self.linked = path, nbytes, create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(self.fd, nbytes)
            elif os.fstat(self.fd).st_size != nbytes:
                raise TransportError(
                    f"shared segment {path} has {os.fstat(self.fd).st_size} bytes, expected {nbytes} "
                    "(ranks disagree on the layout?)"
                )
            self.bytes = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            if create:
                os.unlink(path)
            raise

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.empty((), dtype=dtype).element_size()
        if offset % size:
            raise ValueError(f"offset {offset} is not aligned for {dtype}")
        return self.bytes[offset : offset + numel * size].view(dtype)

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink()
        self.bytes = None  # drops the mapping once no view of it is alive
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Release ``length`` bytes at ``offset`` of ``fd``'s tmpfs file (they read as zeros again);
    False where the file system cannot (then the caller zeroes them, or keeps them)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return length <= 0 or libc.fallocate(fd, _PUNCH, offset, length) == 0


class RangeLock:
    """Exclusive OFD lock on byte ``index`` of ``fd``'s file (any index, even past EOF)."""

    __slots__ = ("fd", "index", "timeout", "what")

    def __init__(self, fd: int, index: int, timeout: float, what: str) -> None:
        self.fd, self.index, self.timeout, self.what = fd, index, timeout, what

    def _op(self, cmd: int, kind: int) -> bool:
        try:
            fcntl.fcntl(self.fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, self.index, 1, 0))
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    def __enter__(self) -> RangeLock:
        if self._op(fcntl.F_OFD_SETLK, fcntl.F_WRLCK):
            return self
        # Contended: poll rather than block in F_OFD_SETLKW, so a holder that is alive but
        # stuck (SIGSTOP, debugger) still ends in an error instead of a hang.
        deadline = time.monotonic() + self.timeout
        pause = 2e-5
        while not self._op(fcntl.F_OFD_SETLK, fcntl.F_WRLCK):
            if time.monotonic() > deadline:
                raise TransportError(f"timed out after {self.timeout}s waiting for the lock on {self.what}")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return self

    def __exit__(self, *exc: object) -> None:
        self._op(fcntl.F_OFD_SETLK, fcntl.F_UNLCK)


def pid_alive(pid: int) -> bool:
    """False if ``pid`` does not exist or is a zombie (killed, not yet reaped by its parent)."""
    if pid <= 0:
        return True  # not published yet: nothing to say
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        return True


def wait_until(
    pred: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    check: Callable[[], str | None] | None = None,
    peers: Sequence[tuple[int, Callable[[], int]]] = (),
    progress: Callable[[], int] | None = None,
) -> None:
    """Return once ``pred()`` holds. ``check()`` returns a reason to give up (e.g. a peer's
    abort flag); ``peers`` are (rank, pid getter) pairs whose death ends the wait early;
    ``progress()`` the peers' progress counters (summed): ``timeout`` counts from its last
    change (``odcfn.transport.heartbeat``)."""
    if pred():
        return
    patience = Patience(timeout, what, progress)
    pause, next_probe = 1e-5, time.monotonic() + 0.05
    while not pred():
        now = time.monotonic()
        if check is not None and (why := check()) is not None:
            raise TransportError(f"gave up waiting for {what}: {why}")
        if now >= next_probe:
            next_probe = now + 0.05
            for rank, pid in peers:
                if not pid_alive(pid()):
                    raise TransportError(f"rank {rank} (pid {pid()}) died while waiting for {what}")
        if patience.expired():
            raise TransportError(f"timed out after {timeout}s waiting for {what} (dead or stuck peer? "
                                 f"no progress from it for {timeout}s)")
        time.sleep(pause)
        pause = min(pause * 2, 5e-4)


def map_segments(
    path: Callable[[int], str], nbytes: int, rank: int, members: Sequence[int], barrier: Callable[[], None],
    init: Callable[[Segment], None] = lambda own: None,
) -> dict[int, Segment]:
    """Every member's segment, mapped on this rank (``members`` includes it): create ours
    (``init`` writes its first words, e.g. our pid), barrier, map the others', barrier, then
    unlink every file. Every member removes every member's file (the names ``path(p)`` are known
    to all), so a peer killed anywhere between creating its file and unlinking it leaves nothing
    behind in /dev/shm."""
    own = Segment(path(rank), nbytes, create=True)
    mapped = {rank: own}
    try:
        init(own)
        barrier()  # every file exists
        for p in members:
            if p != rank:
                mapped[p] = Segment(path(p), nbytes, create=False)
        barrier()  # every member mapped every file
    except BaseException:
        for s in mapped.values():
            s.close()
        raise
    finally:
        own.unlink()
        for p in members:
            try:
                os.unlink(path(p))
            except FileNotFoundError:
                pass
    return mapped
