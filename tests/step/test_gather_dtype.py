"""``gather_params`` travels in the dtype ``train_step`` publishes, so an RL loop with bf16
compute (train_step, gather_params, train_step, ...) keeps one shared-memory publication instead
of remapping the segments twice per iteration; ``dtype=`` asks for another (full precision)."""

from __future__ import annotations

import torch

import odcfn
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import make_state, tiny

CFG, MODEL, FULL = tiny()


def _leaves(tree):
    return torch.utils._pytree.tree_leaves(tree)


def rl_loop_worker(dtype):
    torch.set_num_threads(1)
    with ShmTransport(odcfn.Mesh.from_env(), timeout=20) as tr:
        maps, inner = [], tr._map
        tr._map = lambda *a: (maps.append(a[1]), inner(*a))[1]
        state = make_state(FULL, MODEL, tr, optimizer=odcfn.sgd(1e-2), compute_dtype=torch.bfloat16)
        batch = odcfn.random_batch([5, 9, 3, 7], CFG.vocab_size, seed=0)
        for _ in range(3):
            state, _ = odcfn.train_step(state, batch)
            got = odcfn.gather_params(state, dtype=dtype)
        loop_maps = list(maps)
        exact = odcfn.gather_params(state, dtype=torch.float32)
        return loop_maps, got, exact


def test_an_rl_loop_with_bf16_compute_maps_the_segments_once(mp_pool):  # noqa: F811
    for maps, got, exact in mp_pool.run(rl_loop_worker, 2, args=(None,), timeout=120):
        assert maps == [torch.bfloat16], maps  # one publication for the whole loop
        # the trained params, rounded once to bf16 (what the step's gathers read too)
        want = odcfn.tree_map(lambda t: t.to(torch.bfloat16), exact)
        odcfn.tree_assert_allclose(got, want, rtol=0, atol=0)
        assert all(t.dtype == torch.bfloat16 for t in _leaves(got))


def test_the_full_precision_gather_remaps(mp_pool):  # noqa: F811
    for maps, got, _ in mp_pool.run(rl_loop_worker, 2, args=(torch.float32,), timeout=120):
        assert maps == [torch.bfloat16, torch.float32] * 3, maps  # what the default avoids
        assert all(t.dtype == torch.float32 for t in _leaves(got))
