"""Error-feedback residuals (``StepConfig(push_format=..., push_error_feedback=True)``) are part
of a checkpoint: save at step s, load into a fresh state on fresh transports and continue equals
the uninterrupted run bit for bit (deterministic mode: rank-order pushes), blocking and in the
background; a checkpoint whose residuals do not fit the state is refused naming what differs,
before the state changes, unless ``feedback="reset"`` (then the run equals a fresh start of the
residuals, which differs: the residuals really are carried). The residuals sit in each rank's
own file, so its sha256 covers them, and a save that fails midway keeps the previous checkpoint
with its residuals."""

from __future__ import annotations

import json

import pytest
import torch

import odcfn
from odcfn.checkpoint import sharded
from odcfn.checkpoint.sharded import read_manifest
from tests.util import make_state, tiny

CFG, MODEL, FULL = tiny()
LENGTHS = [9, 17, 5, 12, 7, 20]
BATCHES = [odcfn.random_batch(LENGTHS, CFG.vocab_size, seed=s) for s in range(4)]
WIRE = dict(push_format="int8", push_error_feedback=True, deterministic=True, balance="lb_mini",
            max_tokens_per_microbatch=20)


def _run(world, steps, *, load=None, save=None, mode="strict", blocking=True, clear_at=None, switch_at=None,
         **cfg):
    """Train ``world`` ranks to ``steps`` (from ``load`` if given; saving at the end to ``save``):
    each rank's params, optimizer moments and residuals. The references of ``feedback="reset"``,
    in memory: ``clear_at``: the residuals dropped after that step; ``switch_at``: error feedback
    off until that step, on after it."""

    def fn(rank, tr):
        on = {**WIRE, **cfg}
        first = {**on, "push_error_feedback": on["push_error_feedback"] and switch_at is None}
        state = make_state(FULL, MODEL, tr, odcfn.adamw(1e-2), **first)
        if load is not None:
            state = odcfn.load(load, state, feedback=mode)
        while state.step < steps:
            if state.step == clear_at:
                tr.wire_state().residual.clear()
            if state.step == switch_at:
                state = state.replace(config=odcfn.StepConfig(**on))
            state, _ = odcfn.train_step(state, BATCHES[state.step])
        if save is not None:
            saver = odcfn.save(save, state, blocking=blocking)
            if not blocking:
                saver.wait()
        res = {k: v.clone() for k, v in tr.wire_state().residual.items()}
        return ({k: v.clone() for k, v in state.params.items()},
                {k: v.clone() for k, v in state.opt_state["mu"].items()}, res)

    return odcfn.run_local(fn, world, timeout=60)


def _same(a, b) -> bool:
    return all(all(torch.equal(x[k], y[k]) for k in x) and x.keys() == y.keys()
               for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("blocking", [True, False])
def test_save_load_continue_equals_the_uninterrupted_run_bit_for_bit(tmp_path, blocking):
    whole = _run(2, 4)
    first = _run(2, 2, save=tmp_path / "ck", blocking=blocking)
    assert all(r[2] for r in first)  # the residuals saved are not empty
    resumed = _run(2, 4, load=tmp_path / "ck")
    assert _same(whole, resumed)
    # the residual mattered: starting it at zero gives another run (so this test can fail),
    # the one whose residuals were dropped at the save
    reset = _run(2, 4, load=tmp_path / "ck", mode="reset")
    assert not _same(whole, reset)
    assert _same(reset, _run(2, 4, clear_at=2))
    assert read_manifest(tmp_path / "ck")["extra"]["push_feedback"] == {
        "push_format": "int8", "quant_block": 128, "world_size": 2, "sharding": "full"}


def test_bf16_pushes_and_three_ranks_resume_bit_for_bit(tmp_path):
    cfg = dict(push_format="bf16", gather_format="fp8_e4m3")
    whole = _run(3, 3, **cfg)
    _run(3, 1, save=tmp_path / "ck", **cfg)
    assert _same(whole, _run(3, 3, load=tmp_path / "ck", **cfg))


def _refused(world, path, match, mode="strict", **cfg):
    """Every rank refuses the load naming ``match``; the state it was given is unchanged."""

    def fn(rank, tr):
        state = make_state(FULL, MODEL, tr, odcfn.adamw(1e-2), **{**WIRE, **cfg})
        before = {k: v.clone() for k, v in state.params.items()}
        with pytest.raises(ValueError, match=match):
            odcfn.load(path, state, feedback=mode)
        ws = tr.wire_state()
        return all(torch.equal(before[k], state.params[k]) for k in before), ws.residual, state.step

    for same, residual, step in odcfn.run_local(fn, world, timeout=60):
        assert same and residual == {} and step == 0


def test_mismatched_checkpoints_are_refused_naming_what_differs(tmp_path):
    _run(2, 1, save=tmp_path / "fb")
    _run(2, 1, save=tmp_path / "plain", push_error_feedback=False)
    fix = "pass feedback='reset'"
    _refused(2, tmp_path / "plain", f"holds no error-feedback residuals.*push_error_feedback=True.*{fix}")
    _refused(2, tmp_path / "fb", f"holds error-feedback residuals.*push_error_feedback=False.*{fix}",
             push_error_feedback=False)
    _refused(2, tmp_path / "fb", "push_format='int8', the state has StepConfig.push_format='bf16'",
             push_format="bf16")
    _refused(2, tmp_path / "fb", "quant_block=128, the state has StepConfig.quant_block=64", quant_block=64)
    _refused(3, tmp_path / "fb", "world_size=2, the state has Mesh.world_size=3")
    _refused(2, tmp_path / "fb", r"feedback must be one of \['strict', 'reset'\], got 'zero'", mode="zero")


def test_reset_switches_error_feedback_on_or_off_at_a_resume(tmp_path):
    _run(2, 1, save=tmp_path / "plain", push_error_feedback=False)
    _run(2, 1, save=tmp_path / "fb")
    # on: as the run that switched it on in memory after step 1 (residuals from zero)
    assert _same(_run(2, 3, load=tmp_path / "plain", mode="reset"), _run(2, 3, switch_at=1))
    # off: the residuals are dropped, the run goes on without them
    off = _run(2, 3, load=tmp_path / "fb", mode="reset", push_error_feedback=False)
    assert all(r[2] == {} for r in off)
    assert not _same(off, _run(2, 3))


def test_a_tampered_residual_fails_the_rank_files_sha256(tmp_path):
    _run(2, 1, save=tmp_path / "ck")
    f = tmp_path / "ck" / "rank-00001.safetensors"
    raw = bytearray(f.read_bytes())
    n = int.from_bytes(raw[:8], "little")  # safetensors: header length, JSON header, data
    header = json.loads(raw[8 : 8 + n])
    names = [k for k in header if k.startswith("feedback/")]
    assert names and all(header[k]["dtype"] == "F32" for k in names)
    raw[8 + n + header[names[0]]["data_offsets"][0]] ^= 1  # one bit of a residual
    f.write_bytes(bytes(raw))

    def fn(rank, tr):
        state = make_state(FULL, MODEL, tr, odcfn.adamw(1e-2), **WIRE)
        with pytest.raises(ValueError, match="rank-00001.safetensors does not match the sha256"):
            odcfn.load(tmp_path / "ck", state)
        return True

    assert all(odcfn.run_local(lambda r, t: fn(r, t) if r == 1 else True, 2, timeout=60))


def test_hybrid_sharding_with_residuals_is_refused_before_any_file(tmp_path):
    def fn(rank, tr):
        state = make_state(FULL, MODEL, tr, odcfn.adamw(1e-2), **WIRE)
        with pytest.raises(ValueError, match="push_error_feedback=True under hybrid sharding"):
            odcfn.save(tmp_path / "ck", state)
        return True

    assert all(odcfn.run_local(fn, 4, ranks_per_node=2, sharding="hybrid", timeout=60))
    assert not (tmp_path / "ck").exists() and not list(tmp_path.iterdir())


def test_a_save_that_fails_midway_keeps_the_previous_checkpoint_and_its_residuals(tmp_path, monkeypatch):
    _run(2, 1, save=tmp_path / "ck")
    real = sharded.save_file

    def failing(tensors, where, metadata=None):  # rank 1 dies writing its file (disk full, say)
        if metadata["rank"] == "1":
            raise OSError(28, "No space left on device")
        return real(tensors, where, metadata=metadata)

    monkeypatch.setattr(sharded, "save_file", failing)

    def fn(rank, tr):
        state = make_state(FULL, MODEL, tr, odcfn.adamw(1e-2), **WIRE)
        for b in BATCHES[:2]:
            state, _ = odcfn.train_step(state, b)
        with pytest.raises((OSError, ValueError), match="No space left on device"):
            odcfn.save(tmp_path / "ck", state, overwrite=True)
        return True

    assert all(odcfn.run_local(fn, 2, timeout=60))
    monkeypatch.setattr(sharded, "save_file", real)
    assert read_manifest(tmp_path / "ck")["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no staging left
    assert _same(_run(2, 3), _run(2, 3, load=tmp_path / "ck"))
