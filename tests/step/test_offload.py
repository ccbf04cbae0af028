"""``StepConfig(offload=Offload(...))``: the owners' fp32 masters and optimizer state live in a
file (or host memory), the update streams through a bounded budget, and the run equals the
in-memory one bit for bit."""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import odcfn
from odcfn import lora
from odcfn.models import QwenConfig, QwenMoeConfig, init_params, qwen_model
from odcfn.optim import clip_scale
from odcfn.step import offload, offload_store
from odcfn.step.offload_store import store_of
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

CFG = QwenConfig(vocab_size=29, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
MOE = QwenMoeConfig(
    vocab_size=31,
    d_model=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_ff=12,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    norm_topk_prob=True,
)
DECAY = "no_norms_biases"


def _batch(seed: int, vocab: int = 29, n: int = 6) -> odcfn.Batch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (n,), generator=g).tolist()
    return odcfn.Batch(tuple(odcfn.Sample(torch.randint(0, vocab, (t,), generator=g)) for t in lengths))


def _copy(tree):
    return odcfn.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _run(model, full, W, off, *, steps=3, opt=None, vocab=29, **config):
    """(params, opt_state) per rank after ``steps`` train steps."""
    config.setdefault("deterministic", True)
    config.setdefault("max_grad_norm", 0.5)

    def fn(rank, tr):
        s = odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=opt or odcfn.adamw(1e-2, weight_decay=0.1, weight_decay_mask=DECAY),
            transport=tr,
            config=odcfn.StepConfig(offload=off, **config),
        )
        for i in range(steps):
            s, _ = odcfn.train_step(s, _batch(i, vocab))
        return _copy(s.params), _copy(s.opt_state)

    return odcfn.run_local(fn, W, timeout=60)


def _same(a, b):
    for (p0, s0), (p1, s1) in zip(a, b):
        assert p0.keys() == p1.keys()
        for k in p0:
            assert p0[k].dtype == p1[k].dtype and torch.equal(p0[k], p1[k]), k
        assert odcfn.tree_allclose(s0, s1, rtol=0, atol=0)
        assert s0["count"] == s1["count"]


@pytest.mark.parametrize(
    "balance,W,comm",
    [
        ("round_robin", 1, "odc"),
        ("local_sort", 3, "collective"),
        ("lb_micro", 2, "collective"),
        ("lb_mini", 3, "odc"),
    ],
)
def test_offloaded_run_equals_in_memory_bit_for_bit(tmp_path, balance, W, comm):
    model, full = qwen_model(CFG), init_params(CFG, seed=0)
    off = odcfn.Offload(path=tmp_path, budget_gib=0.001, prefetch=2)
    _same(
        _run(model, full, W, None, balance=balance, comm=comm),
        _run(model, full, W, off, balance=balance, comm=comm),
    )
    assert os.listdir(tmp_path) == []  # the state file is unlinked once mapped


@settings(max_examples=4, deadline=None)
@given(
    W=st.integers(1, 3),
    comm=st.sampled_from(["odc", "collective"]),
    prefetch=st.integers(0, 3),
    disk=st.booleans(),
    bf16=st.booleans(),
    sgd=st.booleans(),
)
def test_offload_property(tmp_path_factory, W, comm, prefetch, disk, bf16, sgd):
    model, full = qwen_model(CFG), init_params(CFG, seed=1)
    path = tmp_path_factory.mktemp("off") if disk else None
    off = odcfn.Offload(path=path, budget_gib=0.002, prefetch=prefetch)
    cfg = {"balance": "lb_micro", "comm": comm, "compute_dtype": torch.bfloat16 if bf16 else None, "steps": 2}
    make = (lambda: odcfn.sgd(1e-2, momentum=0.9, weight_decay=0.05)) if sgd else (lambda: None)
    _same(_run(model, full, W, None, opt=make(), **cfg), _run(model, full, W, off, opt=make(), **cfg))


def test_work_stealing_update_equals_the_in_memory_update_of_the_same_gradients(tmp_path):
    """Work stealing decides the summation order at run time, so two runs need not agree; the
    offloaded update of the gradients a step used must equal the whole-shard in-memory one."""
    model, full = qwen_model(CFG), init_params(CFG, seed=2)
    opt = odcfn.adamw(1e-2, weight_decay=0.1)

    def fn(rank, tr):
        s = odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=opt,
            transport=tr,
            config=odcfn.StepConfig(
                balance="work_stealing",
                max_grad_norm=0.5,
                offload=odcfn.Offload(path=tmp_path, budget_gib=0.001),
            ),
        )
        ref_p, ref_s = _copy(s.params), _copy(s.opt_state)
        for i in range(3):
            s, m = odcfn.train_step(s, _batch(i))
            ref_p, ref_s = opt.update(tr.grad_shards(), ref_s, ref_p, grad_scale=clip_scale(m.grad_norm, 0.5))
            for k in ref_p:
                assert torch.equal(ref_p[k], s.params[k]), k
            assert odcfn.tree_allclose(ref_s, s.opt_state, rtol=0, atol=0)
        return True

    assert all(odcfn.run_local(fn, 2, timeout=60))


def test_lora_base_has_no_offloaded_state_and_equals_in_memory(tmp_path):
    model, params = lora.apply(
        qwen_model(CFG), init_params(CFG, seed=3), rank=2, alpha=4, targets=("q_proj",)
    )
    off = odcfn.Offload(path=tmp_path, budget_gib=0.001)
    for dt in (None, torch.bfloat16):
        _same(_run(model, params, 2, None, compute_dtype=dt), _run(model, params, 2, off, compute_dtype=dt))

    def fn(rank, tr):
        s = odcfn.TrainState.create(
            params=params,
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=tr,
            config=odcfn.StepConfig(offload=off),
        )
        trained = [u for u in model.unit_names if u not in model.frozen]
        store = store_of(s.params, s.opt_state, trained)
        return (
            store.units == trained,
            set(s.opt_state["mu"]) == set(trained),
            all(getattr(s.params[u], "_odcfn_offload", None) is None for u in model.frozen),
        )

    assert model.frozen and all(all(r) for r in odcfn.run_local(fn, 2, timeout=60))


def test_moe_offloaded_equals_in_memory(tmp_path):
    model, full = qwen_model(MOE), init_params(MOE, seed=0)
    off = odcfn.Offload(path=tmp_path, budget_gib=0.001, prefetch=1)
    _same(
        _run(model, full, 2, None, vocab=31, expert_bias_rate=0.01),
        _run(model, full, 2, off, vocab=31, expert_bias_rate=0.01),
    )


def test_save_and_resume_read_and_restore_the_offloaded_state(tmp_path):
    model, full = qwen_model(CFG), init_params(CFG, seed=4)
    off = odcfn.Offload(path=tmp_path / "tier", budget_gib=0.001)
    (tmp_path / "tier").mkdir()
    ck = tmp_path / "ck"

    def make(tr, offl):
        return odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=odcfn.adamw(1e-2),
            transport=tr,
            config=odcfn.StepConfig(offload=offl, deterministic=True),
        )

    def fn(rank, tr):
        s = make(tr, off)
        for i in range(2):
            s, _ = odcfn.train_step(s, _batch(i))
        odcfn.save(ck, s)
        for i in range(2, 4):
            s, _ = odcfn.train_step(s, _batch(i))
        r = odcfn.load(ck, make(tr, off))
        resident = odcfn.load(ck, make(tr, None))  # an in-memory state reads the same checkpoint
        trained = list(model.unit_names)
        back = store_of(r.params, r.opt_state, trained) is not None
        for i in range(2, 4):
            r, _ = odcfn.train_step(r, _batch(i))
            resident, _ = odcfn.train_step(resident, _batch(i))
        return (
            _copy(s.params),
            _copy(s.opt_state),
            _copy(r.params),
            _copy(r.opt_state),
            _copy(resident.params),
            _copy(resident.opt_state),
            back,
        )

    out = odcfn.run_local(fn, 2, timeout=60)
    ref = _run(model, full, 2, None, steps=4, opt=odcfn.adamw(1e-2), max_grad_norm=None)
    for (p, s, rp, rs, mp, ms, back), r in zip(out, ref):
        assert back
        _same([(p, s), (rp, rs), (mp, ms)], [r, r, r])


def test_budget_and_window_bound_what_is_resident_and_each_unit_loads_once(tmp_path, monkeypatch):
    model, full = qwen_model(CFG), init_params(CFG, seed=5)
    off = odcfn.Offload(path=tmp_path, budget_gib=48000 / 2**30, prefetch=1)  # a layer twice
    reads, peaks = [], []
    real_read, real_finish = offload_store.Store.read, offload.Stream.finish

    def read(self, unit, buf):
        reads.append(unit)
        return real_read(self, unit, buf)

    def finish(self):
        real_finish(self)
        peaks.append((self.peak, self.most_ahead, self.budget))

    monkeypatch.setattr(offload_store.Store, "read", read)
    monkeypatch.setattr(offload.Stream, "finish", finish)
    world = odcfn.LocalWorld(1)
    s = odcfn.TrainState.create(
        params=full,
        model=model,
        optimizer=odcfn.adamw(1e-3),
        transport=world.transport(0),
        config=odcfn.StepConfig(offload=off),
    )
    for i in range(2):
        s, _ = odcfn.train_step(s, _batch(i))
        log_p = odcfn.log_probs(s, _batch(9))  # reads the resident published copies
    assert reads == list(model.unit_names) * 2  # one load per unit per step, nothing else
    assert len(log_p) == len(_batch(9))
    for peak, ahead, budget in peaks:
        assert 0 < peak <= budget and ahead <= 1


def test_bad_offload_config_is_named_before_any_communication(tmp_path, monkeypatch):
    model, full = qwen_model(CFG), init_params(CFG, seed=0)
    with pytest.raises(TypeError, match="StepConfig.offload"):
        odcfn.StepConfig(offload={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="Offload.budget_gib"):
        odcfn.Offload(path=tmp_path, budget_gib=0)
    with pytest.raises(ValueError, match="Offload.prefetch"):
        odcfn.Offload(path=tmp_path, prefetch=-1)
    with pytest.raises(ValueError, match="staleness"):
        odcfn.StepConfig(offload=odcfn.Offload(), staleness=1)
    (tmp_path / "file").write_text("x")
    cases = [
        (odcfn.Offload(path=tmp_path / "missing"), "Offload.path=.*not a directory"),
        (odcfn.Offload(path=tmp_path / "file"), "Offload.path=.*not a directory"),
        (
            odcfn.Offload(path=tmp_path, budget_gib=1e-6, prefetch=2),
            "Offload.budget_gib=1e-06 is below one unit",
        ),
    ]

    def fn(rank, tr):
        said = []
        for off, _ in cases:
            with pytest.raises(ValueError) as e:
                odcfn.TrainState.create(
                    params=full,
                    model=model,
                    optimizer=odcfn.adamw(1e-3),
                    transport=tr,
                    config=odcfn.StepConfig(offload=off),
                )
            said.append(str(e.value))
        return said, tr.counters.copy()

    out = odcfn.run_local(fn, 2, timeout=30)
    assert out[0][0] == out[1][0]  # every rank alike
    for msg, (_, want) in zip(out[0][0], cases):
        assert re.search(want, msg), msg
    assert out[0][1] == odcfn.LocalWorld(1).transport(0).counters  # no communication at all
    monkeypatch.setattr(os, "access", lambda p, mode: False)  # root may write anywhere: pretend not
    with pytest.raises(ValueError, match="Offload.path=.*not writable"):
        odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=odcfn.LocalWorld(1).transport(0),
            config=odcfn.StepConfig(offload=odcfn.Offload(path=tmp_path)),
        )
    monkeypatch.undo()
    from odcfn.step import offload_config

    monkeypatch.setattr(
        offload_config.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9, 1000)
    )
    with pytest.raises(ValueError, match=r"Offload.path=.*has 0.000 GiB free, the offloaded state needs"):
        odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=odcfn.LocalWorld(1).transport(0),
            config=odcfn.StepConfig(offload=odcfn.Offload(path=tmp_path)),
        )


def test_ranks_that_disagree_on_offload_fail_alike(tmp_path):
    model, full = qwen_model(CFG), init_params(CFG, seed=0)

    def fn(rank, tr):
        off = odcfn.Offload(path=tmp_path, budget_gib=0.001, prefetch=1 + rank)
        s = odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=tr,
            config=odcfn.StepConfig(offload=off),
        )
        with pytest.raises(ValueError, match="step config") as e:
            odcfn.train_step(s, _batch(0))
        return str(e.value)

    out = odcfn.run_local(fn, 2, timeout=30)
    assert out[0] == out[1]


def shm_worker(path: str | None, steps: int):
    """``steps`` AdamW steps on a ShmTransport (processes), offloaded when ``path`` is given."""
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    model, full = qwen_model(CFG), init_params(CFG, seed=6)
    mesh = odcfn.Mesh.from_env()
    off = None if path is None else odcfn.Offload(path=path, budget_gib=0.001)
    with ShmTransport(mesh, timeout=30) as tr:
        s = odcfn.TrainState.create(
            params=odcfn.shard(full, model, mesh),
            model=model,
            optimizer=odcfn.adamw(1e-2),
            transport=tr,
            config=odcfn.StepConfig(offload=off, deterministic=True),
        )
        syncs = 0
        for i in range(steps):
            s, m = odcfn.train_step(s, _batch(i))
            syncs += m.counters.syncs
        return _copy(s.params), _copy(s.opt_state), syncs


def test_processes_on_shared_memory_offloaded_equal_in_memory(mp_pool, tmp_path):  # noqa: F811
    mem = mp_pool.run(shm_worker, 2, args=(None, 2))
    off = mp_pool.run(shm_worker, 2, args=(str(tmp_path), 2))
    _same([r[:2] for r in mem], [r[:2] for r in off])
    assert [r[2] for r in off] == [2, 2]  # still one sync per step
