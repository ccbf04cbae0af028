"""End to end against transformers: 3 AdamW steps of odcfn (ODC, LB-Mini, W=3 ranks) from a
Hugging Face checkpoint, exported with ``to_hf``, equal 3 steps of transformers' own model with
``torch.optim.AdamW`` and the same weight-decay mask, per parameter kind; tied embeddings stay
one matrix on both sides."""

from __future__ import annotations

import re

import pytest
import torch

import odcfn
from odcfn.models import from_hf, qwen_model, shard_from_hf, to_hf
from odcfn.models.hf import hf_name
from odcfn.optim import DECAY_MASKS
from tests.hf_families import hf_model

LR, WD, STEPS, W = 1e-2, 0.1, 3, 3
MASK = "no_norms_biases"


def _batches(vocab: int) -> list[odcfn.Batch]:
    lengths = [[9, 17, 5, 12, 7, 20], [14, 3, 22, 8, 11, 6], [19, 10, 4, 16, 13, 9]]
    return [odcfn.random_batch(ls, vocab, seed=10 + i) for i, ls in enumerate(lengths)]


def _reference(ref, batches, decayed_hf: set[str]) -> list[float]:
    named = dict(ref.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named.items() if n in decayed_hf]},
            {"params": [p for n, p in named.items() if n not in decayed_hf], "weight_decay": 0.0},
        ],
        lr=LR,
        weight_decay=WD,
    )
    losses = []
    for batch in batches:
        opt.zero_grad()
        total = 0.0
        for s in batch.samples:
            ids = s.tokens.long()[None]
            logits = ref(input_ids=ids).logits[0].float()
            total = total + torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
        loss = total / batch.num_loss_tokens
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _odcfn(path, batches) -> tuple[dict, list[float]]:
    optimizer = odcfn.adamw(LR, weight_decay=WD, weight_decay_mask=MASK)

    def rank(r: int, transport) -> tuple[dict, list[float]]:
        cfg, shards = shard_from_hf(path, transport.mesh)
        config = odcfn.StepConfig(comm="odc", balance="lb_mini", max_tokens_per_microbatch=30)
        state = odcfn.TrainState.create(
            params=shards, model=qwen_model(cfg), optimizer=optimizer, transport=transport, config=config
        )
        losses = []
        for batch in batches:
            state, m = odcfn.train_step(state, batch)
            losses.append(m.loss)
        return state.params, losses

    out = odcfn.run_local(rank, W)
    cfg = from_hf(path)[0]
    return odcfn.unshard([s for s, _ in out], qwen_model(cfg), odcfn.Mesh(W)), out[0][1]


def _kind(name: str) -> str:
    return re.sub(r"layers\.\d+\.", "layers.*.", name)


CASES = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True), ("llama3", False)]


@pytest.mark.parametrize(("name", "tied"), CASES, ids=[f"{n}{'-tied' if t else ''}" for n, t in CASES])
def test_three_adamw_steps_equal_transformers(tmp_path, name, tied):
    # moderate q/k: a saturated softmax leaves near-zero gradients, whose sign (fp32 summation
    # order) Adam would turn into full-size steps
    ref = hf_model(name, qk_noise=0.25, tied=tied)  # tied: Qwen2.5 / Qwen3 small sizes
    ref.save_pretrained(tmp_path / "hf")
    cfg = from_hf(tmp_path / "hf")[0]
    assert cfg.tie_embeddings == tied
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    decayed = {
        hf_name(u, p) for u, sub in qwen_model(cfg).shapes.items()
        for p in odcfn.tree.tree_flatten_with_path(sub)[0] if DECAY_MASKS[MASK](f"{u}.{p}")
    }  # fmt: skip
    assert decayed and decayed != set(start)  # the mask splits the parameters
    batches = _batches(cfg.vocab_size)
    want_losses = _reference(ref, batches, decayed)
    full, losses = _odcfn(tmp_path / "hf", batches)
    assert losses == pytest.approx(want_losses, rel=1e-5)
    to_hf(tmp_path / "out", full, cfg)
    got = dict(type(ref).from_pretrained(tmp_path / "out").named_parameters())
    want = dict(ref.named_parameters())
    assert set(got) == set(want)
    kinds: dict[str, list[str]] = {}
    for n in want:
        kinds.setdefault(_kind(n), []).append(n)
    for kind, names in kinds.items():
        a = torch.cat([got[n].detach().reshape(-1) for n in names])
        b = torch.cat([want[n].detach().reshape(-1) for n in names])
        s = torch.cat([start[n].reshape(-1) for n in names])
        rel = float((a - b).norm() / b.norm())
        moved = float((b - s).norm() / b.norm())
        assert rel <= 1e-4, (kind, rel)
        assert moved > 100 * max(rel, 1e-6), (kind, moved, rel)  # the steps were not a no-op
