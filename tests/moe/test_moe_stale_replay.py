"""Issue 40, item 14: a stale run of a mixture of experts equals an independent replay of its
record. The replay is single-process autograd on unsharded params (``Model.apply`` per sample,
no executor, no expert source but the experts in memory): step ``k``'s gradient is the sum over
ranks of the gradient of that rank's samples' share of the minibatch loss, each unit (every
expert included) at the version that rank read, with the router's auxiliary loss counted per
sequence on the rank that ran it, at that rank's versions (as the run splits it); plain SGD then
applies it to version ``k``."""

from __future__ import annotations

import threading

import torch

import odcfn
from odcfn.batch import pack
from odcfn.models import QwenMoeConfig, init_params, qwen_model
from odcfn.sharding import make_layout, shard, unshard
from odcfn.step import stale
from odcfn.tree import tree_leaves

CFG = QwenMoeConfig(
    vocab_size=37,
    d_model=16,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    d_ff=24,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    output_router_logits=True,
    router_aux_loss_coef=0.5,
)
N, LR = 4, 0.5


def _batches():
    return [odcfn.random_batch([5, 9, 3, 7], CFG.vocab_size, seed=60 + s) for s in range(N)]


def _lagged_run(model, full):
    """Rank 1 starts step j only after rank 0 finished step j + 1: rank 0 reads one version behind."""
    finished = [threading.Event() for _ in range(N)]

    def fn(rank, tr):
        st = odcfn.TrainState.create(
            params=full,
            model=model,
            optimizer=odcfn.sgd(LR),
            transport=tr,
            config=odcfn.StepConfig(staleness=1),
        )
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

    out = odcfn.run_local(fn, 2, timeout=60)
    assert max(m.extra["staleness_max"] for m in out[0][1]) == 1
    return odcfn.unshard([p for p, _ in out], model, odcfn.Mesh(2, 0)), stale.record([m for _, m in out])


def _replay(model, full, record, *, aux=True):
    """The independent replay (module doc); ``aux=False`` leaves the auxiliary loss out."""
    mesh = odcfn.Mesh(1, 0)
    layout = make_layout(model, mesh)
    history = {0: shard(full, model, mesh)}  # version -> {unit: flat}
    for k, (batch, ranks) in enumerate(zip(_batches(), record, strict=True)):
        grads = {u: torch.zeros_like(history[k][u]) for u in model.unit_names}
        for samples, versions in ranks:
            if not samples:
                continue
            # an expert this rank never gathered has no token of its samples routed to it, so
            # its version is never read (and its gradient stays 0)
            point = {u: history[versions.get(u, k)][u].detach().requires_grad_() for u in model.unit_names}
            tree = {u: layout[u].unflatten(point[u]) for u in model.unit_names}
            total = torch.zeros((), dtype=torch.float64)
            for i in samples:
                mb = pack(batch, [i])
                log = model.router.log(mb.seqlens, len(batch), graph=True)
                total = total + model.apply(tree, mb, log) / batch.num_loss_tokens
                if aux:
                    total = total + log.aux_loss()
            got = torch.autograd.grad(total, [point[u] for u in model.unit_names], allow_unused=True)
            for u, g in zip(model.unit_names, got):
                if g is not None:
                    grads[u] += g.to(grads[u].dtype)
        history[k + 1] = {u: history[k][u] - LR * grads[u] for u in model.unit_names}
    return unshard([history[N]], model, mesh)


def _err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(tree_leaves(a), tree_leaves(b)))


def test_a_lagged_moe_run_equals_the_independent_replay_with_the_aux_loss_split_by_rank():
    model, full = qwen_model(CFG), init_params(CFG, seed=0)
    got, rec = _lagged_run(model, full)
    experts = [u for u in model.unit_names if ".experts." in u]
    assert any(e in v for ranks in rec for _, v in ranks for e in experts)  # experts were gathered
    assert _err(got, _replay(model, full, rec)) < 2e-6
    # the record is what it equals: the same samples at the synchronous versions differ, and so
    # does the replay without the auxiliary loss (so the split of the aux loss was checked)
    sync = [[(s, dict.fromkeys(v, k)) for s, v in ranks] for k, ranks in enumerate(rec)]
    assert _err(got, _replay(model, full, sync)) > 1e-5
    assert _err(got, _replay(model, full, rec, aux=False)) > 1e-5
