"""A rank dies with its launcher: ``die_with_parent(pid)``, called first thing in a spawned rank.

A rank left running after its launcher was killed (``kill -9``: no cleanup runs) trains on alone,
writing checkpoints and metrics into a directory whose lock went with the launcher, so a rerun
would train into it at the same time. Two mechanisms, so that neither has to be perfect:

- Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel kills the rank
  the moment its parent exits, whatever killed the parent. SIGKILL, not SIGTERM: a rank blocked
  in a wait or in native code would not run a Python handler soon, and everything a rank writes
  is crash-safe already (checkpoints commit atomically, shm files are unlinked once mapped).
  Caveat: the signal follows the *thread* that spawned the rank; ``odcfn.launch`` spawns and
  waits in one thread, so the two end together.
- A watcher thread that polls the parent pid (every 0.5 s; sleeping, so it costs the GIL
  nothing): the fallback where prctl is missing (macOS) or a parent's exit was not seen.

The parent's pid is passed in, not read with ``os.getppid()`` here, so a rank whose launcher
died while the rank was still starting (before the prctl) notices and exits too.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent", "parent_death_signal"]

_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; False where
    unsupported (not Linux, or libc without prctl)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int, poll: float) -> None:
    while True:
        time.sleep(poll)
        if os.getppid() != parent:  # re-parented: the launcher is gone
            _die()


def die_with_parent(parent: int, *, poll: float = 0.5) -> None:
    """End this process (SIGKILL) when process ``parent`` exits, or now if it already has."""
    parent_death_signal()
    if os.getppid() != parent:  # the parent exited before the prctl could take effect
        _die()
    threading.Thread(target=_watch, args=(parent, poll), name="odcfn-parent-watch", daemon=True).start()
