"""LoRA against PEFT on transformers' Qwen2, Qwen3 and Llama: loss, adapter gradients, three AdamW
steps at W=3 (ODC + LB-Mini and collective), the PEFT file format both ways, and what a
frozen base must never do (change, be scattered, hold optimizer state)."""

from __future__ import annotations

import peft
import pytest
import torch

import odcfn
from odcfn import lora
from odcfn.checkpoint.frozen import trained_model
from odcfn.models import from_hf, qwen_model, to_hf
from odcfn.schedule.plan import ReduceScatter, ScatterAccumulate
from tests.hf_families import hf_model

TARGETS = {  # each family with a different target set
    "qwen2": ("q_proj", "v_proj"),
    "qwen3": ("k_proj", "o_proj", "up_proj"),
    "llama3": ("q_proj", "gate_proj", "down_proj"),
}


def _peft_model(name: str, path, *, r: int, alpha: float, targets, rslora=False, tied=False):
    """A PEFT LoRA model on transformers' model, its B made non-zero (so A gets a gradient),
    and the same adapters in odcfn: ``(peft model, lora model, lora params, cfg)``."""
    ref = hf_model(name, qk_noise=0.25, tied=tied)
    ref.save_pretrained(path)
    cfg, base = from_hf(path)
    conf = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, use_rslora=rslora
    )
    pm = peft.get_peft_model(ref, conf)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model, params = lora.apply(qwen_model(cfg), base, rank=r, alpha=alpha, targets=targets, use_rslora=rslora)
    sd = lora.peft_state_dict(model, params)
    got = {k.replace(".default.weight", ".weight"): p for k, p in pm.named_parameters() if "lora_" in k}
    assert set(got) == set(sd)  # PEFT adapts exactly the projections odcfn does
    params = lora.load_peft_tensors(model, params, got)
    return pm, model, params, cfg


def _peft_loss(pm, batch: odcfn.Batch) -> torch.Tensor:
    total = 0.0
    for s in batch.samples:
        ids = s.tokens.long()[None]
        logits = pm(input_ids=ids).logits[0].float()
        total = total + torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
    return total / batch.num_loss_tokens


def _value_and_grad(model, params, batch):
    """The single-process reference: plain autograd on the unsharded params."""
    p = odcfn.tree_map(lambda x: x.detach().clone().requires_grad_(), params)
    loss = odcfn.reference_loss(model, p, batch)
    loss.backward()
    return loss.detach(), odcfn.tree_map(lambda x: torch.zeros_like(x) if x.grad is None else x.grad, p)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", list(TARGETS))
def test_loss_and_adapter_grads_equal_peft(tmp_path, name):
    rslora = name == "qwen3"
    pm, model, params, _ = _peft_model(
        name, tmp_path / "hf", r=4, alpha=8, targets=TARGETS[name], rslora=rslora
    )
    batch = odcfn.random_batch([9, 17, 5], model.vocab_size, seed=2)
    want = _peft_loss(pm, batch)
    want.backward()
    want_g = {
        k.replace(".default.weight", ".weight"): p.grad for k, p in pm.named_parameters() if "lora_" in k
    }
    loss, grads = _value_and_grad(model, params, batch)
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    got_g = lora.peft_state_dict(model, grads)
    for k, g in want_g.items():
        assert float(g.norm()) > 0, k
        assert _rel(got_g[k], g) <= 1e-5, (k, _rel(got_g[k], g))
    # the sharded step at W=3 gives the same adapter gradients; the base gets none
    outs = odcfn.run_local(
        lambda r, t: odcfn.grad_step(_state(model, params, t, "odc"), batch), 3, timeout=60
    )
    full = odcfn.unshard([o[0] for o in outs], trained_model(model), odcfn.Mesh(3, 0))
    for k, g in lora.peft_state_dict(model, full).items():
        assert _rel(g, want_g[k]) <= 1e-5, k
    assert set(outs[0][0]) == set(lora.adapter_units(model))


def _state(model, params, transport, comm, lr=1e-2):
    cfg = odcfn.StepConfig(comm=comm, balance="lb_mini", max_tokens_per_microbatch=24)
    return odcfn.TrainState.create(
        params=params,
        model=model,
        optimizer=odcfn.adamw(lr, weight_decay=0.1),
        transport=transport,
        config=cfg,
    )


def _batches(vocab: int) -> list[odcfn.Batch]:
    return [
        odcfn.random_batch(ls, vocab, seed=10 + i)
        for i, ls in enumerate([[9, 17, 5, 12, 3], [20, 4, 8, 8], [3, 3, 15, 11, 6, 2]])
    ]


@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_three_adamw_steps_at_w3_equal_peft(tmp_path, comm):
    pm, model, params, cfg = _peft_model(
        "qwen2", tmp_path / "hf", r=3, alpha=6, targets=("q_proj", "v_proj", "down_proj"), tied=True
    )
    batches = _batches(model.vocab_size)
    trained = [p for n, p in pm.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n, p in pm.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    want_losses = []
    for b in batches:
        opt.zero_grad()
        loss = _peft_loss(pm, b)
        loss.backward()
        opt.step()
        want_losses.append(float(loss))

    def run(rank, t):
        st = _state(model, params, t, comm)
        frozen0 = {k: st.params[k].clone() for k in model.frozen}
        losses, plans, counters = [], [], []
        for b in batches:
            st, m = odcfn.train_step(st, b)
            losses.append(m.loss)
            plans.append(m.plan)
            counters.append(m.counters)
        return st, frozen0, losses, plans, counters

    outs = odcfn.run_local(run, 3, timeout=120)
    assert [o[2] for o in outs][0] == pytest.approx(want_losses, rel=1e-5)

    adapters = set(lora.adapter_units(model))
    for st_r, frozen0, _, plans, counters in outs:
        for k in model.frozen:  # bit for bit
            assert torch.equal(st_r.params[k], frozen0[k]), k
        assert set(st_r.opt_state["mu"]) == set(st_r.opt_state["nu"]) == adapters
        for plan, c in zip(plans, counters):
            pushed = [s.unit for s in plan.steps if isinstance(s, (ScatterAccumulate, ReduceScatter))]
            assert pushed and set(pushed) <= adapters  # no push of a frozen unit is ever issued
            assert c.syncs == 1
            if comm == "odc":  # every scatter the transport made was an adapter's
                assert c.scatters == len(pushed)
    full = odcfn.unshard([o[0].params for o in outs], model, odcfn.Mesh(3, 0))
    got = lora.peft_state_dict(model, full)
    want = {
        k.replace(".default.weight", ".weight"): p.detach() for k, p in pm.named_parameters() if "lora_" in k
    }
    start = lora.peft_state_dict(model, params)
    for k, w in want.items():
        assert _rel(got[k], w) <= 1e-4, (k, _rel(got[k], w))
        assert _rel(w, start[k]) > 1e-3  # the adapters moved
    # the PEFT round trip: odcfn's trained adapters load with PeftModel.from_pretrained
    paths = odcfn.run_local(lambda r, t: lora.save_peft(tmp_path / "peft", outs[r][0]), 3, timeout=60)
    assert paths[0] is not None and paths[1] is None and paths[2] is None  # one writer
    back = peft.PeftModel.from_pretrained(
        type(pm.base_model.model).from_pretrained(tmp_path / "hf"), tmp_path / "peft"
    ).eval()
    ids = batches[0].samples[1].tokens.long()[None]
    with torch.no_grad():
        got_logits, want_logits = back(input_ids=ids).logits, pm.eval()(input_ids=ids).logits
    assert _rel(got_logits, want_logits) <= 1e-5
    # merged weights export through to_hf and give the same logits without PEFT
    with pytest.raises(ValueError, match="LoRA adapters"):
        to_hf(tmp_path / "unmerged", full, cfg)
    to_hf(tmp_path / "merged", lora.merge(model, full), cfg)
    merged = type(pm.base_model.model).from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert _rel(merged(input_ids=ids).logits, want_logits) <= 1e-5


def test_a_peft_saved_adapter_loads_into_odcfn(tmp_path):
    pm, model, params, _ = _peft_model("llama3", tmp_path / "hf", r=2, alpha=5, targets=TARGETS["llama3"])
    pm.save_pretrained(tmp_path / "peft")
    fresh_model, fresh = lora.apply(
        qwen_model(from_hf(tmp_path / "hf")[0]),
        from_hf(tmp_path / "hf")[1],
        rank=2,
        alpha=5,
        targets=TARGETS["llama3"],
        seed=7,
    )
    loaded = lora.load_peft(tmp_path / "peft", fresh_model, fresh)
    batch = odcfn.random_batch([11, 6], model.vocab_size, seed=4)
    with torch.no_grad():
        want = float(_peft_loss(pm, batch))
    got = float(odcfn.reference_loss(fresh_model, loaded, batch))
    assert abs(got - want) <= 1e-5 * abs(want)
    before = float(odcfn.reference_loss(fresh_model, fresh, batch))
    assert abs(before - want) > 1e-3 * abs(want)  # the adapters made the difference
