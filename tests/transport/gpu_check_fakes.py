"""Rank targets for tests/transport/test_gpu_check.py: fake GPU-check ranks in the shape of the
real rank mains (``target(rank, world, port, *args, queue)``), for the parent's handling of
failed, silent, hung and wrong ranks.

This module imports nothing heavy, torch least of all: each spawned rank imports it, and a rank
that imports torch costs seconds of CPU while testing nothing about torch."""

from __future__ import annotations

import time
import traceback


def rank_1_raises(rank, world, port, q):
    try:
        if rank == 1:
            raise ValueError("planted")
        q.put((rank, "grads", None, {"rank": rank}))
    except BaseException:  # noqa: BLE001
        q.put((rank, "grads", traceback.format_exc(), None))


def silent(rank, world, port, q):
    time.sleep(120)


def phases_then_hang(rank, world, port, q):  # answers "init", then never "put_signal"
    q.put((rank, "init", None, {"arena_bytes": 1}))
    time.sleep(120)


def raises(rank, world, port, q):
    try:
        raise RuntimeError("cudaIpcOpenMemHandle: invalid device context")
    except BaseException:  # noqa: BLE001
        q.put((rank, "ipc", traceback.format_exc(), None))


def wrong(rank, world, port, q):
    q.put((rank, "head", None, {"bad": ["fp32: worst relative error 1e-2"]}))


def fine(rank, world, port, q):
    q.put((rank, "ipc", None, {"device": f"cpu:{rank}"}))
