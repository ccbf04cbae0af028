"""How the ranks of one ``odcfn.save`` meet through the file system and commit atomically.

Every rank writes into one hidden staging directory next to the checkpoint (its name is the
save's ``attempt``, which every rank computes alike), plus an ``.alive-R`` file (host, pid). Rank
0 renames the complete directory into place (exchanging it with an existing checkpoint when
overwriting, so there is no moment without one). While waiting, a rank watches its peers: an
``.abort-R`` file (a peer failed and says why), a peer's pid gone (same host), the staging
directory gone (a peer gave up); each ends the wait at once instead of at the timeout. A rank
that gives up leaves its reason, waits (boundedly) until every peer has arrived and can read it,
and removes the staging directory; a rank that gives up because a peer did leaves both to that
peer, so that a late rank never creates the directory afresh and waits for nobody.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from odcfn.transport.shm_sync import pid_alive

__all__ = ["CheckpointError", "Staging", "fsync_path", "list_quietly"]

_POLL = 0.01
_PROBE = 0.05  # liveness probes: often enough to notice a death within ~0.1 s
_LINGER = 0.2  # how long a failing rank leaves its reason for the others to read, once they are here
_ARRIVAL = 5.0  # at most this long (or the save timeout) it waits for late peers to arrive first


class CheckpointError(ValueError):
    """A checkpoint is invalid, or a save did not complete; the message names the path."""


class Staging:
    def __init__(
        self, root: Path, attempt: str, rank: int, timeout: float, ranks: Sequence[int] = ()
    ) -> None:
        """``ranks``: every rank taking part in the save (a failing rank waits for them to arrive
        so that they read its reason instead of waiting out the timeout)."""
        self.root, self.rank, self.timeout, self.attempt = root, rank, float(timeout), attempt
        self.ranks = tuple(ranks)
        self.peer_gave_up = False  # we give up because a peer did: that peer tells the others
        self.dir = root.with_name(f".{root.name}.tmp-{attempt}")
        root.parent.mkdir(parents=True, exist_ok=True)
        if rank == 0:  # leftovers of saves that died before they could clean up
            for old in list_quietly(root.parent, f".{root.name}.tmp-*"):
                if old != self.dir:
                    shutil.rmtree(old, ignore_errors=True)
        self.dir.mkdir(exist_ok=True)
        self._host = socket.gethostname()
        alive = self.dir / f".alive-{rank}"
        tmp = alive.with_name(f"{alive.name}.{os.getpid()}.{time.monotonic_ns()}")
        tmp.write_text(f"{self._host} {os.getpid()}")
        os.replace(tmp, alive)

    def _problem(self, watch: Sequence[int]) -> str | None:
        gone = f"the staging directory {self.dir} disappeared (committed, or a peer gave up the save)"
        try:
            # listed at once: rank 0's commit (a rename) or a peer's abort (rmtree) may remove the
            # directory between a check and a lazy listing, which then raises FileNotFoundError
            notes = sorted(self.dir.glob(".abort-*")) if self.dir.is_dir() else None
        except OSError:
            notes = None
        if notes is None:
            self.peer_gave_up = True
            return gone  # the caller asks missing() again: after a commit nothing is missing
        for f in notes:
            self.peer_gave_up = True
            try:
                return f"rank {f.name.removeprefix('.abort-')} failed: {f.read_text()}"
            except OSError:
                return f"rank {f.name.removeprefix('.abort-')} failed"
        for r in watch:
            if r == self.rank:
                continue
            try:
                host, pid = (self.dir / f".alive-{r}").read_text().split()
            except (OSError, ValueError):
                continue  # not started yet, or already committed: nothing to say
            if host == self._host and not pid_alive(int(pid)):
                return f"rank {r} (pid {pid}) died during the save"
        return None

    def wait(self, missing: Callable[[], list[int]], describe: Callable[[list[int]], str],
             watch: Sequence[int]) -> None:
        """Until ``missing()`` is empty; ``describe(missing)`` says what was awaited."""
        deadline = time.monotonic() + self.timeout
        next_probe = 0.0
        while m := missing():
            now = time.monotonic()
            if now >= next_probe:
                next_probe = now + _PROBE
                if (why := self._problem(watch)) is not None and (m := missing()):
                    raise CheckpointError(f"checkpoint {self.root}: gave up waiting for {describe(m)}: {why}")
            if now > deadline:
                raise TimeoutError(f"checkpoint: timed out after {self.timeout}s waiting for {describe(m)}")
            time.sleep(_POLL)

    def commit(self, overwrite: bool) -> None:
        for f in list_quietly(self.dir, ".alive-*"):
            f.unlink(missing_ok=True)
        fsync_path(self.dir)
        if self.root.is_dir() and any(self.root.iterdir()):
            if not overwrite:
                raise FileExistsError(f"checkpoint: {self.root} appeared during the save (not replaced)")
            if not _exchange(self.dir, self.root):
                old = self.root.with_name(f"{self.dir.name}.old")
                os.rename(self.root, old)
                os.rename(self.dir, self.root)
                self.dir = old
            shutil.rmtree(self.dir, ignore_errors=True)  # now the previous checkpoint
        else:
            os.rename(self.dir, self.root)  # replaces an empty directory
        fsync_path(self.root.parent)

    def abort(self, why: str) -> None:
        """Leave our reason for the peers, give them time to read it, remove the staging dir.
        A rank that gives up because a peer did (its note, the directory gone) leaves both to
        that peer: removing the directory early would let a late rank create it afresh and wait
        for the timeout, never seeing the note."""
        if self.peer_gave_up:
            return
        try:
            if self.dir.is_dir():
                # written aside and renamed: a peer that lists the note must read all of it,
                # never the empty file write_text creates before it writes
                tmp = self.dir / f".note-{self.rank}.{os.getpid()}"
                tmp.write_text(why)
                os.replace(tmp, self.dir / f".abort-{self.rank}")
                self._linger()
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def _linger(self) -> None:
        """Until every other rank of the save is here (its ``.alive-R`` or ``.abort-R``: it reads
        our note at its next probe), at most ``min(timeout, _ARRIVAL)``; then ``_LINGER``."""
        others = [r for r in self.ranks if r != self.rank]
        deadline = time.monotonic() + min(self.timeout, _ARRIVAL)
        while others and time.monotonic() < deadline and self.dir.is_dir():
            if all(any((self.dir / f".{kind}-{r}").exists() for kind in ("alive", "abort")) for r in others):
                break
            time.sleep(_POLL)
        time.sleep(_LINGER)


def list_quietly(where: Path, pattern: str) -> list[Path]:
    """``where.glob(pattern)`` as a list, empty if ``where`` is gone. Peers and restarts remove
    checkpoint files concurrently (commit renames, aborts, pruning): a listing may name a file that
    is gone by the time it is read, so callers treat every listed path as possibly vanished."""
    try:
        return sorted(where.glob(pattern))
    except OSError:  # FileNotFoundError/NotADirectoryError: the directory went away mid-listing
        return []


def fsync_path(path: Path) -> None:
    """Data (of a file) or entries (of a directory) on disk before a rename publishes them (a
    crash then leaves the old name or the whole new file, never a truncated one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")
