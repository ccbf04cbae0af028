"""Hierarchical shards (hpZ) across processes over /dev/shm (``odcfn.transport.shm_hpz``): W = 4
ranks in two k = 2 groups (two simulated nodes).

- the gradients equal the single-process reference (test_hpz.py's tolerance), and a
  deterministic run's gradients and AdamW trajectory equal the in-process ranks' bit for bit;
- the backward's group gathers read in-group peers only (per-peer counters), and the primary
  gathers pay every owner exactly the forward's and the shard builds' bytes;
- a group peer that dies before building its slice, or stalls, ends the gather in
  ``TransportError`` within the timeout, never a hang; a k that disagrees is named;
- under an int8 ``gather_format`` the backward reads the forward's dequantized values (hpZ's
  gradients equal the re-gathering step's bit for bit), the group gathers moving compute-dtype
  bytes;
- ``log_probs`` with hpZ equals ``log_probs`` without it.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import odcfn
from odcfn.launch import LaunchError
from odcfn.schedule import ScheduleOptions
from odcfn.schedule.plan import Backward, Gather
from odcfn.transport.base import TransportError
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.step.test_hpz import ASSIGNMENT, ATOL, RTOL
from tests.util import fixed_balancer, make_state, ref_shards, tiny

W, K = 4, 2
CFG, MODEL, FULL = tiny()
BATCH = odcfn.random_batch([5, 9, 3, 7, 4, 6], CFG.vocab_size, seed=1)


def _state(tr, reshard, **cfg):
    opts = ScheduleOptions(prefetch=1, reshard_after_forward=reshard)
    balance = fixed_balancer(ASSIGNMENT)
    return make_state(FULL, MODEL, tr, odcfn.adamw(1e-2), balance=balance, options=opts, **cfg)


def _run(tr, reshard, steps, **cfg):
    """grad_step's shards, figures and per-peer bytes, then ``steps`` AdamW train_steps' params."""
    state = _state(tr, reshard, **cfg)
    grads, m = odcfn.grad_step(state, BATCH)
    s = m.plan.steps
    out = {
        "grads": {k: v.clone() for k, v in grads.items()}, "loss": m.loss, "syncs": m.counters.syncs,
        "collectives": m.counters.collectives, "peer": dict(tr.peer_bytes), "group": dict(tr.group_bytes),
        "primary": [x.unit for x in s if isinstance(x, Gather) and not x.group],
        "from_group": [x.unit for x in s if isinstance(x, Gather) and x.group],
        "backward": any(isinstance(x, Backward) for x in s),
    }
    for _ in range(steps):
        state, _ = odcfn.train_step(state, BATCH)
    out["params"] = {k: v.clone() for k, v in state.params.items()}
    return out


def hpz_worker(reshard, steps, deterministic):
    torch.set_num_threads(1)
    with ShmTransport(odcfn.Mesh.from_env(), timeout=30) as tr:
        return _run(tr, reshard, steps, deterministic=deterministic)


def test_hpz_on_processes_equals_reference_threads_and_stays_in_group(mp_pool):  # noqa: F811
    out = mp_pool.run(hpz_worker, W, args=(K, 2, True))
    local = odcfn.run_local(lambda r, tr: _run(tr, K, 2, deterministic=True), W, timeout=30)
    loss_ref, grads_ref = odcfn.reference_value_and_grad(MODEL, FULL, BATCH)
    want = ref_shards(grads_ref, MODEL, W)
    layout = odcfn.sharding.make_layout(MODEL, odcfn.Mesh(W))
    per_owner = {u: layout[u].shard_size * 4 for u in layout.names}  # fp32
    for rank, (got, ref) in enumerate(zip(out, local)):
        odcfn.tree_assert_allclose(got["grads"], want[rank], rtol=RTOL, atol=ATOL, what=f"rank {rank}")
        assert abs(got["loss"] - float(loss_ref)) <= 1e-5 * abs(float(loss_ref))
        assert got["syncs"] == 1 and got["collectives"] == 0
        # processes and threads: the same plan, the same bytes, bit for bit the same numbers
        assert all(torch.equal(got["grads"][k], ref["grads"][k]) for k in ref["grads"])
        assert all(torch.equal(got["params"][k], ref["params"][k]) for k in ref["params"])
        assert (got["peer"], got["group"]) == (ref["peer"], ref["group"])
        mine = set(range(rank - rank % K, rank - rank % K + K))
        assert set(got["group"]) <= mine - {rank}  # the backward never left the group
        if got["backward"]:
            assert got["from_group"] and set(got["group"]) == mine - {rank}
            slice_bytes = {u: layout[u].padded_numel // K * 4 for u in layout.names}
            assert sum(got["group"].values()) == sum(slice_bytes[u] for u in got["from_group"])
        for owner in set(range(W)) - {rank}:  # the primary gathers pay every owner, nothing more
            assert got["peer"].get(owner, 0) == sum(per_owner[u] for u in got["primary"]), (rank, owner)


def format_worker():
    """One int8-gather grad_step with hpZ and one without (deterministic: rank-order sums)."""
    torch.set_num_threads(1)
    with ShmTransport(odcfn.Mesh.from_env(), timeout=30) as tr:
        out = []
        for reshard in (K, True):
            before = sum(tr.group_bytes.values())
            grads, m = odcfn.grad_step(_state(tr, reshard, gather_format="int8", deterministic=True), BATCH)
            units = [x.unit for x in m.plan.steps if isinstance(x, Gather) and x.group]
            moved = sum(tr.group_bytes.values()) - before
            out.append(({k: v.clone() for k, v in grads.items()}, moved, units))
        return out


def test_hpz_with_a_quantized_gather_reads_the_forwards_values(mp_pool):  # noqa: F811
    layout = odcfn.sharding.make_layout(MODEL, odcfn.Mesh(W))
    out = mp_pool.run(format_worker, W)
    assert any(moved for (_, moved, _), _ in out)  # some backward read its group
    for (hpz, moved, units), (flat, _, _) in out:
        # the slices hold the forward's dequantized copy: the backward computes on the very values
        # the owners' int8 shards give, as a re-gather from the owners does
        assert all(torch.equal(hpz[k], flat[k]) for k in flat)
        assert moved == sum(layout[u].padded_numel // K * 4 for u in units)  # fp32 compute bytes


def logprobs_worker():
    torch.set_num_threads(1)
    with ShmTransport(odcfn.Mesh.from_env(), timeout=30) as tr:
        return [odcfn.log_probs(_state(tr, k), BATCH) for k in (K, True)]


def test_log_probs_with_hpz_equals_without(mp_pool):  # noqa: F811
    for rank, (hpz, flat) in enumerate(mp_pool.run(logprobs_worker, W)):
        assert len(hpz) == len(BATCH.lengths)
        assert all(torch.equal(a, b) for a, b in zip(hpz, flat)), rank
        assert all(torch.isfinite(a).all() and a.numel() == n for a, n in zip(hpz, BATCH.lengths))


def _unit_setup(tr):
    layout = odcfn.sharding.make_layout(MODEL, tr.mesh)
    tr.begin_step(layout, odcfn.shard(FULL, MODEL, tr.mesh), torch.float32)
    unit = layout.names[1]
    full = torch.empty(layout[unit].padded_numel)
    tr.gather(unit, full)
    return unit, full


def group_fault_worker(victim, how, timeout):
    """Every rank gathers one unit and builds its slice, but ``victim``, which dies (``how`` =
    "kill") or stalls; then every rank gathers the unit from its group. How each ended, when."""
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    try:
        with ShmTransport(mesh, timeout=timeout) as tr:
            unit, full = _unit_setup(tr)
            if mesh.rank == victim and how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mesh.rank == victim:
                time.sleep(1.75 * timeout)  # past the others' timeout, then home
                return "stalled", 0.0
            tr.publish_secondary(unit, full, K)
            t0, out = time.monotonic(), torch.empty_like(full)
            try:
                tr.gather_group(unit, out, K)
            except TransportError as e:
                return f"TransportError: {e}", time.monotonic() - t0
            assert torch.equal(out, full)
            return "gathered", time.monotonic() - t0
    except TransportError as e:  # the others' closing collectives, after their gather
        return f"closing: {e}", 0.0


@pytest.mark.parametrize("how", ["kill", "stall"])
def test_a_group_peer_that_never_builds_its_slice_ends_the_gather(mp_pool, how):  # noqa: F811
    timeout, t0 = 2.0, time.monotonic()
    try:
        results = dict(enumerate(mp_pool.run(group_fault_worker, W, args=(1, how, timeout), timeout=30)))
    except LaunchError as e:
        assert how == "kill" and "worker died" in e.errors[1] and set(e.results) == {0, 2, 3}, e.errors
        results = e.results
    outcome, waited = results[0]  # rank 1's group peer
    assert outcome.startswith("TransportError") and "rank 1" in outcome and "group shard" in outcome
    assert ("died" if how == "kill" else "timed out") in outcome, outcome
    assert waited < timeout + 1.0, waited
    for r in (2, 3):  # the other group is whole: its gathers complete
        assert results[r][0] == "gathered", results[r]
    assert time.monotonic() - t0 < 25


def k_mismatch_worker():
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=10) as tr:
        unit, full = _unit_setup(tr)
        tr.publish_secondary(unit, full, 1 if mesh.rank == 1 else K)  # rank 1 built for k = 1
        tr.publish_secondary(unit, full * 2, K)  # a second build in the step: a no-op
        if mesh.rank in (0, 1):
            with pytest.raises(TransportError, match=r"rank 1's group shard holds step 1 with k=1"):
                tr.gather_group(unit, torch.empty_like(full), K)
        else:
            out = torch.empty_like(full)
            tr.gather_group(unit, out, K)
            assert torch.equal(out, full)
        with pytest.raises(ValueError, match="reshard_after_forward=3"):
            tr.gather_group(unit, torch.empty_like(full), 3)
        with pytest.raises(TypeError, match="gathered copy"):
            tr.publish_secondary(unit, full.double(), K)
        tr.sync(torch.zeros(1))  # nobody leaves while a peer still reads
        return True


def test_disagreeing_k_and_bad_buffers_are_named(mp_pool):  # noqa: F811
    assert all(mp_pool.run(k_mismatch_worker, W))
