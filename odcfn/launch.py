"""Start W local ranks with the torchrun environment and collect their results.

``launch(fn, W, args=...)`` spawns W processes (the ``spawn`` start method: ``fork`` after torch
started its OpenMP threads can hang the child). Rank ``r`` runs ``fn(*args)`` with RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free port) set, so the
same ``fn`` runs unchanged under ``torchrun --nproc-per-node W``. The environment is set before
the child interpreter starts, so it also reaches variables read at import (OMP_NUM_THREADS).

If a rank raises or dies, the others get ``timeout`` seconds to notice (transports raise
``TransportError`` within their own timeout) and are then terminated; ``LaunchError`` names the
first failure and carries every rank's outcome. Afterwards any /dev/shm file of this job (a rank
killed while setting up its segment) is removed.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from odcfn.kernels._shm_sync import shm_dir

__all__ = ["LaunchError", "free_port", "launch", "rank_env"]

_ENV_LOCK = threading.Lock()


class LaunchError(RuntimeError):
    """A rank failed. ``errors``: rank -> description (exception or exit code) for every failed
    rank; ``results``: rank -> result for ranks that returned."""

    def __init__(self, message: str, errors: dict[int, str], results: dict[int, Any]) -> None:
        super().__init__(message)
        self.errors, self.results = errors, results


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, shm_prefix: str) -> dict[str, str]:
    """The torchrun variables for ``rank`` of a single-node job, plus our shm name prefix."""
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "ODCFN_SHM_PREFIX": shm_prefix,
    }


def _send(conn: Connection, msg: tuple) -> None:
    # plain pickle, not the Connection's ForkingPickler: torch registers reductions there that
    # pass tensors as shared-memory handles, which die with this process before the parent reads
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _child(fn: Callable[..., Any], args: tuple, conn: Connection) -> None:
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit non-zero
        text = "".join(traceback.format_exception(e))
        try:
            _send(conn, ("error", f"{type(e).__name__}: {e}", text))
        finally:
            os._exit(1)
    try:
        _send(conn, ("ok", result, ""))
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable result
        _send(conn, ("error", f"could not send the result back: {type(e).__name__}: {e}", ""))
        os._exit(1)


def sweep_shm(prefix: str) -> list[str]:
    """Remove this job's leftover shared-memory files; return what was removed."""
    gone = []
    for path in glob.glob(os.path.join(shm_dir(), glob.escape(prefix) + "*")):
        try:
            os.unlink(path)
            gone.append(path)
        except FileNotFoundError:
            pass
    return gone


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes; return the results by rank.

    ``timeout``: how long the surviving ranks get to exit after the first failure before they
    are terminated (a healthy job may run as long as it needs). ``env``: extra environment.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    extra = dict(env or {})
    bad = [k for k, v in extra.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"env must map str to str; bad entries for {bad}")
    ctx = mp.get_context("spawn")
    port, prefix = free_port(), f"odcfn-{uuid.uuid4().hex[:8]}"
    procs, conns = [], []
    try:
        for r in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, tuple(args), child), name=f"odcfn-rank{r}", daemon=True)
            with _ENV_LOCK:  # the child inherits os.environ as it is at start()
                saved = dict(os.environ)
                os.environ.update({**rank_env(r, world_size, port, prefix), **extra})
                try:
                    p.start()
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
            child.close()
            procs.append(p)
            conns.append(parent)
        results, errors = _collect(procs, conns, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        sweep_shm(prefix)
    if errors:
        first = min(errors, key=lambda r: (errors[r][0], r))
        detail = "\n".join(f"  rank {r}: {errors[r][1]}" for r in sorted(errors))
        tbs = "".join(f"\n--- rank {r} traceback ---\n{errors[r][2]}" for r in sorted(errors) if errors[r][2])
        raise LaunchError(
            f"rank {first} failed: {errors[first][1]}\nall failures:\n{detail}{tbs}",
            {r: e[1] for r, e in errors.items()}, results,
        )
    return [results[r] for r in range(world_size)]


def _collect(procs: list, conns: list[Connection], grace: float) -> tuple[dict, dict]:
    """Wait for every rank's message or death. errors: rank -> (time, text, traceback).

    Only the pipes are watched: a rank's pipe turns readable with its message or, when the
    process dies (the child held the only write end), with end-of-file.
    """
    results: dict[int, Any] = {}
    errors: dict[int, tuple[float, str, str]] = {}
    live = {c: r for r, c in enumerate(conns)}
    deadline = None
    while live:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(live), timeout=left)
        if not ready:  # the grace period after the first failure is over
            first = min(errors, key=lambda k: errors[k][0])
            for r in sorted(live.values()):
                why = f"terminated: still running {grace}s after rank {first} failed"
                errors[r] = (time.monotonic(), why, "")
                procs[r].kill()
            break
        for conn in ready:
            r = live.pop(conn)
            try:
                kind, payload, tb = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                procs[r].join(5.0)
                code = procs[r].exitcode
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                errors[r] = (time.monotonic(), f"died without a result ({why})", "")
                continue
            if kind == "ok":
                results[r] = payload
            else:
                errors[r] = (time.monotonic(), payload, tb)
        if errors and deadline is None:
            deadline = time.monotonic() + grace
    return results, errors
