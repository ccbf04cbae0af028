"""The RL passes keep "ranks that disagree all raise": ``log_probs`` and ``gather_params`` carry
the fingerprint in their one sync, like ``train_step``. Ranks given different rollouts (or asking
for other units, or at other steps) all raise the same ``ValueError`` instead of summing garbage;
ranks that agree still sync exactly once. Threads (``run_local``) and processes (ShmTransport)."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import make_state, tiny

CFG, MODEL, FULL = tiny()
LENGTHS = [5, 9, 3, 7]


def _batch(seed=0, lengths=LENGTHS):
    return odcfn.random_batch(lengths, CFG.vocab_size, seed=seed)


def _outcomes(call, world=2, **config):
    """``call(rank, state)`` on every rank: its result or the exception, and its syncs."""

    def fn(rank, tr):
        state = make_state(FULL, MODEL, tr, **config)
        before = tr.counters.syncs
        try:
            out = call(rank, state)
        except ValueError as e:
            out = e
        return out, tr.counters.syncs - before

    return odcfn.run_local(fn, world, timeout=30)


def _all_refuse(outcomes, prefix):
    for rank, (err, syncs) in enumerate(outcomes):
        assert isinstance(err, ValueError), (rank, err)
        assert str(err).startswith(prefix), str(err)
        assert syncs == 1, (rank, syncs)  # the check rode the pass's one sync


@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_log_probs_of_ranks_given_different_rollouts_all_raise(comm):
    out = _outcomes(lambda r, s: odcfn.log_probs(s, _batch(seed=r)), comm=comm, balance="lb_micro")
    _all_refuse(out, "ranks disagree on the minibatch: the token ids / loss masks differ")
    assert "to log_probs" in str(out[0][0])


def test_log_probs_of_ranks_with_other_temperatures_all_raise():
    out = _outcomes(lambda r, s: odcfn.log_probs(s, _batch(), temperature=1.0 + r))
    _all_refuse(out, "ranks disagree on the minibatch: the step config differ")


def test_log_probs_of_agreeing_ranks_still_match_and_sync_once():
    out = _outcomes(lambda r, s: odcfn.log_probs(s, _batch()))
    (a, sa), (b, sb) = out
    assert sa == sb == 1
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert float(a[1][1:].abs().sum()) > 0  # real values, not the fingerprint's


@pytest.mark.parametrize("comm", ["odc", "collective"])
@pytest.mark.parametrize(
    "case", ["dst", "units", "dtype"],
)
def test_gather_params_of_ranks_asking_for_different_things_all_raise(comm, case):
    names = MODEL.unit_names

    def call(rank, state):
        if case == "dst":
            return odcfn.gather_params(state, dst=rank)
        if case == "units":
            return odcfn.gather_params(state, units=names[: 1 + rank])
        return odcfn.gather_params(state, dtype=(torch.float32, torch.float64)[rank])

    _all_refuse(_outcomes(call, comm=comm, balance="lb_micro"),
                "ranks disagree on the gather: the request (dst / units) differ")


def test_gather_params_of_ranks_at_other_steps_all_raise():
    def call(rank, state):
        return odcfn.gather_params(state.replace(step=state.step + rank))

    out = _outcomes(call)
    _all_refuse(out, "ranks disagree on the gather: the parameter layout / model config / step differ")
    assert "to gather_params" in str(out[1][0])


def test_gather_params_of_agreeing_ranks_still_match():
    for got, syncs in _outcomes(lambda r, s: odcfn.gather_params(s)):
        odcfn.tree_assert_allclose(got, FULL, rtol=0, atol=0)
        assert syncs == 1


def disagreeing_passes_worker():
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    with ShmTransport(mesh, timeout=20) as tr:
        state = make_state(FULL, MODEL, tr)
        said = []
        for call in (lambda: odcfn.log_probs(state, _batch(seed=mesh.rank)),
                     lambda: odcfn.gather_params(state, units=MODEL.unit_names[: 1 + mesh.rank])):
            try:
                call()
                said.append("passed")
            except ValueError as e:
                said.append(str(e))
        full = odcfn.gather_params(state)  # the transport still works after both refusals
        return said, odcfn.tree_allclose(full, FULL, rtol=0, atol=0)


def test_processes_given_different_rollouts_all_raise(mp_pool):  # noqa: F811
    for said, works in mp_pool.run(disagreeing_passes_worker, 2, timeout=120):
        assert said[0].startswith("ranks disagree on the minibatch: the token ids / loss masks differ"), said
        assert said[1].startswith("ranks disagree on the gather: the request (dst / units) differ"), said
        assert works


@pytest.mark.parametrize("flag, instead", [("adapters_only", "odcfn.lora.gather_adapters"),
                                           ("merged", "odcfn.lora.gather_merged")])
def test_the_lora_flags_of_gather_params_name_their_new_home(flag, instead):
    state = odcfn.TrainState.create(params=FULL, model=MODEL, optimizer=odcfn.sgd(0.0),
                                    transport=odcfn.LocalWorld(1).transport(0))
    with pytest.raises(TypeError, match=rf"gather_params\({flag}=...\) moved to LoRA: call {instead}"):
        odcfn.gather_params(state, **{flag: True})
