"""Bounded staleness with LoRA and bf16 compute (docs/staleness.md, "What works with it"): a run
with a forced lag reads stale versions and equals the single-process replay of its record; the
frozen base is never pushed and never changes."""

from __future__ import annotations

import threading

import torch

import odcfn
from odcfn.models import QwenConfig, QwenMoeConfig, init_params, qwen_model
from odcfn.reference import replay
from odcfn.step import stale
from odcfn.tree import tree_leaves

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
N = 5


def _batches():
    return [odcfn.random_batch([5, 9, 3, 7], CFG.vocab_size, seed=20 + s) for s in range(N)]


def _lagged_run(model, full, optimizer, **config):
    """Rank 1 starts step j only after rank 0 finished step j + 1 (a lag of 1 on rank 0)."""
    finished = [threading.Event() for _ in range(N)]

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=full, model=model, optimizer=optimizer, transport=tr,
                                     config=odcfn.StepConfig(staleness=1, **config))
        ms = []
        for j, b in enumerate(_batches()):
            if rank == 0 and j:
                finished[j - 1].set()
            if rank == 1 and 1 <= j <= N - 3:
                assert finished[j + 1].wait(20)
            st, m = odcfn.train_step(st, b)
            ms.append(m)
        st, _ = stale.drain(st)
        return st.params, ms

    out = odcfn.run_local(fn, 2)
    assert max(m.extra["staleness_max"] for m in out[0][1]) == 1
    return odcfn.unshard([p for p, _ in out], model, odcfn.Mesh(2, 0)), stale.record([m for _, m in out])


def _err(a, b):
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(tree_leaves(a), tree_leaves(b)))


def test_lora_adapters_follow_the_versions_and_the_base_never_moves():
    model, params = odcfn.lora.apply(qwen_model(CFG), init_params(CFG, seed=0), rank=4, alpha=8,
                                     targets=("q_proj", "v_proj"))
    opt = odcfn.sgd(0.5)
    got, rec = _lagged_run(model, params, opt)
    want = replay(model, params, opt, _batches(), rec)
    assert _err(got, want) < 2e-6
    sync = [[(s, {u: k for u in v}) for s, v in r] for k, r in enumerate(rec)]
    assert _err(got, replay(model, params, opt, _batches(), sync)) > 1e-5  # the lag mattered
    for unit in model.frozen:
        assert _err(got[unit], params[unit]) == 0.0  # the frozen base: bit for bit the start
    assert any(_err(got[u], params[u]) > 1e-3 for u in model.unit_names if u not in model.frozen)


def test_bf16_compute_equals_the_replay_to_bf16_rounding():
    model, full = qwen_model(CFG), init_params(CFG, seed=0)
    opt = odcfn.sgd(0.5)
    got, rec = _lagged_run(model, full, opt, compute_dtype=torch.bfloat16)
    want = replay(model, full, opt, _batches(), rec)  # fp32 throughout: the bound is bf16's
    sync = [[(s, {u: k for u in v}) for s, v in r] for k, r in enumerate(rec)]
    off = _err(want, replay(model, full, opt, _batches(), sync))
    err = _err(got, want)
    assert err < 0.05 and err < off / 2, (err, off)  # nearer its own schedule than the synchronous one
    for leaf in tree_leaves(got):
        assert leaf.dtype == torch.float32  # fp32 masters; bf16 only on the wire and in compute


def test_save_log_probs_and_gather_params_read_one_version_on_every_owner(tmp_path):
    """Called on the state a lagged train_step returned (not drained), they wait for the version
    every owner applied all steps to: the params ``drain`` then gives; training goes on."""
    model, full = qwen_model(CFG), init_params(CFG, seed=0)
    probe = odcfn.random_batch([6, 4], CFG.vocab_size, seed=99)
    gate = threading.Event()

    def fn(rank, tr):
        st = _fresh(model, full, tr)
        for j, b in enumerate(_batches()[:3]):
            if rank == 1 and j == 2:
                assert gate.wait(20)  # rank 0 returns from step 2 before step 1 is applied anywhere
            st, m = odcfn.train_step(st, b)
        applied = m.extra["version_applied"]
        if rank == 0:
            gate.set()
        lp = odcfn.log_probs(st, probe)
        gathered = odcfn.gather_params(st)
        odcfn.save(tmp_path / "ckpt", st)
        drained, _ = stale.drain(st)
        lp_drained = odcfn.log_probs(drained, probe)
        st, _ = odcfn.train_step(drained, _batches()[3])
        stale.drain(st)
        return applied, lp, lp_drained, gathered, drained.params

    out = odcfn.run_local(fn, 2)
    assert out[0][0] < 3  # rank 0's own state after step 2 was behind: the calls had to wait
    want = odcfn.unshard([o[4] for o in out], model, odcfn.Mesh(2, 0))
    for _, lp, lp_drained, gathered, _ in out:
        assert _err(gathered, want) == 0.0
        assert all(torch.equal(a, b) for a, b in zip(lp, lp_drained))
    loaded = odcfn.run_local(lambda r, tr: odcfn.load(tmp_path / "ckpt", _fresh(model, full, tr)).params, 2)
    assert _err(odcfn.unshard(loaded, model, odcfn.Mesh(2, 0)), want) == 0.0


def _fresh(model, full, tr):
    return odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.5), transport=tr,
                                   config=odcfn.StepConfig(staleness=1))


def test_a_mixture_reports_each_steps_expert_loads_late():
    cfg = QwenMoeConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    model, full = qwen_model(cfg), init_params(cfg, seed=0)
    batches = [odcfn.random_batch([5, 9, 3, 7], cfg.vocab_size, seed=s) for s in range(4)]

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.3), transport=tr,
                                     config=odcfn.StepConfig(staleness=1))
        reports = {}
        for b in batches:
            st, m = odcfn.train_step(st, b)
            reports.update(m.extra["reports"])
        st, late = stale.drain(st)
        return {**reports, **late}

    for reports in odcfn.run_local(fn, 2):
        assert sorted(reports) == [0, 1, 2, 3]
        for k, fig in reports.items():
            loads = [v for key, v in fig.items() if key.startswith("moe/load/")]
            assert len(loads) == len(model.routed)
            for load in loads:  # every token of the minibatch chose top-k experts, on some rank
                assert float(load.sum()) == sum(batches[k].lengths) * cfg.num_experts_per_tok


def test_the_balancers_lists_are_dealt_afresh_each_step():
    """Under staleness rank r runs list ``dealt(r, j, W)`` of the balancer's assignment: a
    permutation per step, the same on every rank, so the heaviest list moves between ranks."""
    for w in (2, 3, 4):
        for j in range(20):
            assert sorted(stale.dealt(r, j, w) for r in range(w)) == list(range(w))
        assert len({tuple(stale.dealt(r, j, w) for r in range(w)) for j in range(20)}) > 1
    lengths = [40, 3, 30, 2, 20, 1]
    model, full = qwen_model(CFG), init_params(CFG, seed=0)
    batches = [odcfn.random_batch(lengths, CFG.vocab_size, seed=s) for s in range(6)]

    def fn(rank, tr):
        st = odcfn.TrainState.create(params=full, model=model, optimizer=odcfn.sgd(0.1), transport=tr,
                                     config=odcfn.StepConfig(staleness=1, balance="lb_mini"))
        ran = []
        for b in batches:
            st, m = odcfn.train_step(st, b)
            ran.append(sorted(i for mb in m.plan.microbatches for i in mb))
        stale.drain(st)
        return ran

    out = odcfn.run_local(fn, 2)
    for j in range(len(batches)):
        assert sorted(out[0][j] + out[1][j]) == list(range(len(lengths)))  # every sample once
    assert len({tuple(out[0][j]) for j in range(len(batches))}) == 2  # rank 0 ran both lists
