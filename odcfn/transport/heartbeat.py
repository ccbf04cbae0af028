"""A busy peer is not a dead peer: waits measure their timeout from a peer's last *progress*.

A rank that computes one long sample can keep its peers waiting (in ``flush``, for a published
shard, at the sync) far longer than ``timeout`` while being perfectly healthy. So each rank
keeps a progress counter that its peers can read (a word of its shared-memory ``ctrl`` for
``ShmTransport``, a list entry for the threads of a ``LocalWorld``), and a waiting rank's
deadline is ``timeout`` seconds after the last time it saw a peer's counter move.

The choice: the counter is bumped by the compute path — the executor after every step of the
rank's plan (a unit's forward or backward of one microbatch, a gather, a push), through
``transport.beat()`` — not by a timer thread. A thread keeps beating while the rank's main
thread is deadlocked or stuck in a wait of its own, which would turn every stuck job into a
hang; a counter that only moves when the plan moves cannot. The price: one plan step (one unit
on one microbatch) must finish within ``timeout``, which is a far smaller thing than a whole
rank's minibatch. A rank that waits does not beat, so two ranks waiting on each other, or on a
rank that stopped, still time out; a dead process is seen at once (its pid) as before.

While it waits past ``timeout`` on a busy peer, the waiting rank says so on stderr every
``timeout`` seconds (what it waits for, how long, how much progress the peers made). "Busy"
means *recent* progress (within the last ``timeout / 2``), not progress since the wait began: a
peer that beat in the wait's first milliseconds and was then stopped (SIGSTOP) is not busy, and
a note due while the peers are quiet waits for their next beat (or the timeout)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

__all__ = ["Patience"]


class Patience:
    """The deadline of one wait: ``timeout`` seconds after the later of the wait's start and
    the last change of ``progress()`` (the peers' summed counters; None: a plain timeout)."""

    def __init__(self, timeout: float, what: str, progress: Callable[[], int] | None = None) -> None:
        self.timeout, self.what, self.progress = timeout, what, progress
        self.t0 = time.monotonic()
        self.deadline = self.t0 + timeout
        self.seen = progress() if progress is not None else 0
        self.beats = 0  # progress seen during this wait
        self.last = self.t0  # when progress was last seen
        self.next_note = self.deadline

    def expired(self) -> bool:
        """True once the peers made no progress for ``timeout`` seconds (call it now and then)."""
        now = time.monotonic()
        if self.progress is not None:
            value = self.progress()
            if value != self.seen:
                self.beats += value - self.seen
                self.seen, self.last, self.deadline = value, now, now + self.timeout
        if now < self.deadline and now >= self.next_note and now - self.last <= self.timeout / 2:
            self.next_note = now + self.timeout
            print(f"odcfn: still waiting for {self.what} after {now - self.t0:.0f}s: the peer is busy, "
                  f"not stuck (progress {now - self.last:.1f}s ago; {self.beats} plan steps of it "
                  "since the wait began)", file=sys.stderr, flush=True)
        return now >= self.deadline
