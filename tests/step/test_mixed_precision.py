"""bf16 compute with fp32 master shards and fp32 gradient accumulators.

Documented tolerances (bf16 keeps 8 significant bits, unit roundoff 2**-9 ~ 2e-3):
- minibatch loss: relative error <= 1e-3 against the fp32 single-process reference
  (the loss is summed in fp64 from fp32 logits; measured ~4e-6 on this model);
- gradients: per unit, ||g_bf16 - g_ref|| / ||g_ref|| <= 3e-2 (measured 5e-3 .. 9e-3 on this
  model, W=2, both comm modes);
- after 3 AdamW steps on one repeated minibatch, per-step losses agree with the fp32 run to
  1e-2 relative, and master parameters stay within 10 x lr of the fp32 ones (Adam's step is
  at most ~lr per element).
The fp32 path itself matches the reference to 1e-5 (tests/step/test_equivalence.py covers it).
"""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.tree import tree_leaves
from tests.util import make_state

CFG = QwenConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48)
MODEL = qwen_model(CFG)
FULL = init_params(CFG, seed=1)
BATCH = odcfn.random_batch([9, 17, 5, 12, 7, 20], CFG.vocab_size, seed=0)
LOSS_RTOL, GRAD_RTOL = 1e-3, 3e-2


def _grads(W: int, comm: str, dtype: torch.dtype, cap: int = 24, **kw):
    def fn(rank, tr):
        state = make_state(
            FULL, MODEL, tr, comm=comm, max_tokens_per_microbatch=cap, compute_dtype=dtype, **kw
        )
        return odcfn.grad_step(state, BATCH)

    out = odcfn.run_local(fn, W)
    return [o[0] for o in out], [o[1] for o in out]


def _flat(tree) -> torch.Tensor:
    return torch.cat([x.reshape(-1).double() for x in tree_leaves(tree)])


@pytest.fixture(scope="module")
def reference():
    loss, grads = odcfn.reference_value_and_grad(MODEL, FULL, BATCH)
    return float(loss), grads


@pytest.mark.parametrize(("W", "comm", "cap"), [(2, "odc", 24), (2, "collective", 24), (3, "odc", 20)])
def test_bf16_gradients_within_tolerance_of_fp32_reference(reference, W, comm, cap):
    loss_ref, g_ref = reference
    shards, metrics = _grads(W, comm, torch.bfloat16, cap)
    assert abs(metrics[0].loss - loss_ref) <= LOSS_RTOL * abs(loss_ref)
    # the accumulators the optimizer sees are fp32 even though the pushes were bf16
    assert all(v.dtype == torch.float32 for s in shards for v in s.values())
    g = odcfn.unshard(shards, MODEL, odcfn.Mesh(W))
    for unit in g:
        a, b = _flat(g[unit]), _flat(g_ref[unit])
        rel = float((a - b).norm() / b.norm())
        assert rel <= GRAD_RTOL, f"{unit}: relative grad error {rel:.2e} > {GRAD_RTOL}"
        # bf16 really ran: a bf16 gradient is not bit-identical to the fp32 one
        assert rel > 0, unit


@pytest.mark.parametrize(
    "options",
    [
        odcfn.ScheduleOptions(prefetch=2, remat=frozenset({"layers.0", "layers.1"})),
        odcfn.ScheduleOptions(prefetch=0, reshard_after_forward=False),
    ],
    ids=["remat-prefetch2", "no-reshard"],
)
def test_bf16_with_remat_and_schedule_options(reference, options):
    """Rematerialised bf16 units and re-gathered bf16 buffers give the same tolerance."""
    _, g_ref = reference
    shards, _ = _grads(2, "odc", torch.bfloat16, options=options, balance="lb_mini")
    g = odcfn.unshard(shards, MODEL, odcfn.Mesh(2))
    assert float((_flat(g) - _flat(g_ref)).norm() / _flat(g_ref).norm()) <= GRAD_RTOL


def test_bf16_is_not_trivially_close_a_wrong_gradient_fails(reference):
    """The tolerance is tight enough to catch a real bug: dropping one rank's microbatch."""
    _, g_ref = reference
    half = odcfn.Batch(BATCH.samples[:-1])
    _, g_wrong = odcfn.reference_value_and_grad(MODEL, FULL, half)
    rel = float((_flat(g_wrong) - _flat(g_ref)).norm() / _flat(g_ref).norm())
    assert rel > 3 * GRAD_RTOL


@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_bf16_moves_half_the_bytes(comm):
    _, m32 = _grads(2, comm, torch.float32)
    _, m16 = _grads(2, comm, torch.bfloat16)
    for r in range(2):
        c32, c16 = m32[r].counters, m16[r].counters
        if comm == "odc":
            assert c32.gather_bytes > 0 and c16.gather_bytes * 2 == c32.gather_bytes
            assert c16.scatter_bytes * 2 == c32.scatter_bytes
            assert c16.gathers == c32.gathers and c16.syncs == c32.syncs == 1
        else:
            assert c32.collective_bytes > 0 and c16.collective_bytes * 2 == c32.collective_bytes


def test_many_microbatches_accumulate_in_fp32(reference):
    """One sample per microbatch: many bf16 pushes summed in the fp32 accumulators stay within
    the same tolerance (a bf16 accumulator would add one rounding per push)."""
    loss_ref, g_ref = reference
    shards, metrics = _grads(2, "odc", torch.bfloat16, cap=20)
    assert max(len(metrics[r].plan.microbatches) for r in range(2)) >= 3
    g = odcfn.unshard(shards, MODEL, odcfn.Mesh(2))
    rel = float((_flat(g) - _flat(g_ref)).norm() / _flat(g_ref).norm())
    assert rel <= GRAD_RTOL


def test_bf16_training_tracks_fp32_and_keeps_fp32_masters():
    W, lr, steps = 2, 1e-3, 3
    batches = [odcfn.random_batch([8, 11, 6, 13], CFG.vocab_size, seed=7)] * steps

    def run(dtype):
        def fn(rank, tr):
            state = make_state(FULL, MODEL, tr, odcfn.adamw(lr), compute_dtype=dtype)
            losses = []
            for b in batches:
                state, m = odcfn.train_step(state, b)
                losses.append(m.loss)
            return state.params, state.opt_state, losses

        return odcfn.run_local(fn, W)

    ref, got = run(torch.float32), run(torch.bfloat16)
    for r in range(W):
        p, o, losses = got[r]
        assert all(v.dtype == torch.float32 for v in p.values())
        assert all(v.dtype == torch.float32 for v in o["mu"].values())
        for a, b in zip(losses, ref[r][2]):
            assert abs(a - b) <= 1e-2 * abs(b)
        for k in p:
            assert (p[k] - ref[r][0][k]).abs().max() <= 10 * lr, k
    assert got[0][2][-1] < got[0][2][0]  # and it trains


def _shm_bytes_worker(cfg_seed: int) -> dict:
    """One rank of a 2-process job: an fp32 and a bf16 step on the shared-memory transport."""
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    out = {}
    with ShmTransport(mesh, timeout=60) as tr:
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            state = make_state(FULL, MODEL, tr, max_tokens_per_microbatch=24, compute_dtype=dtype)
            g, m = odcfn.grad_step(state, BATCH)
            # numpy, not tensors: torch pickles tensors between processes as shared-memory
            # handles that die with this process
            out[name] = (m.counters.as_dict(), m.loss, {k: v.numpy().copy() for k, v in g.items()})
    return out


def test_bf16_halves_gather_bytes_across_processes(reference):
    """The same on 2 real processes over /dev/shm (odcfn.launch + ShmTransport)."""
    from odcfn.launch import launch

    loss_ref, g_ref = reference
    res = launch(_shm_bytes_worker, 2, args=(0,), timeout=120)
    for r in range(2):
        c32, c16 = res[r]["fp32"][0], res[r]["bf16"][0]
        assert c32["gather_bytes"] > 0 and 2 * c16["gather_bytes"] == c32["gather_bytes"]
        assert c16["syncs"] == 1
    shards = [{k: torch.from_numpy(v) for k, v in res[r]["bf16"][2].items()} for r in range(2)]
    g16 = odcfn.unshard(shards, MODEL, odcfn.Mesh(2))
    assert float((_flat(g16) - _flat(g_ref)).norm() / _flat(g_ref).norm()) <= GRAD_RTOL
    assert abs(res[0]["bf16"][1] - loss_ref) <= LOSS_RTOL * abs(loss_ref)
