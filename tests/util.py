"""Tiny configs and the run-W-ranks-in-one-process helper shared by the core tests."""

from __future__ import annotations

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model

TINY = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)


def tiny(cfg: QwenConfig = TINY, seed: int = 0):
    return cfg, qwen_model(cfg), init_params(cfg, seed=seed)


def fixed_balancer(assignment):
    """A balancer that returns a given assignment (for property tests over assignments)."""
    return lambda lengths, world, cap: assignment


def make_state(full, model, transport, optimizer=None, **config):
    """A TrainState for this rank from the full params, with ``StepConfig(**config)`` (the
    balance round_robin unless given: the tests below were sized for it)."""
    config.setdefault("balance", "round_robin")
    return odcfn.TrainState.create(
        params=full, model=model, optimizer=optimizer or odcfn.sgd(0.0), transport=transport,
        config=odcfn.StepConfig(**config),
    )


def run_grad_step(full, batch, model, world, *, ranks_per_node=None, sharding="full", **config):
    """grad_step on every in-process rank; returns [(grad shards, metrics)] by rank."""

    def fn(rank, tr):
        return odcfn.grad_step(make_state(full, model, tr, **config), batch)

    return odcfn.run_local(fn, world, ranks_per_node=ranks_per_node, sharding=sharding, timeout=30)


def ref_shards(grads_full, model, world, ranks_per_node=None, sharding="full"):
    mesh = odcfn.Mesh(world, 0, ranks_per_node, sharding)
    return [odcfn.shard(grads_full, model, mesh.with_rank(r)) for r in range(world)]
