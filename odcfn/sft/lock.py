"""One run per output directory: ``odcfn train`` holds ``<out_dir>/.odcfn-run.lock`` while it
runs, so a second run into the same directory stops before it touches a checkpoint or a log,
with an error that names the run holding it.

The lock is an advisory ``flock`` on that file, held by the launcher's process: the kernel drops
it when that process exits in any way (``kill -9`` included), so the lock of a dead run is
simply taken over; the pid/host written inside only say who holds it."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

__all__ = ["LOCK_NAME", "RunDirLocked", "RunLock"]

LOCK_NAME = ".odcfn-run.lock"


class RunDirLocked(RuntimeError):
    """Another live run holds the output directory."""


class RunLock:
    """``with RunLock(out_dir):`` — exclusive use of ``out_dir`` for this process."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.path = Path(out_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _describe(fd)
            os.close(fd)
            raise RunDirLocked(
                f"out_dir {self.path.parent} is in use by another odcfn train run ({holder}); "
                "wait for it to finish, stop it, or give this run another out_dir (--out-dir)"
            ) from None
        # ours (a dead holder's lock is taken over): record who holds it
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (harmless)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe(fd: int) -> str:
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {doc['pid']} on host {doc['host']}, started {doc['started']}"
    except (ValueError, KeyError, OSError, TypeError):
        return "a run that has not yet recorded its pid"
