"""A frozen LoRA base kept resident only in its gather format (``StepConfig(quantize_frozen=True)``,
ZeRO++'s MixZ++), against the same run whose base is kept in full precision:

- a LoRA step equals, bit for bit, the step with the same ``gather_format`` over a full-precision
  base (the compute only ever sees the dequantized base), at W = 1-3 on threads, in collective
  mode, and in two /dev/shm processes (over torch.distributed's gloo: within fp32 summation order);
- the base's resident bytes are exactly the format's size: payload, padding to 4 bytes, one fp32
  scale per block; (1 + 4 / block) / 2 of bf16 when the shards are whole blocks;
- what reads the base: ``log_probs`` (policy and ``lora_reference``) unchanged bit for bit;
  checkpoints hold no base and load alike into either state; ``gather_params`` and
  ``odcfn.lora.gather_merged`` return the dequantized base (what the gathers delivered);
- bad input is refused naming the key, before any communication.
"""

from __future__ import annotations

import math

import pytest
import torch

import odcfn
from odcfn import lora
from odcfn.checkpoint.sharded import read_manifest
from odcfn.kernels.quant import get_format, roundtrip
from odcfn.step.frozen_quant import state_bytes
from odcfn.transport.shm import ShmTransport
from odcfn.tree import tree_leaves
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture
from tests.util import tiny

CFG, BASE_MODEL, BASE = tiny()
MODEL, FULL = lora.apply(BASE_MODEL, BASE, rank=2, alpha=4.0, targets=("q_proj", "v_proj", "up_proj"))
_g = torch.Generator().manual_seed(5)
FULL = {  # B non-zero: the adapters change the policy from the first step on
    k: odcfn.tree_map(lambda x: torch.randn(x.shape, generator=_g) * 0.1, v) if k not in MODEL.frozen else v
    for k, v in FULL.items()
}
BATCH = odcfn.random_batch([9, 17, 5, 12, 7], CFG.vocab_size, seed=0)


def _state(tr, quantize: bool, fmt: str | None = "int8", **kw):
    kw = {"deterministic": True, "max_tokens_per_microbatch": 20, **kw}  # a fixed summation order
    cfg = odcfn.StepConfig(gather_format=fmt, quantize_frozen=quantize, **kw)
    return odcfn.TrainState.create(params=FULL, model=MODEL, optimizer=odcfn.adamw(1e-2), transport=tr,
                                   config=cfg)


def _train(world: int, quantize: bool, steps: int = 2, **kw):
    def fn(rank, tr):
        state = _state(tr, quantize, **kw)
        losses = []
        for _ in range(steps):
            state, m = odcfn.train_step(state, BATCH)
            losses.append(m.loss)
        return {k: v.clone() for k, v in state.params.items()}, losses, m.counters.gather_bytes

    return odcfn.run_local(fn, world, timeout=30)


def _held(fmt: str, block: int = 128) -> torch.dtype:
    return get_format(fmt, block).element_dtype


CASES = [  # (world, gather_format, compute_dtype, comm)
    (1, "int8", None, "odc"),
    (2, "fp8_e4m3", torch.bfloat16, "odc"),
    (3, "int8", torch.bfloat16, "odc"),
    (3, "fp8_e4m3", None, "odc"),
    (2, "bf16", None, "odc"),
    (2, "int8", torch.bfloat16, "collective"),
]


@pytest.mark.parametrize(("world", "fmt", "dtype", "comm"), CASES)
def test_a_lora_step_equals_the_full_precision_base_bit_for_bit(world, fmt, dtype, comm):
    balance = "lb_micro" if comm == "collective" else "lb_mini"
    kw = dict(fmt=fmt, compute_dtype=dtype, comm=comm, balance=balance)
    held, full = _train(world, True, **kw), _train(world, False, **kw)
    for (p, losses, moved), (ref, ref_losses, ref_moved) in zip(held, full):
        assert losses == ref_losses
        assert moved == ref_moved  # the same bytes travelled
        for k in ref:
            if k in MODEL.frozen:  # held encoded: the format's element type (bf16: its cast)
                assert p[k].dtype == _held(fmt), k
            else:
                assert torch.equal(p[k], ref[k]), k
    # the adapters moved (the comparison is not of two untouched states)
    mesh = odcfn.Mesh(world).with_rank(0)
    start = odcfn.shard(FULL, MODEL, mesh)
    assert any(not torch.equal(held[0][0][k], start[k]) for k in start if k not in MODEL.frozen)


def shm_worker(quantize: bool):
    torch.set_num_threads(1)
    with ShmTransport(odcfn.Mesh.from_env(), timeout=30) as tr:
        state = _state(tr, quantize, fmt="fp8_e4m3", compute_dtype=torch.bfloat16)
        for _ in range(2):
            state, m = odcfn.train_step(state, BATCH)
        # float8 tensors do not pickle back through multiprocessing: their bytes and dtype
        held = {k: str(state.params[k].dtype) for k in MODEL.frozen}
        params = {k: v.view(torch.uint8).clone() if k in held else v.clone() for k, v in state.params.items()}
        return params, held, m.counters.gather_bytes


def test_shm_processes_equal_threads_and_the_full_precision_base(mp_pool):  # noqa: F811
    out = mp_pool.run(shm_worker, 2, args=(True,))
    full = _train(2, False, fmt="fp8_e4m3", compute_dtype=torch.bfloat16)
    for (params, held, moved), (ref, _, ref_moved) in zip(out, full):
        assert moved == ref_moved > 0
        assert held == {k: "torch.float8_e4m3fn" for k in MODEL.frozen}
        assert all(torch.equal(params[k], ref[k]) for k in ref if k not in MODEL.frozen)


def gloo_worker():
    """CollectiveTransport (torch.distributed over gloo), collective mode, int8 gathers of a held base."""
    torch.set_num_threads(1)
    from odcfn.transport.collective import CollectiveTransport

    with CollectiveTransport(odcfn.Mesh.from_env(), timeout=30) as tr:
        state = _state(tr, True, comm="collective", balance="lb_micro", compute_dtype=torch.bfloat16)
        state, m = odcfn.train_step(state, BATCH)
        frozen = {k: str(state.params[k].dtype) for k in MODEL.frozen}
        return {k: v.clone() for k, v in state.params.items() if k not in frozen}, frozen, m.loss


def test_torch_distributed_collectives_equal_the_full_precision_base(mp_pool):  # noqa: F811
    out = mp_pool.run(gloo_worker, 2)
    full = _train(2, False, steps=1, comm="collective", balance="lb_micro", compute_dtype=torch.bfloat16)
    for (params, frozen, loss), (ref, ref_losses, _) in zip(out, full):
        assert frozen == {k: "torch.int8" for k in MODEL.frozen}
        assert loss == ref_losses[0]
        # gloo sums the reduce-scatter in its own order: equal up to fp32 summation order
        assert all(torch.allclose(params[k], ref[k], rtol=1e-6, atol=1e-7) for k in params)


def _nbytes(n: int, block: int) -> int:
    """An independent count: 1 byte a value padded to 4, one fp32 scale per started block."""
    return 4 * math.ceil(n / 4) + 4 * math.ceil(n / block)


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("block", [128, 16])
def test_resident_bytes_of_the_base_are_the_formats_size(fmt, block):
    def fn(rank, tr):
        kw = dict(fmt=fmt, quant_block=block)
        return (state_bytes(_state(tr, True, **kw)), state_bytes(_state(tr, False, **kw)),
                state_bytes(_state(tr, False, compute_dtype=torch.bfloat16, **kw)))

    for world in (1, 2):
        layout = odcfn.make_layout(MODEL, odcfn.Mesh(world))
        sizes = [u.shard_size for u in layout.units if u.frozen]
        for held, fp32, bf16 in odcfn.run_local(fn, world, timeout=30):
            assert fp32.frozen == 4 * sum(sizes) and bf16.frozen == 2 * sum(sizes)
            want = 2 * sum(sizes) if fmt == "bf16" else sum(_nbytes(n, block) for n in sizes)
            assert held.frozen == want
            # trained units and optimizer state unchanged
            assert (held.trained, held.optimizer) == (fp32.trained, fp32.optimizer)
            if world == 1 and block == 16 and fmt != "bf16":  # every shard is whole blocks (16 | n)
                assert all(n % block == 0 for n in sizes)
                assert held.frozen / bf16.frozen == (1 + 4 / block) / 2


def _logprobs(world: int, quantize: bool, fmt: str = "int8", dtype=torch.bfloat16):
    def fn(rank, tr):
        state = _state(tr, quantize, fmt=fmt, compute_dtype=dtype)
        state, _ = odcfn.train_step(state, BATCH)
        policy = odcfn.log_probs(state, BATCH)
        ref = odcfn.log_probs(odcfn.lora_reference(state), BATCH)
        return policy, ref

    return odcfn.run_local(fn, world, timeout=30)


@pytest.mark.parametrize(("world", "fmt"), [(1, "int8"), (3, "fp8_e4m3")])
def test_log_probs_of_policy_and_reference_are_unchanged(world, fmt):
    held, full = _logprobs(world, True, fmt), _logprobs(world, False, fmt)
    for (pol, ref), (pol0, ref0) in zip(held, full):
        assert all(torch.equal(a, b) for a, b in zip(pol, pol0))
        assert all(torch.equal(a, b) for a, b in zip(ref, ref0))
        assert not all(torch.equal(a, b) for a, b in zip(pol, ref))  # the adapters matter


def _dequantized(world: int, fmt: str, dtype: torch.dtype) -> dict:
    """The full params as gathers deliver them: each owner's frozen shard (cast to the compute
    dtype when narrower, as the state keeps it) through ``fmt``; the adapters as they are."""
    mesh = odcfn.Mesh(world)
    f = get_format(fmt)
    shards = []
    for o in range(world):
        s = odcfn.shard(FULL, MODEL, mesh.with_rank(o))
        shards.append({k: roundtrip(v.to(dtype), f, dtype) if k in MODEL.frozen else v.to(dtype)
                       for k, v in s.items()})
    return odcfn.unshard(shards, MODEL, mesh)


@pytest.mark.parametrize(("world", "dtype"), [(2, torch.bfloat16), (3, torch.float32)])
def test_gather_params_and_merged_return_the_dequantized_base(world, dtype):
    def fn(rank, tr):
        held, full = _state(tr, True, compute_dtype=dtype), _state(tr, False, compute_dtype=dtype)
        return (odcfn.gather_params(held), lora.gather_merged(held), lora.gather_adapters(held),
                odcfn.gather_params(full), lora.gather_adapters(full))

    want = _dequantized(world, "int8", dtype)
    merged = lora.merge(MODEL, want)
    for params, got_merged, adapters, full_params, full_adapters in odcfn.run_local(fn, world, timeout=30):
        odcfn.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), params, want)
        odcfn.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), got_merged, merged)
        odcfn.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0), adapters, full_adapters)
        # the full-precision state returns the base itself: the difference quantize_frozen makes
        base = {k: odcfn.tree_map(lambda x: x.to(dtype), FULL[k]) for k in MODEL.frozen}
        odcfn.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0),
                       {k: full_params[k] for k in MODEL.frozen}, base)
        assert any(not torch.equal(a, b) for k in MODEL.frozen
                   for a, b in zip(tree_leaves(params[k]), tree_leaves(base[k])))


def test_checkpoints_hold_no_base_and_load_into_either_state(tmp_path):
    def fn(rank, tr):
        held = _state(tr, True, compute_dtype=torch.bfloat16)
        held, _ = odcfn.train_step(held, BATCH)
        odcfn.save(tmp_path / "held", held)
        after, _ = odcfn.train_step(held, BATCH)  # the uninterrupted run
        fresh = odcfn.load(tmp_path / "held", _state(tr, True, compute_dtype=torch.bfloat16))
        resumed, _ = odcfn.train_step(fresh, BATCH)
        into_full = odcfn.load(tmp_path / "held", _state(tr, False, compute_dtype=torch.bfloat16))
        return held, fresh, after, resumed, into_full

    for held, fresh, after, resumed, into_full in odcfn.run_local(fn, 2, timeout=30):
        for k in MODEL.unit_names:
            if k in MODEL.frozen:  # the loaded state keeps its own base, held encoded
                assert fresh.params[k].dtype == torch.int8
                assert torch.equal(fresh.params[k], held.params[k])
                assert into_full.params[k].dtype == torch.bfloat16  # the full state keeps its own
            else:
                assert torch.equal(fresh.params[k], held.params[k])
                assert torch.equal(into_full.params[k], held.params[k])
                assert torch.equal(resumed.params[k], after.params[k])
        odcfn.tree_map(lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0),
                       fresh.opt_state, held.opt_state)
    # the checkpoint references the base; it holds the trained units only
    assert read_manifest(tmp_path / "held")["extra"]["frozen_base"]["units"] == list(MODEL.frozen)


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        (dict(quantize_frozen=True), ValueError, "StepConfig.quantize_frozen=True needs a gather_format"),
        (dict(quantize_frozen="yes", gather_format="int8"), TypeError, "quantize_frozen must be a bool"),
        (dict(quantize_frozen=1, gather_format="int8"), TypeError, "quantize_frozen must be a bool"),
    ],
)
def test_bad_settings_are_refused_at_construction(kw, err, match):
    with pytest.raises(err, match=match):
        odcfn.StepConfig(**kw)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(gather_format="fp8_e4m3"), r"held encoded as torch.int8.*StepConfig.quantize_frozen"),
        (dict(quantize_frozen=False), r"held encoded as torch.int8.*StepConfig.quantize_frozen"),
        (dict(quant_block=64), r"quant_block=64 take"),
    ],
)
def test_a_config_that_does_not_match_the_held_base_is_refused_before_any_communication(change, match):
    def fn(rank, tr):
        state = _state(tr, True)
        state = state.replace(config=state.config.replace(**change))
        for call in (lambda: odcfn.train_step(state, BATCH), lambda: odcfn.log_probs(state, BATCH),
                     lambda: odcfn.gather_params(state)):
            with pytest.raises(ValueError, match=match):
                call()
        return tr.counters.as_dict(), dict(tr.collectives.calls)

    for counters, calls in odcfn.run_local(fn, 2, timeout=30):
        assert not any(counters.values()) and not calls


class _NoWire:
    """A transport without wire formats (as the GPU ones are today): it must never be called."""

    def __init__(self, tr):
        self.mesh, self.counters, self.collectives = tr.mesh, tr.counters, tr.collectives
        self.gather, self.scatter_accumulate, self.fetch_add = tr.gather, tr.scatter_accumulate, tr.fetch_add

    def __getattr__(self, name):
        raise AttributeError(name)


def test_a_transport_without_formats_is_refused_before_any_communication():
    def fn(rank, tr):
        state = _state(_NoWire(tr), True, deterministic=False)
        with pytest.raises(ValueError, match="StepConfig.gather_format='int8': _NoWire does not move"):
            odcfn.train_step(state, BATCH)
        return tr.counters.as_dict(), dict(tr.collectives.calls)

    for counters, calls in odcfn.run_local(fn, 2, timeout=30):
        assert not any(counters.values()) and not calls
