"""Hostile train steps: ranks given different minibatches or configs, non-finite losses and
gradients, token ids outside the vocabulary, and params/checkpoints of a model of another config
with the same shapes. Every case is refused on every rank,
before the optimizer step, with the one sync per minibatch unchanged."""

from __future__ import annotations

import os

import pytest
import torch

import odcfn
from odcfn.checkpoint.sharded import CheckpointError, read_shards, write_shards
from odcfn.models import QwenConfig, qwen_model
from odcfn.transport.shm import ShmTransport
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import TINY, make_state, tiny

CFG, MODEL, FULL = tiny()
LENGTHS = [5, 9, 3, 7]


def _batch(lengths=LENGTHS, seed=0):
    return odcfn.random_batch(lengths, CFG.vocab_size, seed=seed)


def _same(a, b) -> bool:
    """Bit-identical, NaN included."""
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        return True
    except AssertionError:
        return False


def _outcomes(per_rank, world=2, model=MODEL, full=FULL, steps=1, **config):
    """``per_rank(rank) -> (batch, config overrides)``; every rank's outcome: the exception it
    raised or its metrics, plus whether its params and optimizer state stayed unchanged."""

    def fn(rank, tr):
        batch, over = per_rank(rank)
        state = make_state(full, model, tr, optimizer=odcfn.adamw(1e-2), **{**config, **over})
        p0 = {k: v.clone() for k, v in state.params.items()}
        o0 = odcfn.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state.opt_state)
        try:
            for _ in range(steps):
                new, m = odcfn.train_step(state, batch)
            out = m
        except (ValueError, FloatingPointError) as e:
            out, new = e, state
        return out, _same((new.params, new.opt_state), (p0, o0)), tr.counters.syncs

    return odcfn.run_local(fn, world, timeout=30)


@pytest.mark.parametrize(
    "case, what",
    [
        ("lengths", "the sample lengths / loss-token count differ"),
        ("tokens", "the token ids / loss masks differ"),
        ("mask", "the token ids / loss masks differ"),
        ("cap", "the step config differ"),
        ("balance", "the step config differ"),
        ("max_grad_norm", "the step config differ"),
    ],
)
def test_ranks_that_disagree_on_the_minibatch_all_refuse_the_step(case, what):
    def per_rank(rank):
        b, over = _batch(), {}
        if rank == 1:
            if case == "lengths":
                b = _batch([5, 9, 3, 8])
            elif case == "tokens":
                b = _batch(seed=1)  # same lengths, other ids
            elif case == "mask":
                s = b.samples[2]
                b = odcfn.Batch(
                    (*b.samples[:2], odcfn.Sample(s.tokens, torch.tensor([0, 0, 1])), b.samples[3])
                )
            elif case == "cap":
                over = {"max_tokens_per_microbatch": 12}
            elif case == "balance":
                over = {"balance": "lb_mini"}
            else:
                over = {"max_grad_norm": 1.0}
        return b, over

    out = _outcomes(per_rank, max_tokens_per_microbatch=16)
    for rank, (err, same, syncs) in enumerate(out):
        assert isinstance(err, ValueError), (rank, err)
        assert str(err).startswith("ranks disagree on the minibatch: ") and what in str(err), str(err)
        assert same and syncs == 1, rank  # state unchanged; the check rode the one sync


def test_agreeing_ranks_still_sync_once_and_match_the_reference():
    batch = _batch()
    ref_loss, ref_g = odcfn.reference_value_and_grad(MODEL, FULL, batch)

    def fn(rank, tr):
        g, m = odcfn.grad_step(make_state(FULL, MODEL, tr, max_tokens_per_microbatch=12), batch)
        return g, m.loss, m.counters.syncs

    out = odcfn.run_local(fn, 2)
    for rank, (g, loss, syncs) in enumerate(out):
        assert syncs == 1 and abs(loss - float(ref_loss)) < 1e-5
        odcfn.tree_assert_allclose(g, odcfn.shard(ref_g, MODEL, odcfn.Mesh(2, rank)), rtol=1e-5, atol=1e-6)


def test_models_of_another_config_with_the_same_shapes_disagree():
    other = qwen_model(QwenConfig(**{**TINY.__dict__, "rope_theta": 500000.0}))
    assert other.shapes == MODEL.shapes and other.config_key != MODEL.config_key

    def fn(rank, tr):
        state = make_state(FULL, MODEL if rank == 0 else other, tr)
        with pytest.raises(ValueError, match="the parameter layout / model config differ") as e:
            odcfn.train_step(state, _batch())
        return "rope_theta=500000.0" in str(e.value) or "rope_theta=10000.0" in str(e.value)

    assert odcfn.run_local(fn, 2) == [True, True]


@pytest.mark.parametrize("where", ["param", "loss"])
def test_a_nonfinite_step_is_refused_on_every_rank_with_the_state_unchanged(where):
    full = odcfn.tree_map(lambda t: t.clone(), FULL)
    if where == "param":  # one NaN weight: without the check every shard is NaN after one step
        full["layers.0"]["mlp"]["down_proj"]["weight"][0, 0] = float("nan")
    else:  # an overflowing embedding: finite params, an infinite loss
        full["embed"]["embed_tokens"]["weight"].fill_(3e38)
    out = _outcomes(lambda rank: (_batch(), {}), full=full)
    for err, same, syncs in out:
        assert isinstance(err, FloatingPointError) and "refusing the step" in str(err), err
        assert same and syncs == 1
    # skip-and-count instead: no exception, nothing applied, the skip flagged, steps keep going
    out = _outcomes(lambda rank: (_batch(), {}), full=full, steps=2, nonfinite="skip")
    for m, same, syncs in out:
        assert m.extra["skipped_nonfinite"] is True and same and syncs == 2
    with pytest.raises(ValueError, match="nonfinite must be 'raise' or 'skip'"):
        odcfn.StepConfig(nonfinite="ignore")


def test_token_ids_outside_the_vocabulary_fail_before_any_communication():
    s = [odcfn.Sample(torch.tensor([1, 2, 3])), odcfn.Sample(torch.tensor([4, CFG.vocab_size, 6, 7]))]

    def fn(rank, tr):
        with pytest.raises(ValueError) as e:
            odcfn.train_step(make_state(FULL, MODEL, tr), odcfn.Batch(tuple(s)))
        return str(e.value), tr.counters == odcfn.Counters()

    for msg, untouched in odcfn.run_local(fn, 2):
        assert msg == "batch sample 1: token id 37 at position 1 is outside the model's vocabulary [0, 37)"
        assert untouched
    neg = odcfn.Batch((odcfn.Sample(torch.tensor([3, -1, 2])),))
    with pytest.raises(ValueError, match="batch sample 0: token id -1 at position 1"):
        odcfn.run_local(lambda r, tr: odcfn.train_step(make_state(FULL, MODEL, tr), neg), 1)


def test_a_checkpoint_of_another_config_with_the_same_shapes_is_refused(tmp_path):
    other = qwen_model(QwenConfig(**{**TINY.__dict__, "n_heads": 2, "n_kv_heads": 1, "d_ff": 24}))
    if other.shapes != MODEL.shapes:  # head counts change k/v shapes; RoPE base never does
        other = qwen_model(QwenConfig(**{**TINY.__dict__, "rope_theta": 1e6}))
    p = odcfn.shard(FULL, MODEL, odcfn.Mesh(1))
    write_shards(tmp_path / "ck", p, {}, 3, model=MODEL, mesh=odcfn.Mesh(1))
    with pytest.raises(CheckpointError, match="saved from a model of another config .* rope_theta=10000.0"):
        read_shards(tmp_path / "ck", model=other, mesh=odcfn.Mesh(1))
    assert read_shards(tmp_path / "ck", model=MODEL, mesh=odcfn.Mesh(1))[2] == 3


# --- the same across processes (ShmTransport): where the fault really is --------------------


def disagreeing_worker():
    torch.set_num_threads(1)
    mesh = odcfn.Mesh.from_env()
    cfg, model, full = tiny(
        QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
    )
    batch = odcfn.random_batch(LENGTHS, cfg.vocab_size, seed=mesh.rank)  # each rank its own ids
    with ShmTransport(mesh, timeout=20) as tr:
        state = make_state(full, model, tr, optimizer=odcfn.adamw(1e-2))
        try:
            odcfn.train_step(state, batch)
            out = "trained"
        except ValueError as e:
            out = str(e)
        good, m = odcfn.train_step(state, odcfn.random_batch(LENGTHS, cfg.vocab_size, seed=7))
        left = [f for f in os.listdir("/dev/shm") if f.startswith(os.environ["ODCFN_SHM_PREFIX"])]
        return out, tr.dist.calls["all_reduce"], m.counters.syncs, good.step, left


def test_ranks_with_different_batches_refuse_across_processes(mp_pool):  # noqa: F811
    for msg, all_reduces, syncs, step, left in mp_pool.run(disagreeing_worker, 2, timeout=120):
        assert msg.startswith("ranks disagree on the minibatch: the token ids / loss masks differ"), msg
        # the refused step and a good one after it: one all-reduce each (plus the setup's
        # tag/barriers), and the transport still works
        assert syncs == 1 and step == 1 and left == []
        assert all_reduces >= 2
