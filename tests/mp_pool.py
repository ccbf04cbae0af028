"""A session-wide pool of ready worker processes for the multi-process tests.

Spawning a rank costs seconds (importing torch); a hypothesis test that spawned W ranks per
example would take minutes. The pool spawns up to 4 workers once and reuses them: ``run(fn, W)``
hands ``fn(*args)`` to workers 0..W-1 with a fresh torchrun environment (new MASTER_PORT, a new
/dev/shm name prefix), so the same worker functions also run under ``odcfn.launch`` and torchrun.
After each task a worker destroys the default process group it may have created; a worker that
died or timed out is replaced.

Use it through the session fixture: ``tests/conftest.py`` does ``from tests.mp_pool import
mp_pool`` (and may call ``warm_for(items)`` from ``pytest_collection_modifyitems`` to start the
workers while earlier tests run). The pool itself is a process-wide singleton (``get_pool``),
so importing the fixture in several places never starts a second pool.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import pytest

from odcfn.launch import LaunchError, free_port, rank_env, sweep_shm

__all__ = ["WorkerPool", "get_pool", "mp_pool", "warm_for"]


class _Output:
    """This worker's stdout and stderr during one task, caught at the file descriptors (so
    that native code's writes are caught too), as a test's ``capfd`` would for its own process."""

    def __enter__(self) -> _Output:
        sys.stdout.flush()
        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        self.text = ""
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), self.saved):
            os.dup2(saved, fd)
            os.close(saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        self.file.close()


def _serve(conn: Connection) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    conn.send_bytes(b"ready")  # imports done: tasks now start within milliseconds of each other
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not msg:
            return
        saved = dict(os.environ)
        out = None
        try:
            fn, args, env, capture = pickle.loads(msg)
            os.environ.update(env)
            if capture:
                with _Output() as out:
                    result = fn(*args)
            else:
                result = fn(*args)
            reply = ("ok", result, "")
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            reply = ("error", f"{type(e).__name__}: {e}", "".join(traceback.format_exception(e)))
        finally:
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a broken group: nothing left to release
                    pass
            os.environ.clear()
            os.environ.update(saved)
        reply = (*reply, out.text if out is not None else None)
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - an unpicklable result
            data = pickle.dumps(("error", f"unpicklable result: {e}", "", reply[3]))
        conn.send_bytes(data)


class WorkerPool:
    def __init__(self, max_workers: int = 4) -> None:
        self.max_workers = max_workers
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._ready: list[bool] = []

    def _spawn(self, i: int) -> None:
        parent, child = self._ctx.Pipe()
        env = dict(os.environ)
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            p = self._ctx.Process(target=_serve, args=(child,), name=f"odcfn-pool-{i}", daemon=True)
            p.start()
        finally:
            os.environ.clear()
            os.environ.update(env)
        child.close()
        if i < len(self._procs):
            self._procs[i], self._conns[i], self._ready[i] = p, parent, False
        else:
            self._procs.append(p)
            self._conns.append(parent)
            self._ready.append(False)

    def start(self) -> None:
        """Spawn every worker now without waiting for them (their imports run meanwhile)."""
        while len(self._procs) < self.max_workers:  # all at once: their imports overlap
            self._spawn(len(self._procs))

    def _wait_ready(self, i: int, timeout: float) -> None:
        """A task must not start on one rank while another is still importing torch: the
        first would spend its (maybe short) communication timeout waiting for the second."""
        if self._ready[i]:
            return
        try:
            ok = self._conns[i].poll(timeout) and self._conns[i].recv_bytes() == b"ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            self._replace(i)
            raise RuntimeError(f"pool worker {i} did not start within {timeout}s")
        self._ready[i] = True

    def _replace(self, i: int) -> None:
        p = self._procs[i]
        if p.is_alive():
            p.kill()
        p.join()
        self._conns[i].close()
        self._spawn(i)

    def run(
        self, fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (), timeout: float = 120.0,
        env: Mapping[str, str] | None = None, output: dict[int, str] | None = None,
    ) -> list[Any]:
        """``fn(*args)`` on ranks 0..world_size-1; results by rank, or ``LaunchError``. ``env``:
        extra variables for this task (the torchrun variables win), e.g. a restarted job's
        ``TORCHELASTIC_RESTART_COUNT``; a worker's environment is restored after each task.
        ``output``: filled with what each rank that answered wrote to stdout and stderr
        (the workers' output otherwise goes where the pool's start left it, out of ``capfd``'s
        reach)."""
        if not 1 <= world_size <= self.max_workers:
            raise ValueError(f"world_size={world_size} outside the pool's 1..{self.max_workers}")
        self.start()
        for r in range(world_size):
            self._wait_ready(r, timeout)
        port, prefix = free_port(), f"odcfn-pool-{uuid.uuid4().hex[:8]}"
        for r in range(world_size):
            task_env = {**(env or {}), **rank_env(r, world_size, port, prefix)}
            msg = (fn, tuple(args), task_env, output is not None)
            self._conns[r].send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        live = {self._conns[r]: r for r in range(world_size)}
        deadline = time.monotonic() + timeout
        try:
            while live:
                ready = wait(list(live), timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    for r in sorted(live.values()):
                        errors[r] = f"no answer within {timeout}s (worker replaced)"
                        self._replace(r)
                    break
                for conn in ready:
                    r = live.pop(conn)
                    try:
                        kind, payload, tb, text = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        self._procs[r].join(5.0)
                        errors[r] = f"worker died (exit code {self._procs[r].exitcode})"
                        self._replace(r)
                        continue
                    if output is not None and text is not None:
                        output[r] = text
                    if kind == "ok":
                        results[r] = payload
                    else:
                        errors[r] = f"{payload}\n{tb}"
        finally:
            sweep_shm(prefix)
        if errors:
            first = min(errors)
            raise LaunchError(f"rank {first} failed: {errors[first]}", errors, results)
        return [results[r] for r in range(world_size)]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns = [], []


_POOL: WorkerPool | None = None


def get_pool() -> WorkerPool:
    global _POOL
    if _POOL is None:
        _POOL = WorkerPool()
        atexit.register(_POOL.close)
    return _POOL


def warm_for(items: Sequence[Any]) -> None:
    """Start the pool early if any collected test uses it, so the workers import torch while
    the earlier tests run: call from ``pytest_collection_modifyitems(session, config, items)``."""
    if any("mp_pool" in getattr(item, "fixturenames", ()) for item in items):
        get_pool().start()


@pytest.fixture(scope="session")
def mp_pool() -> WorkerPool:
    return get_pool()
