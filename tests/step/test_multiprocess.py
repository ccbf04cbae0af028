"""Multi-process ODC (ShmTransport) and the collective baseline (gloo) against the single-process
reference: loss and gradient shards over random shapes, AdamW-updated parameters; exactly one
sync per ODC step on the wire; a killed rank and a stuck rank end in TransportError (and the
abort flag), never a hang; the hybrid mesh through two real torchrun agents ("nodes") on
loopback. Every transport's protocol properties: tests/transport/test_transport_conformance.py."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn.launch import LaunchError
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.transport.base import TransportError
from odcfn.transport.collective import CollectiveTransport
from odcfn.transport.shm import ShmTransport
from odcfn.tree import tree_named_leaves
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import make_state

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
LR = 1e-2


def _setup(lengths, seed):
    torch.set_num_threads(1)
    model = qwen_model(CFG)
    return model, init_params(CFG, seed=seed), odcfn.random_batch(lengths, CFG.vocab_size, seed=seed)


def _copy(tree):
    return {k: v.clone() for k, v in tree.items()}


# --- worker functions (top level: the pool and launch pickle them by reference) --------------


def grads_worker(lengths, cap, seed, comms):
    """One grad_step per entry of ``comms`` on one ShmTransport; grads, loss, wire calls."""
    model, full, batch = _setup(lengths, seed)
    mesh = odcfn.Mesh.from_env()
    params = odcfn.shard(full, model, mesh)
    out = []
    with ShmTransport(mesh, timeout=30) as tr:
        for comm in comms:
            calls = tr.collectives.calls.copy()
            state = make_state(params, model, tr, comm=comm, max_tokens_per_microbatch=cap)
            g, m = odcfn.grad_step(state, batch)
            out.append({
                "comm": comm, "grads": _copy(g), "loss": m.loss, "syncs": m.counters.syncs,
                "collectives": m.counters.collectives, "wire": dict(tr.collectives.calls - calls),
                "mbs": len(m.plan.microbatches),
            })
        # the plain torch.distributed baseline, on its own group next to the shm transport's
        with CollectiveTransport(mesh, timeout=30) as ct:
            state = make_state(params, model, ct, comm="collective", max_tokens_per_microbatch=cap)
            g, m = odcfn.grad_step(state, batch)
            out.append({"comm": "gloo-only", "grads": _copy(g), "loss": m.loss})
    return out


def adamw_worker(lengths, cap, seed, comms):
    """Several AdamW train_steps, the comm mode switching per step as ``comms`` says."""
    model, full, batch = _setup(lengths, seed)
    mesh = odcfn.Mesh.from_env()
    wire = []
    with ShmTransport(mesh, timeout=30) as tr:
        state = make_state(full, model, tr, odcfn.adamw(LR), max_tokens_per_microbatch=cap)
        for comm in comms:
            calls = tr.collectives.calls.copy()
            state = state.replace(config=state.config.replace(comm=comm))
            state, m = odcfn.train_step(state, batch)
            wire.append((comm, dict(tr.collectives.calls - calls), m.counters.syncs))
    return _copy(state.params), wire


def _trap(model, rank_calls, action):
    """``model`` whose layer units run ``action()`` from their ``rank_calls``-th forward on."""
    calls = {"n": 0}

    def wrap(fwd):
        def fwd2(p, x, mb):
            calls["n"] += 1
            if calls["n"] == rank_calls:
                action()
            return fwd(p, x, mb)
        return fwd2

    units = tuple(replace(u, fwd=wrap(u.fwd)) if u.name.startswith("layers") else u for u in model.units)
    return replace(model, units=units)


def killed_worker(victim, timeout):
    """``victim`` SIGKILLs itself in its first forward of the second minibatch; the survivors
    report how they ended, how long it took and what of theirs is left in /dev/shm."""
    model, full, batch = _setup([6, 5, 6, 4, 6, 5], 0)
    mesh = odcfn.Mesh.from_env()
    if mesh.rank == victim:  # step 1: 2 microbatches x 2 layers = 4 forwards; die in the 5th
        model = _trap(model, 5, lambda: os.kill(os.getpid(), signal.SIGKILL))
    params = odcfn.shard(full, model, mesh)
    t0, step = time.monotonic(), -1
    try:
        with ShmTransport(mesh, timeout=timeout) as tr:
            for i in range(3):
                step, t0 = i, time.monotonic()
                odcfn.grad_step(make_state(params, model, tr, comm="odc", max_tokens_per_microbatch=6), batch)
        outcome = "finished"
    except TransportError as e:
        outcome = f"TransportError: {e}"
    prefix = os.environ["ODCFN_SHM_PREFIX"]
    left = [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]
    return outcome, time.monotonic() - t0, step, left


def stuck_worker(timeout, stall):
    """Rank 1 stalls ``stall`` s inside its second minibatch; both report how they ended."""
    model, full, batch = _setup([6, 5, 7, 4], 0)
    mesh = odcfn.Mesh.from_env()
    if mesh.rank == 1:  # 2 microbatches x 2 layers per step: the 5th forward is in step 2
        model = _trap(model, 5, lambda: time.sleep(stall))
    params = odcfn.shard(full, model, mesh)
    t0 = time.monotonic()
    try:
        with ShmTransport(mesh, timeout=timeout) as tr:
            odcfn.grad_step(make_state(params, model, tr, comm="odc"), batch)
            t0 = time.monotonic()
            odcfn.grad_step(make_state(params, model, tr, comm="odc"), batch)
        return "finished", time.monotonic() - t0
    except TransportError as e:
        return f"TransportError: {e}", time.monotonic() - t0


def setup_killed_worker():
    """Rank 1 dies right after creating its segment, before anyone could map or unlink it."""
    import odcfn.transport.shm_sync as shm

    torch.set_num_threads(1)
    model, full, batch = _setup([5, 6], 0)
    mesh = odcfn.Mesh.from_env()
    if mesh.rank == 1:
        class Dying(shm.Segment):
            def __init__(self, path, nbytes, *, create):
                super().__init__(path, nbytes, create=create)
                if create:
                    os.kill(os.getpid(), signal.SIGKILL)

        shm.Segment = Dying
    try:
        with ShmTransport(mesh, timeout=20) as tr:
            odcfn.grad_step(make_state(odcfn.shard(full, model, mesh), model, tr), batch)
        return "finished", os.environ["ODCFN_SHM_PREFIX"], []
    except TransportError as e:
        prefix = os.environ["ODCFN_SHM_PREFIX"]
        return f"TransportError: {e}", prefix, [f for f in os.listdir("/dev/shm") if f.startswith(prefix)]


# --- helpers in the test process ------------------------------------------------------------


def _reference(lengths, seed, world):
    model, full, batch = _setup(lengths, seed)
    loss, g = odcfn.reference_value_and_grad(model, full, batch)
    return model, full, float(loss), [odcfn.shard(g, model, odcfn.Mesh(world, r)) for r in range(world)]


def _named(tree):
    return {f"{u}.{n}": t for u, sub in tree.items() for n, t in tree_named_leaves(sub)}


# --- tests ------------------------------------------------------------------------------------


@settings(max_examples=5, deadline=None)
@given(
    world=st.sampled_from([2, 3, 4]),
    lengths=st.lists(st.integers(2, 12), min_size=1, max_size=9),
    cap=st.integers(12, 24),
    seed=st.integers(0, 3),
)
def test_odc_shm_and_gloo_match_reference(mp_pool, world, lengths, cap, seed):  # noqa: F811
    model, _, loss, ref = _reference(lengths, seed, world)
    out = mp_pool.run(grads_worker, world, args=(lengths, cap, seed, ("odc", "collective")))
    for r in range(world):
        odc, coll, plain = out[r]
        for res in (odc, coll, plain):
            assert res["loss"] == pytest.approx(loss, rel=1e-5), res["comm"]
            odcfn.tree_assert_allclose(res["grads"], ref[r], rtol=1e-5, atol=1e-7)
        odcfn.tree_assert_allclose(odc["grads"], coll["grads"], rtol=1e-5, atol=1e-7)
        assert odc["collectives"] == 0 and coll["collectives"] > 0


def test_unequal_microbatches_and_an_idle_rank(mp_pool):  # noqa: F811
    # 5 samples on 4 ranks under round robin: rank 0 gets 2 (two microbatches at cap 9), ranks
    # 1-3 one each; with 3 samples rank 3 gets none at all
    for lengths in ([8, 5, 6, 4, 7], [8, 5, 6]):
        _, _, loss, ref = _reference(lengths, 1, 4)
        out = mp_pool.run(grads_worker, 4, args=(lengths, 9, 1, ("odc", "collective")))
        out = [o[:2] for o in out]
        mbs = [o[0]["mbs"] for o in out]
        assert len(set(mbs)) > 1 and (mbs[3] == 0) == (len(lengths) == 3), mbs
        for r in range(4):
            for res in out[r]:
                assert res["loss"] == pytest.approx(loss, rel=1e-5)
                odcfn.tree_assert_allclose(res["grads"], ref[r], rtol=1e-5, atol=1e-7)


def test_adamw_steps_match_reference_and_one_sync_on_the_wire(mp_pool):  # noqa: F811
    lengths, cap, seed, world, steps = [9, 4, 7, 3, 5], 10, 2, 3, 3
    model, full, batch = _setup(lengths, seed)
    # independent reference: torch.optim.AdamW on the unsharded params with reference grads
    named = {k: v.clone().requires_grad_() for k, v in _named(full).items()}
    opt = torch.optim.AdamW(named.values(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for _ in range(steps):
        current = {k: v.detach().clone() for k, v in named.items()}
        _, g = odcfn.reference_value_and_grad(model, _unflat(full, current), batch)
        for k, v in _named(g).items():
            named[k].grad = v.clone()
        opt.step()
    want = {k: v.detach() for k, v in named.items()}
    for comms in (("odc",) * steps, ("collective",) * steps, ("odc", "collective", "odc")):
        out = mp_pool.run(adamw_worker, world, args=(lengths, cap, seed, comms))
        mesh = odcfn.Mesh(world, 0)
        got = _named(odcfn.unshard([o[0] for o in out], model, mesh))
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=k)
        for _, wire in out:
            for i, (comm, calls, syncs) in enumerate(wire):
                assert syncs == 1
                if comm == "odc" and i > 0:  # step 0 also maps the segments (two barriers)
                    assert calls == {"all_reduce": 1}, calls


def _unflat(full, named):
    """Reference params tree whose leaves are the tensors in ``named`` (by dotted name)."""
    out = {}
    for unit, sub in full.items():
        out[unit] = _fill(sub, f"{unit}.", named)
    return out


def _fill(sub, prefix, named):
    return {k: (_fill(v, f"{prefix}{k}.", named) if isinstance(v, dict) else named[f"{prefix}{k}"])
            for k, v in sub.items()}


def test_killed_rank_ends_every_survivor_within_the_timeout(mp_pool):  # noqa: F811
    # (odcfn.launch's own handling of a killed rank: tests/transport/test_shm.py)
    timeout = 20.0
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        mp_pool.run(killed_worker, 3, args=(1, timeout), timeout=2 * timeout)
    err = info.value
    assert "worker died" in err.errors[1]
    assert set(err.results) == {0, 2}
    outcomes = []
    for r in (0, 2):
        outcome, waited, step, left = err.results[r]
        assert outcome.startswith("TransportError"), outcome
        assert step == 1 and waited < timeout, (step, waited)
        assert left == [], left
        outcomes.append(outcome)
    # whoever notices first names the dead rank; the other may instead see its abort flag
    assert any("rank 1" in o and "died" in o for o in outcomes), outcomes
    assert all("rank 1" in o or "aborted" in o for o in outcomes), outcomes
    assert time.monotonic() - t0 < 60


def test_rank_killed_during_setup_leaves_nothing_behind(mp_pool):  # noqa: F811
    with pytest.raises(LaunchError) as info:
        mp_pool.run(setup_killed_worker, 2, timeout=60)
    outcome, prefix, left_at_error = info.value.results[0]
    assert outcome.startswith("TransportError"), outcome
    # rank 0 unlinked its own file and the dead rank 1's (it knows the job's names), so nothing
    # depends on a launcher's sweep (under torchrun there is none) ...
    assert left_at_error == [], left_at_error
    # ... and after the job's sweep too
    assert [f for f in os.listdir("/dev/shm") if f.startswith(prefix)] == []


def test_stuck_rank_times_out_and_the_other_gives_up(mp_pool):  # noqa: F811
    timeout = 1.5
    (o0, t0), (o1, t1) = mp_pool.run(stuck_worker, 2, args=(timeout, 4.0), timeout=60)
    assert o0.startswith("TransportError") and "timed out" in o0, o0
    assert timeout <= t0 < timeout + 5.0  # measured: 1.51-1.52 s
    # the stalled rank wakes up later and finds rank 0's abort flag instead of waiting again
    assert o1.startswith("TransportError") and "rank 0 aborted" in o1, o1


# --- two torchrun agents: the hybrid mesh across "nodes" --------------------------------------


def _torchrun_main(out_dir: str) -> None:
    """One rank under ``torchrun --nnodes 2 --nproc-per-node 2``: the hybrid mesh (shards inside
    a node over the CPU IPC fabric, replicas across nodes over gloo), an ODC then a collective
    grad_step, results saved for the test process to check."""
    torch.set_num_threads(1)
    lengths, cap, seed = [7, 3, 9, 5, 4, 6], 12, 0
    model, full, batch = _setup(lengths, seed)
    mesh = odcfn.Mesh.from_env("hybrid")  # LOCAL_WORLD_SIZE=2: 2 nodes of 2
    # the fabric's rendezvous and fetch_add go through the agent's store (torchrun hosts it)
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                       is_master=False, timeout=timedelta(seconds=60))
    store = torch.distributed.PrefixStore("odcfn-test", store)
    from odcfn.transport.gpu.cuda_ipc import cuda_ipc_transport

    # no process group exists yet: the transport creates it from torchrun's environment
    tr = cuda_ipc_transport(mesh, store, device="cpu", mode="landing", slot_elems=64, timeout=60)
    out = {"node": int(os.environ["GROUP_RANK"]), "local": int(os.environ["LOCAL_RANK"])}
    try:
        for comm in ("odc", "collective"):
            wire = tr.collectives.calls.copy()
            state = make_state(full, model, tr, comm=comm, max_tokens_per_microbatch=cap)
            g, m = odcfn.grad_step(state, batch)
            out[comm] = {"grads": _copy(g), "loss": m.loss, "syncs": m.counters.syncs,
                         "wire": dict(tr.collectives.calls - wire)}
    finally:
        tr.close()
    torch.save(out, os.path.join(out_dir, f"rank{mesh.rank}.pt"))


def test_hybrid_mesh_through_two_torchrun_agents_on_loopback(tmp_path):
    import subprocess
    import sys

    from odcfn.launch import free_port

    port, prefix = free_port(), f"odcfn-torchrun-{os.getpid()}"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1", "ODCFN_SHM_PREFIX": prefix}
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--max-restarts", "0", "-m", "tests.step.test_multiprocess", str(tmp_path)],
            cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    deadline, logs = time.monotonic() + 180, []
    try:
        for a in agents:
            logs.append(a.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(logs)[-4000:]
    model, full, batch = _setup([7, 3, 9, 5, 4, 6], 0)
    loss, g = odcfn.reference_value_and_grad(model, full, batch)
    mesh = odcfn.Mesh(4, 0, 2, "hybrid")
    for r in range(4):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=True)
        assert (res["node"], res["local"]) == divmod(r, 2)
        ref = odcfn.shard(g, model, mesh.with_rank(r))  # ranks r and r+2 hold the same shard
        for comm in ("odc", "collective"):
            odcfn.tree_assert_allclose(res[comm]["grads"], ref, rtol=1e-5, atol=1e-7)
            assert res[comm]["loss"] == pytest.approx(float(loss), rel=1e-5)
            assert res[comm]["syncs"] == 1
        # ODC: the sync and the replica all-reduce across nodes, and (a layout's first step only)
        # the trained-units agreement (odcfn.step.agree); nothing else on the wire
        assert res["odc"]["wire"] == {"all_reduce": 3}, res["odc"]["wire"]
    assert [f for f in os.listdir("/dev/shm") if f.startswith(prefix)] == []


if __name__ == "__main__":  # a rank under torchrun (the two-agent test)
    import sys

    _torchrun_main(sys.argv[1])
