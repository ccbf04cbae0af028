"""Start W local ranks with the torchrun environment and collect their results.

``launch(fn, W, args=...)`` spawns W processes (the ``spawn`` start method: ``fork`` after torch
started its OpenMP threads can hang the child). Rank ``r`` runs ``fn(*args)`` with RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT set, so the
same ``fn`` runs unchanged under ``torchrun``; ``nodes=N`` lays the ranks out as N simulated
nodes of W/N ranks each (what a hybrid mesh reads). The environment is set before the child
interpreter starts, so it also reaches variables read at import (OMP_NUM_THREADS).

Like torchrun's agent, the launcher hosts the job's TCPStore itself (the ranks connect as
clients, ``TORCHELASTIC_USE_AGENT_STORE``): it binds MASTER_PORT before any rank starts, so a
second job forced onto the same port fails at once instead of its ranks joining this job's
store, and every rank checks the store's job id before running ``fn``. Each job also gets a
fresh ``ODCFN_JOB_SECRET`` (rendezvous values are authenticated with it, see kernels/rdzv.py).

If a rank raises or dies, or finishes while others still run, the rest get ``timeout`` seconds
(transports raise ``TransportError`` within their own timeout) and are then terminated as
unresponsive; ``deadline`` bounds the whole job. ``LaunchError`` names the likely cause first
(a rank that died, then one that was unresponsive, then one that raised, then ranks that only
reported a ``TransportError``) and carries every rank's outcome. Afterwards any /dev/shm file
of this job (a rank killed while setting up its segment) is removed. A rank never outlives its
launcher: killed in any way, the launcher takes its ranks with it (``odcfn.launch.orphan``).
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import pickle
import secrets
import socket
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

from odcfn._check import check_int, check_number
from odcfn.launch.orphan import die_with_parent
from odcfn.transport.shm_sync import shm_dir

__all__ = ["LaunchError", "check_job_store", "free_port", "host_store", "launch", "rank_env", "sweep_shm"]

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


def rank_env(
    rank: int, world_size: int, port: int, shm_prefix: str, *, nodes: int = 1
) -> dict[str, str]:
    """The torchrun variables for ``rank`` of a job of ``nodes`` equal nodes on this machine,
    plus our shm name prefix (one per job: the ShmTransport maps rank 0's segment from every
    node, so the simulated nodes share /dev/shm as they share the machine)."""
    local = world_size // nodes
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local),
        "GROUP_RANK": str(rank // local), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "ODCFN_SHM_PREFIX": shm_prefix,
    }


# what launch sets per rank; env= may not override them
RESERVED_ENV = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "ODCFN_SHM_PREFIX", "ODCFN_JOB_ID", "ODCFN_JOB_SECRET", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT", "ODCFN_LAUNCHER_PID",
)
_JOB_KEY = "odcfn/job_id"
_DIED, _UNRESPONSIVE, _RAISED, _TRANSPORT = range(4)  # how likely a failure is the cause


def host_store(port: int, job_id: str, timeout: float) -> Any:
    """The job's TCPStore server on ``port`` holding ``job_id`` (clear error if it is taken)."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            "127.0.0.1", port, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
    except (RuntimeError, OSError) as e:
        raise RuntimeError(
            f"launch: MASTER_PORT {port} is already in use (another job's store?); no rank was started: {e}"
        ) from None
    store.set(_JOB_KEY, job_id)
    return store


def check_job_store(addr: str, port: int, job_id: str, timeout: float = 30.0) -> None:
    """Refuse to run in a job whose store (at ``addr:port``) holds another job id."""
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, None, False, timeout=timedelta(seconds=timeout))
    got = store.get(_JOB_KEY).decode(errors="replace")
    if got != job_id:
        raise RuntimeError(
            f"the store at {addr}:{port} belongs to job {got!r}, not to this rank's job {job_id!r} "
            "(two jobs on one MASTER_PORT?): refusing to join it"
        )


def _send(conn: Connection, msg: tuple) -> None:
    # plain pickle, not the Connection's ForkingPickler: torch registers reductions there that
    # pass tensors as shared-memory handles, which die with this process before the parent reads
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _child(fn: Callable[..., Any], args: tuple, conn: Connection) -> None:
    die_with_parent(int(os.environ["ODCFN_LAUNCHER_PID"]))  # no rank outlives a killed launcher
    try:
        env = os.environ
        check_job_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), env["ODCFN_JOB_ID"])
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
    deadline: float | None = None,
    nodes: int = 1,
    env: Mapping[str, str] | None = None,
    max_restarts: int = 0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` local processes; return the results by rank.

    ``timeout``: how long the other ranks get to finish once one rank failed or finished
    before they are terminated as unresponsive (a healthy job may run as long as it needs).
    ``deadline``: seconds the whole job may take (None: no bound). ``nodes``: simulated nodes
    (``world_size`` must be a multiple). ``env``: extra environment (not the torchrun variables).
    ``max_restarts``: like ``torchrun --max-restarts``: when a rank fails, stop the others at
    once, clean up and start all ranks again (``TORCHELASTIC_RESTART_COUNT`` counts up; the
    store and job id stay), at most this many times; the last attempt's failure is raised.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    check_int(world_size, "world_size", at_least=1, want="a positive int")
    check_int(nodes, "nodes", at_least=1, want="a positive int")
    check_int(max_restarts, "max_restarts", at_least=0)
    if world_size % nodes:
        raise ValueError(f"world_size={world_size} is not a multiple of nodes={nodes}")
    seconds = "a positive number of seconds"
    check_number(timeout, "timeout", positive=True, finite=False, want=seconds)
    check_number(deadline, "deadline", positive=True, finite=False, none_ok=True, want=seconds)
    extra = dict(env or {})
    bad = [k for k, v in extra.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"env must map str to str; bad entries for {bad}")
    reserved = sorted(k for k in extra if k in RESERVED_ENV or k.startswith("TORCHELASTIC_"))
    if reserved:
        raise ValueError(f"env may not override the variables launch sets per rank: {reserved}")
    ctx = mp.get_context("spawn")
    job = uuid.uuid4().hex[:8]
    port, prefix = free_port(), f"odcfn-{job}"
    store = host_store(port, job, timeout)  # before any rank: a taken port fails here
    job_env = {
        "ODCFN_JOB_ID": job, "ODCFN_JOB_SECRET": secrets.token_hex(32),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
        "ODCFN_LAUNCHER_PID": str(os.getpid()),
    }
    t_end = None if deadline is None else time.monotonic() + deadline
    try:
        for attempt in range(max_restarts + 1):
            job_env["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
            more = attempt < max_restarts
            # with a restart to come, the survivors of a failure are stopped at once (torchrun's
            # agent does the same): they would only wait for the dead rank
            results, errors = _attempt(ctx, fn, args, extra, job_env, world_size, port, prefix, nodes,
                                       timeout, 0.0 if more else timeout, t_end, deadline)
            if not errors or not more or (t_end is not None and time.monotonic() >= t_end):
                break
            first = min(errors, key=lambda r: (errors[r][0], errors[r][1], r))
            print(f"odcfn.launch: rank {first} failed ({errors[first][2]}); restarting all ranks "
                  f"({attempt + 1}/{max_restarts})", file=sys.stderr, flush=True)
    finally:
        del store
    if errors:
        first = min(errors, key=lambda r: (errors[r][0], errors[r][1], r))
        detail = "\n".join(f"  rank {r}: {errors[r][2]}" for r in sorted(errors))
        tbs = "".join(f"\n--- rank {r} traceback ---\n{errors[r][3]}" for r in sorted(errors) if errors[r][3])
        raise LaunchError(
            f"rank {first} failed: {errors[first][2]}\nall failures:\n{detail}{tbs}",
            {r: e[2] for r, e in errors.items()}, results,
        )
    return [results[r] for r in range(world_size)]


def _attempt(ctx, fn, args, extra, job_env, world_size, port, prefix, nodes, grace, fail_grace, t_end,
             deadline):
    """Start every rank once and collect their outcomes; always kills leftovers and sweeps shm."""
    procs, conns = [], []
    try:
        for r in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, tuple(args), child), name=f"odcfn-rank{r}", daemon=True)
            with _ENV_LOCK:  # the child inherits os.environ as it is at start()
                saved = dict(os.environ)
                os.environ.update({**extra, **rank_env(r, world_size, port, prefix, nodes=nodes), **job_env})
                try:
                    p.start()
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
            child.close()
            procs.append(p)
            conns.append(parent)
        return _collect(procs, conns, grace, t_end, deadline, fail_grace)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        sweep_shm(prefix)


def _collect(
    procs: list, conns: list[Connection], grace: float, t_end: float | None, deadline: float | None,
    fail_grace: float | None = None,
) -> tuple[dict, dict]:
    """Wait for every rank's message or death. errors: rank -> (kind, time, text, traceback).
    The others get ``grace`` seconds once a rank ended (``fail_grace`` if it ended by failing).

    Only the pipes are watched: a rank's pipe turns readable with its message or, when the
    process dies (the child held the only write end), with end-of-file.
    """
    results: dict[int, Any] = {}
    errors: dict[int, tuple[int, float, str, str]] = {}
    live = {c: r for r, c in enumerate(conns)}
    t_grace = None  # set when the first rank ends, in whatever way
    t_first = 0.0
    while live:
        ends = [t for t in (t_grace, t_end) if t is not None]
        ready = wait(list(live), timeout=None if not ends else max(0.0, min(ends) - time.monotonic()))
        if not ready:
            done = sorted(set(range(len(procs))) - set(live.values()))
            if t_grace is not None and (t_end is None or t_grace <= t_end):
                why = (f"unresponsive: still running {t_grace - t_first:.1f}s after rank(s) {done} ended "
                       "(stopped, stuck, or waiting for a peer that left)")
            else:
                why = f"unresponsive: still running at the job's deadline of {deadline}s"
            for r in sorted(live.values()):
                errors[r] = (_UNRESPONSIVE, time.monotonic(), why, "")
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
                errors[r] = (_DIED, time.monotonic(), f"died without a result ({why})", "")
                continue
            if kind == "ok":
                results[r] = payload
            else:
                rank_kind = _TRANSPORT if str(payload).startswith("TransportError") else _RAISED
                errors[r] = (rank_kind, time.monotonic(), payload, tb)
        if t_grace is None:
            t_first = time.monotonic()
            failed = fail_grace is not None and errors
            t_grace = time.monotonic() + (fail_grace if failed else grace)
        elif fail_grace is not None and errors:
            t_grace = min(t_grace, time.monotonic() + fail_grace)
    return results, errors
