"""Transports re-created over and over in one process (notebooks, RL loops, a restarted job's
next incarnation): each default group gets a key space of the store no earlier one used, so
gloo never reads a dead incarnation's addresses. Ranks that disagree on what they map get the
disagreement named, on every rank alike."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import pytest
import torch

import odcfn
from odcfn.launch import LaunchError, free_port, host_store
from odcfn.models import QwenConfig, qwen_model
from odcfn.sharding import make_layout
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def rounds_worker(rounds: int, agent_port: int | None) -> list[float]:
    """Open a ShmTransport, publish and gather one unit, close it; ``rounds`` times."""
    if agent_port is not None:  # the store is the launcher's, outliving every group (torchrun)
        os.environ.update(MASTER_PORT=str(agent_port), TORCHELASTIC_USE_AGENT_STORE="True")
    model = qwen_model(CFG)
    mesh = odcfn.Mesh.from_env()
    layout = make_layout(model, mesh)
    unit = layout.units[0]
    seen = []
    for i in range(rounds):
        with ShmTransport(mesh, timeout=20) as tr:
            shards = {u.name: torch.full((u.shard_size,), float(100 * i + mesh.rank)) for u in layout.units}
            tr.begin_step(layout, shards, torch.float32)
            out = torch.empty(unit.padded_numel)
            tr.gather(unit.name, out)
            seen.append(float(out[-1]))  # the last shard's owner's value this round
            tr.collectives.barrier()
    return seen


@pytest.mark.parametrize("agent_store", [False, True], ids=["rank0-store", "launcher-store"])
def test_fifty_transports_in_a_row(mp_pool, agent_store):  # noqa: F811
    port = free_port() if agent_store else None
    store = host_store(port, uuid.uuid4().hex, 30) if agent_store else None
    try:
        out = mp_pool.run(rounds_worker, 2, args=(50, port), timeout=300)
    finally:
        del store
    assert out[0] == out[1] == [100.0 * i + 1 for i in range(50)]


def after_failed_init_worker() -> list[float]:
    """Rank 1's first default group fails half-way (its peer never comes): later groups must
    still meet rank 0's (torch's group counter, left at 1 by the failure, is reset)."""
    import torch.distributed as dist

    if odcfn.Mesh.from_env().rank == 1:
        with pytest.raises(Exception):  # noqa: B017 - torch's store timeout error type varies
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=2,
                                    timeout=timedelta(seconds=1))
        assert not dist.is_initialized()
    return rounds_worker(3, None)


def test_a_failed_init_does_not_poison_the_process(mp_pool):  # noqa: F811
    assert mp_pool.run(after_failed_init_worker, 2, timeout=120) == [[1.0, 101.0, 201.0]] * 2


def dtype_worker() -> None:
    model = qwen_model(CFG)
    mesh = odcfn.Mesh.from_env()
    layout = make_layout(model, mesh)
    dtype = torch.bfloat16 if mesh.rank == 1 else torch.float32
    with ShmTransport(mesh, timeout=20) as tr:
        tr.begin_step(layout, {u.name: torch.zeros(u.shard_size) for u in layout.units}, dtype)


def model_worker(comm: str) -> None:
    cfg = CFG if odcfn.Mesh.from_env().rank == 0 else QwenConfig(**{**CFG.__dict__, "d_ff": 32})
    model = qwen_model(cfg)
    mesh = odcfn.Mesh.from_env()
    from odcfn.models import init_params
    from tests.util import make_state

    with ShmTransport(mesh, timeout=20) as tr:
        state = make_state(init_params(cfg, seed=0), model, tr, comm=comm)
        odcfn.grad_step(state, odcfn.random_batch([5, 7], cfg.vocab_size, seed=0))


def test_disagreeing_dtypes_are_named_on_every_rank(mp_pool):  # noqa: F811
    with pytest.raises(LaunchError) as e:
        mp_pool.run(dtype_worker, 2, timeout=60)
    for r in (0, 1):
        msg = e.value.errors[r]
        assert "ranks disagree on the compute dtype" in msg and "rank 1: torch.bfloat16" in msg, msg


@pytest.mark.parametrize("comm", ["collective", "odc"])
def test_disagreeing_models_get_the_disagreement_not_a_missing_file(mp_pool, comm):  # noqa: F811
    with pytest.raises(LaunchError) as e:
        mp_pool.run(model_worker, 2, args=(comm,), timeout=60)
    for r in (0, 1):
        msg = e.value.errors[r]
        assert "ranks disagree on the parameter layout" in msg and "FileNotFoundError" not in msg, msg
