"""One run per output directory: ``odcfn train`` holds ``<out_dir>/.odcfn-run.lock`` while it
runs, so a second run into the same directory stops before it touches a checkpoint or a log,
with an error that names the run holding it.

The lock is an advisory open-file-description (OFD) ``fcntl`` lock on that file, held by the
launcher's process: the kernel drops it when that process exits in any way (``kill -9``
included), so the lock of a dead run is simply taken over; the pid/host written inside only say
who holds it. OFD locks rather than ``flock`` because they can be *tested* without being taken
(``F_OFD_GETLK``): the run lock's look at the rank locks must never hold one, even for a moment,
or a rank taking its own lock at that moment is refused as another run's (issue 40).

The run is more than its launcher: with ``train.backend = "processes"`` (and under torchrun)
every rank process holds its own ``.odcfn-run.lock.rank<R>`` (``RankLock``) for as long as it
lives. A new run takes the directory only when the launcher's lock *and* every rank's lock are
free, so ranks that outlived a killed launcher keep the directory theirs (they die with it,
``odcfn.launch.orphan``: the new run waits up to ``wait_ranks`` seconds for that before refusing).
The kernel keeps these locks too: no pid bookkeeping that a recycled pid could fool."""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "RankLock", "RunDirLocked", "RunLock"]

LOCK_NAME = ".odcfn-run.lock"
_FLOCK = "hhqqi4x"  # Linux's struct flock (x86-64, aarch64): type, whence, start, len, pid


class RunDirLocked(RuntimeError):
    """Another live run holds the output directory."""


def _whole_file(fd: int, cmd: int, kind: int) -> int:
    """``fcntl(fd, cmd)`` with a lock of ``kind`` over the whole file; the lock type it returns."""
    import fcntl

    out = fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))
    return struct.unpack(_FLOCK, out)[0]


def _try_lock(path: Path) -> int | None:
    """An fd holding ``path``'s exclusive OFD lock, or None if another holder has it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _whole_file(fd, fcntl.F_OFD_SETLK, fcntl.F_WRLCK)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _is_locked(path: Path) -> bool:
    """Whether some holder has ``path``'s lock; tested without taking it (``F_OFD_GETLK``)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        return _whole_file(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK) != fcntl.F_UNLCK
    finally:
        os.close(fd)


def _record(fd: int, **more: object) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S"), **more}).encode(), 0)


def _job() -> str | None:
    """The torchrun job this process is a rank of (None outside torchrun). Under torchrun every
    rank runs ``odcfn train`` itself and rank 0 takes the run's lock while its peers may already
    hold their rank locks: those belong to this job, not to an earlier run."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or "MASTER_PORT" not in env:
        return None
    return f"torchrun {env.get('MASTER_ADDR', '')}:{env['MASTER_PORT']} {env['TORCHELASTIC_RUN_ID']}"


def _held_rank_locks(root: Path) -> list[Path]:
    """Rank locks held by a process of another run (or whose holder has not said yet)."""
    held, job = [], _job()
    for path in sorted(root.glob(f"{LOCK_NAME}.rank*")):
        if not _is_locked(path):
            continue
        try:
            mine = job is not None and json.loads(path.read_bytes()[:4096] or b"{}").get("job") == job
        except (ValueError, OSError, AttributeError):
            mine = False  # a record being written: wait for it
        if not mine:
            held.append(path)
    return held


class RunLock:
    """``with RunLock(out_dir):`` — exclusive use of ``out_dir`` for this process and its ranks."""

    def __init__(self, out_dir: str | os.PathLike, *, wait_ranks: float = 10.0) -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self.wait_ranks = wait_ranks
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _try_lock(self.path)
        if fd is None:
            with open(self.path, "rb") as f:
                holder = _describe(f.read(4096))
            raise RunDirLocked(
                f"out_dir {self.path.parent} is in use by another odcfn train run ({holder}); "
                "wait for it to finish, stop it, or give this run another out_dir (--out-dir)"
            )
        # ranks of an earlier run whose launcher died are being killed with it: give them a moment
        t_end = time.monotonic() + self.wait_ranks
        while (held := _held_rank_locks(self.path.parent)) and time.monotonic() < t_end:
            time.sleep(0.2)
        if held:
            os.close(fd)
            who = "; ".join(f"{p.name}: {_describe(p.read_bytes()[:4096])}" for p in held)
            raise RunDirLocked(
                f"out_dir {self.path.parent} is in use by rank processes of another odcfn train run "
                f"({who}); stop them, or give this run another out_dir (--out-dir)"
            )
        _record(fd)  # ours (a dead holder's lock is taken over): record who holds it
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock; the file stays (harmless)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class RankLock(RunLock):
    """``with RankLock(out_dir, rank):`` — held by one rank process for as long as it runs, so
    the directory stays in use while any process of the run lives (the launcher holds
    ``RunLock``, which checks these before it lets a new run in)."""

    def __init__(self, out_dir: str | os.PathLike, rank: int) -> None:
        super().__init__(out_dir)
        self.path = Path(out_dir) / f"{LOCK_NAME}.rank{rank}"
        self.rank = rank

    def acquire(self) -> RankLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = _try_lock(self.path)
        if fd is None:
            raise RunDirLocked(
                f"out_dir {self.path.parent}: rank {self.rank} of another odcfn train run "
                f"({_describe(self.path.read_bytes()[:4096])}) still runs in it; stop it first"
            )
        _record(fd, rank=self.rank, job=_job())
        self._fd = fd
        return self


def _describe(raw: bytes) -> str:
    try:
        doc = json.loads(raw or b"{}")
        return f"pid {doc['pid']} on host {doc['host']}, started {doc['started']}"
    except (ValueError, KeyError, OSError, TypeError):
        return "a run that has not yet recorded its pid"
