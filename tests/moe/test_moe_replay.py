"""Routing replay: ``Sample.extras["routed_experts"]`` makes the forward use exactly the given
experts, weighted by the router's own probabilities there (so the router still learns)."""

from __future__ import annotations

import types

import pytest
import torch

import odcfn
from odcfn.models import qwen_model
from odcfn.models.moe import sparse_layers
from tests.moe.test_moe import _grad_step, _hf_grad, _sharp, hf_moe, leaf_grads, params_from

KEY = "routed_experts"


def _replay(T: int, layers: int, k: int, e: int, seed: int) -> torch.Tensor:
    """Random distinct experts per (token, layer): not what the router would choose."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack(
        [torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(layers)]) for _ in range(T)]
    )


def _patch_router(router, replay_TxK: torch.Tensor) -> None:
    """transformers' top-k router, with the choice replaced by ``replay_TxK``."""

    def forward(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top = probs.gather(1, replay_TxK)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), replay_TxK

    router.forward = types.MethodType(forward, router)


@pytest.mark.parametrize("family,norm", [("Qwen3Moe", True), ("Qwen2Moe", False)])
def test_replay_equals_transformers_with_the_same_indices(family, norm):
    ref, cfg = hf_moe(family, norm=norm, aux=False, mlp_only=(1,))
    with torch.no_grad():  # experts strong enough that which ones run shows in the loss
        for n, p in ref.named_parameters():
            if ".mlp.experts." in n:
                p.mul_(8.0)
    model, params = qwen_model(cfg), params_from(ref, cfg)
    sparse = sparse_layers(cfg)
    ids = torch.randint(0, 61, (13,), generator=torch.Generator().manual_seed(3))
    replay = _replay(13, len(sparse), cfg.num_experts_per_tok, cfg.num_experts, seed=1)
    plain_loss, _ = leaf_grads(params, odcfn.Batch((odcfn.Sample(ids),)), model)
    loss, grads = leaf_grads(params, odcfn.Batch((odcfn.Sample(ids, extras={KEY: replay}),)), model)
    assert abs(loss - plain_loss) > 1e-4  # the replayed experts are not the router's own choice
    for j, i in enumerate(sparse):
        _patch_router(ref.model.layers[i].mlp.gate, replay[:, j])
    out = ref(input_ids=ids[None], labels=ids[None])
    out.loss.backward()
    assert loss == pytest.approx(float(out.loss.detach()), rel=1e-5)
    hf = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}
    for i in sparse:  # the router learns through the replayed experts' probabilities
        got = grads[f"layers.{i}"]
        want_gate = _hf_grad(hf, f"model.layers.{i}.mlp.gate.weight").reshape(-1)
        assert float(want_gate.abs().max()) > 0
        assert any(
            torch.allclose(got[o : o + want_gate.numel()], want_gate, rtol=1e-4, atol=1e-7)
            for o in range(0, got.numel() - want_gate.numel() + 1, cfg.d_model)
        )


@pytest.mark.parametrize("comm,remat", [("odc", False), ("odc", True), ("collective", False)])
def test_sharded_replay_equals_reference(comm, remat):
    from odcfn.models import QwenMoeConfig

    cfg = QwenMoeConfig(
        vocab_size=31,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_ff=12,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.3,
    )
    params = _sharp(cfg, 4)
    g = torch.Generator().manual_seed(0)
    samples = []
    for j, n in enumerate((9, 4, 12, 6)):
        samples.append(
            odcfn.Sample(
                torch.randint(0, 31, (n,), generator=g), extras={KEY: _replay(n, 2, 2, 5, seed=10 + j)}
            )
        )
    batch = odcfn.Batch(tuple(samples))
    ref_loss, ref_grads = leaf_grads(params, batch, qwen_model(cfg))
    out = _grad_step(cfg, params, batch, 2, comm=comm, remat=remat, max_tokens_per_microbatch=16)
    for unit, want in ref_grads.items():
        got = torch.cat([gr[unit] for gr, _ in out])[: want.numel()]
        assert float((got - want).abs().max()) <= 2e-5 * (float(want.abs().max()) + 1e-12) + 1e-9, unit
    assert all(m.loss == pytest.approx(ref_loss, rel=1e-5) for _, m in out)
    # log_probs replays too: its per-token log-probs give the reference's token loss
    model = qwen_model(cfg)

    def lp(rank, transport):
        state = odcfn.TrainState.create(
            params=params,
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=transport,
            config=odcfn.StepConfig(comm=comm),
        )
        return odcfn.log_probs(state, batch)

    logps = odcfn.run_local(lp, world_size=2)[0]
    plain = odcfn.Batch(tuple(odcfn.Sample(s.tokens) for s in samples))
    assert not torch.allclose(
        torch.cat(logps),
        torch.cat(
            odcfn.run_local(
                lambda r, t: odcfn.log_probs(
                    odcfn.TrainState.create(
                        params=params, model=model, optimizer=odcfn.adamw(1e-3), transport=t
                    ),
                    plain,
                ),
                world_size=1,
            )[0]
        ),
    )


@pytest.mark.parametrize(
    "bad,match,both",
    [
        (lambda r: r[:, :1], "shape", True),  # a batch holds one shape per extra: both samples
        (lambda r: r.float(), "integer", True),
        (lambda r: r.clone().index_fill_(0, torch.tensor([2]), 5), "outside", False),
        (lambda r: torch.stack([r[..., 0], r[..., 0]], -1), "repeats", False),
    ],
)
def test_bad_replay_is_refused_on_every_rank_before_any_communication(bad, match, both):
    from odcfn.models import QwenMoeConfig

    cfg = QwenMoeConfig(
        vocab_size=31,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_ff=12,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    model, params = qwen_model(cfg), _sharp(cfg, 1)
    first = _replay(6, 2, 2, 5, 0)
    good = odcfn.Sample(torch.arange(6), extras={KEY: bad(first) if both else first})
    worse = odcfn.Sample(torch.arange(7), extras={KEY: bad(_replay(7, 2, 2, 5, 1))})
    batch = odcfn.Batch((good, worse))

    def worker(rank, transport):
        state = odcfn.TrainState.create(
            params=params, model=model, optimizer=odcfn.adamw(1e-3), transport=transport
        )
        before = transport.counters.copy()
        with pytest.raises((ValueError, TypeError), match=match) as e:
            odcfn.train_step(state, batch)
        assert f"sample {0 if both else 1}" in str(e.value)
        return transport.counters - before

    for c in odcfn.run_local(worker, world_size=2):
        assert c.syncs == c.gathers == c.collectives == 0


def test_a_dense_model_refuses_routing_replay():
    cfg = odcfn.models.QwenConfig(vocab_size=31, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=12)
    model = qwen_model(cfg)
    batch = odcfn.Batch(
        (odcfn.Sample(torch.arange(5), extras={KEY: torch.zeros(5, 1, 2, dtype=torch.long)}),)
    )

    def worker(rank, transport):
        state = odcfn.TrainState.create(
            params=odcfn.models.init_params(cfg),
            model=model,
            optimizer=odcfn.adamw(1e-3),
            transport=transport,
        )
        with pytest.raises(ValueError, match="no experts"):
            odcfn.train_step(state, batch)

    odcfn.run_local(worker, world_size=1)
