"""Saving without stopping training: snapshot to host memory now, write and commit in the background.

``odcfn.save(path, state, blocking=False)`` (or ``AsyncSaver.save``) returns as soon as this
rank's shards are copied into a staging snapshot in host memory (pinned when the state lives on
a GPU, so the device-to-host copy runs at full speed): the params, the optimizer state, the
step and the caller's ``extra`` (data position, RNG). A background thread then writes the
snapshot with the blocking path's guarantees (``sharded.write_shards``: per-file sha256, a
staging directory committed by rank 0 with an atomic rename once every rank's file is there, the
file system as the barrier). Training may change the state meanwhile: the snapshot is a copy.

At most one save is in flight per saver: the next ``save`` first waits for the previous one.
A failed background write (disk full, a peer that died mid-save) is never lost: it is raised by
the next ``save``, by ``wait()``, and, if nobody asked, reported on stderr at interpreter exit
with a non-zero exit status. A failed save leaves no staging files and never touches an
earlier committed checkpoint (each save commits a new directory, or exchanges atomically).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from odcfn.checkpoint.kill_point import kill_point
from odcfn.tree import tree_map

__all__ = ["AsyncSaver", "default_saver", "snapshot_tree"]


def snapshot_tree(tree: Any) -> Any:
    """``tree`` with every tensor copied to host memory (pinned for CUDA tensors; one device
    synchronisation at the end, not one per tensor); other leaves as they are."""
    cuda = []

    def copy(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.detach()
        if x.device.type == "cuda":
            out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            out.copy_(x, non_blocking=True)
            cuda.append(x.device)
            return out
        return x.clone(memory_format=torch.contiguous_format)

    out = tree_map(copy, tree)
    for dev in set(cuda):
        torch.cuda.synchronize(dev)
    return out


class AsyncSaver:
    """One rank's background checkpoint writer: ``save`` returns after the host snapshot,
    ``wait`` returns the committed path (or raises the write's error). Every rank of a job must
    make the same sequence of saves (as with the blocking ``odcfn.save``)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Path | None = None
        self._what = ""
        self.blocked_s = 0.0  # time the caller spent in save() (waiting + snapshotting), summed
        self.written_s = 0.0  # time the background writes took, summed

    def save(
        self,
        path: str | os.PathLike,
        params: Mapping[str, torch.Tensor],
        opt_state: Any,
        step: int,
        *,
        model: Any,
        mesh: Any,
        extra: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        timeout: float = 60.0,
        after: Callable[[Path], None] | None = None,
        writer: Callable[..., Path] | None = None,
        feedback: Any = None,
    ) -> None:
        """Snapshot ``(params, opt_state, step)`` now; write ``path`` in the background, then
        call ``after(path)`` there (e.g. verify and publish, prune older checkpoints); an error
        of ``after`` is the save's error. ``writer``: what writes and commits (default
        ``sharded.write_shards``; the memory tier across nodes passes ``NodeTier.write``).
        ``feedback``: this rank's error-feedback residuals (``sharded.Feedback``), snapshotted too."""
        from odcfn.checkpoint import sharded

        t0 = time.perf_counter()
        self.wait_or_give_up(path, step, mesh, timeout)  # one in flight; an earlier failure surfaces here
        root = Path(path)
        if root.exists() and not overwrite and (not root.is_dir() or any(root.iterdir())):
            # bad input fails at the call, not in the background
            raise FileExistsError(f"checkpoint: {root} exists; pass overwrite=True to replace it")
        snap_params = snapshot_tree(dict(params))
        kill_point("snapshot", step, mesh.rank)  # tests only (ODCFN_TEST_KILL_AT)
        snap_opt = snapshot_tree(opt_state)
        # the residuals change with the next push: a copy, as the shards
        more = {} if feedback is None else {"feedback": feedback._replace(
            residuals=snapshot_tree(dict(feedback.residuals)))}
        extra = dict(extra or {})
        what = f"checkpoint {os.fspath(path)} (step {step})"

        def write() -> None:
            w0 = time.perf_counter()
            try:
                self._result = (writer or sharded.write_shards)(
                    path, snap_params, snap_opt, step, model=model, mesh=mesh, extra=extra,
                    timeout=timeout, overwrite=overwrite, **more,
                )
                if after is not None:
                    after(self._result)
            except BaseException as e:  # noqa: BLE001 - kept for the next call, never dropped
                self._error = e
            finally:
                self.written_s += time.perf_counter() - w0

        self._what, self._result = what, None
        self._thread = threading.Thread(target=write, name="odcfn-async-save", daemon=True)
        self._thread.start()
        _LIVE.add(self)
        self.blocked_s += time.perf_counter() - t0

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is committed; return its path, or raise the
        background write's error (once)."""
        t = self._thread
        if t is not None:
            t.join()
            self._thread = None
        _LIVE.discard(self)
        err, self._error = self._error, None
        if err is not None:
            why = f"{type(err).__name__}: {err}"
            raise RuntimeError(f"the background save of {self._what} failed: {why}") from err
        return self._result

    close = wait

    def wait_or_give_up(self, path: str | os.PathLike, step: int, mesh: Any, timeout: float = 60.0) -> None:
        """``wait()`` before the save of ``(path, step)``; if the save in flight failed, this
        rank will not make that next save: its peers, which are starting it, are told why at
        once (instead of waiting for this rank until the timeout), then the error is raised."""
        try:
            self.wait()
        except RuntimeError as e:
            if mesh.world_size > 1:
                from odcfn.checkpoint.sharded import give_up

                give_up(path, step, mesh, f"its previous save failed: {e}", timeout)
            raise


_DEFAULT: dict[tuple[int, int], AsyncSaver] = {}
_LIVE: set[AsyncSaver] = set()


def default_saver(mesh: Any) -> AsyncSaver:
    """The saver behind ``odcfn.save(..., blocking=False)`` for this rank of ``mesh`` (one per
    rank: in-process ranks are threads of one process)."""
    return _DEFAULT.setdefault((mesh.world_size, mesh.rank), AsyncSaver())


@atexit.register
def _finish_at_exit() -> None:
    """A save still in flight at exit is finished; a failure nobody collected is reported."""
    failed = False
    for saver in list(_LIVE):
        try:
            saver.wait()
        except RuntimeError as e:
            failed = True
            print(f"odcfn: {e}", file=sys.stderr, flush=True)
    if failed:
        sys.stdout.flush()
        os._exit(1)  # noqa: SLF001 - the process would otherwise exit 0 with a lost checkpoint
