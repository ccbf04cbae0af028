"""Named crash points for the recovery tests: off unless ``ODCFN_TEST_KILL_AT`` is set.

A random SIGKILL lands mostly in compute; the phases a recovery must survive (a save half
snapshotted, a rank's file written but not committed, rank 0 between its manifest and the
rename that commits) are short. ``ODCFN_TEST_KILL_AT`` names them::

    ODCFN_TEST_KILL_AT="PHASE:STEP:RANK[@RESTART],..."     e.g. "commit:3:0,write:6:2@1"

Rank ``RANK`` SIGKILLs itself when it reaches ``PHASE`` of step ``STEP`` in the incarnation
whose ``TORCHELASTIC_RESTART_COUNT`` is ``RESTART`` (default 0; set by torchrun and
``odcfn.launch``), so the restarted job does not die at the same place again. Phases:

- ``step``: at the start of step ``STEP`` (``STEP - 1`` steps done; the peers are inside the
  step, waiting for this rank's contributions).
- ``snapshot``: in an asynchronous save of step ``STEP``, between the host copies of the params
  and of the optimizer state.
- ``write``: in a save of step ``STEP``, once this rank's file is in the staging directory and
  before the checkpoint is committed.
- ``commit``: rank 0: the manifest is in the staging directory, the rename that commits is next;
  another rank: rank 0 has committed, the save has not returned yet.

A step with a disk and a memory-tier save dies in whichever reaches the phase first.
"""

from __future__ import annotations

import functools
import os
import signal

__all__ = ["PHASES", "kill_point"]

PHASES = ("step", "snapshot", "write", "commit")
VAR = "ODCFN_TEST_KILL_AT"


@functools.lru_cache(maxsize=8)
def _points(spec: str) -> frozenset[tuple[str, int, int, int]]:
    out = set()
    for item in filter(None, (x.strip() for x in spec.split(","))):
        head, _, restart = item.partition("@")
        parts = head.split(":")
        if len(parts) != 3 or parts[0] not in PHASES or not all(
            p.isdigit() for p in (*parts[1:], restart or "0")
        ):
            raise ValueError(
                f"{VAR}={spec!r}: {item!r} is not PHASE:STEP:RANK[@RESTART] with PHASE one of {PHASES}"
            )
        out.add((parts[0], int(parts[1]), int(parts[2]), int(restart or 0)))
    return frozenset(out)


def kill_point(phase: str, step: int, rank: int) -> None:
    """SIGKILL this process if ``ODCFN_TEST_KILL_AT`` names ``(phase, step, rank)`` for this
    incarnation; otherwise (always, unless the variable is set) return at once."""
    spec = os.environ.get(VAR)
    if not spec:
        return
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if (phase, step, rank, restart) in _points(spec):
        os.kill(os.getpid(), signal.SIGKILL)
