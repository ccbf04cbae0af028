"""LoRA dropout: PEFT's dropout on the A path's input, training only, with masks keyed on the
LoRA seed, the optimizer step and each sample's index in the minibatch (never on ranks or
microbatches). The sharded step's adapter gradients equal PEFT's LoRA on transformers' Qwen2
with the same masks put in place of PEFT's dropout modules, for several world sizes,
balancers, both comm modes and remat; log-probs never drop."""

from __future__ import annotations

import peft
import pytest
import torch

import odcfn
from odcfn import lora
from odcfn.checkpoint.frozen import trained_model
from odcfn.models import QwenConfig, from_hf, init_params, qwen_model
from tests.hf_families import hf_model

P, SEED, STEP = 0.3, 11, 5
TARGETS = ("q_proj", "v_proj", "down_proj")


class _Masked(torch.nn.Module):
    """Stands in for PEFT's ``lora_dropout`` module: zeroes the inputs ``mask`` names, x 1/(1-p)."""

    def __init__(self) -> None:
        super().__init__()
        self.mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(self.mask, 0) / (1 - P)


def _setup(tmp_path):
    ref = hf_model("qwen2", qk_noise=0.25)
    ref.save_pretrained(tmp_path / "hf")
    cfg, base = from_hf(tmp_path / "hf")
    conf = peft.LoraConfig(r=3, lora_alpha=6, target_modules=list(TARGETS), lora_dropout=P)
    pm = peft.get_peft_model(ref, conf)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:  # non-zero B: A gets a gradient
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model, params = lora.apply(qwen_model(cfg), base, rank=3, alpha=6, targets=TARGETS, dropout=P, seed=SEED)
    got = {k.replace(".default.weight", ".weight"): p for k, p in pm.named_parameters() if "lora_" in k}
    params = lora.load_peft_tensors(model, params, got)
    masked = {}  # (unit, projection path) -> the module PEFT's dropout was replaced by
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_dropout") and "default" in mod.lora_dropout:
            layer, path = name.split(".layers.")[1].split(".", 1)
            masked[(f"layers.{layer}", path)] = mod.lora_dropout["default"] = _Masked()
    assert len(masked) == cfg.n_layers * len(TARGETS)
    return pm, model, params, masked


def _peft_grads(pm, masked, batch, step):
    """PEFT's loss and adapter gradients, one sample at a time, each with its own masks."""
    pm.zero_grad()
    total = 0.0
    for i, s in enumerate(batch.samples):
        for (unit, path), mod in masked.items():
            d_in = pm.get_submodule(f"base_model.model.model.{unit}.{path}").in_features
            mod.mask = lora.dropout_mask(P, seed=SEED, step=step, sample=i, unit=unit, path=path,
                                         length=s.length, d_in=d_in)
        ids = s.tokens.long()[None]
        logits = pm(input_ids=ids).logits[0].float()
        total = total + torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum")
    loss = total / batch.num_loss_tokens
    loss.backward()
    grads = {k.replace(".default.weight", ".weight"): p.grad.clone()
             for k, p in pm.named_parameters() if "lora_" in k}
    return float(loss.detach()), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    ("world", "comm", "balance", "remat"),
    [(2, "odc", "lb_mini", False), (3, "collective", "lb_micro", True), (1, "odc", "local_sort", False)],
)
def test_dropout_gradients_equal_peft_with_the_same_masks(tmp_path, world, comm, balance, remat):
    pm, model, params, masked = _setup(tmp_path)
    batch = odcfn.random_batch([9, 17, 5, 12, 3], model.vocab_size, seed=2)
    want_loss, want = _peft_grads(pm, masked, batch, STEP)
    config = odcfn.StepConfig(comm=comm, balance=balance, max_tokens_per_microbatch=24, remat=remat)

    def fn(rank, t):
        st = odcfn.TrainState.create(params=params, model=model, optimizer=odcfn.sgd(0.0), transport=t,
                                     config=config, step=STEP)
        return odcfn.grad_step(st, batch)

    outs = odcfn.run_local(fn, world, timeout=60)
    full = odcfn.unshard([o[0] for o in outs], trained_model(model), odcfn.Mesh(world, 0))
    got = lora.peft_state_dict(model, full)
    for k, g in want.items():
        assert float(g.norm()) > 0, k
        assert _rel(got[k], g) <= 1e-5, (k, _rel(got[k], g))
    assert abs(outs[0][1].loss - want_loss) <= 1e-5 * abs(want_loss)
    # the masks matter: another step's masks, or none, give other gradients
    _, other = _peft_grads(pm, masked, batch, STEP + 1)
    assert min(_rel(other[k], g) for k, g in want.items()) > 1e-3


CFG = QwenConfig(vocab_size=29, d_model=12, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=20)


def test_no_dropout_outside_training_and_dropout_zero_changes_nothing():
    base, full = qwen_model(CFG), init_params(CFG)
    m0, p0 = lora.apply(base, full, rank=2, alpha=4, targets=("q_proj", "up_proj"))
    m1, p1 = lora.apply(base, full, rank=2, alpha=4, targets=("q_proj", "up_proj"), dropout=0.5)
    assert m0.config_key == lora.apply(base, full, rank=2, alpha=4, targets=("q_proj", "up_proj"),
                                       dropout=0.0)[0].config_key  # dropout=0: the model of before
    g = torch.Generator().manual_seed(3)
    for name in lora.adapter_units(m0):
        p0[name] = p1[name] = odcfn.tree_map(lambda x: torch.randn(x.shape, generator=g), p0[name])
    batch = odcfn.random_batch([5, 7, 3], CFG.vocab_size, seed=3)
    # a forward outside train_step (Batch.step None) does not drop: it equals the dropout-free model
    assert float(odcfn.reference_loss(m1, p1, batch)) == float(odcfn.reference_loss(m0, p0, batch))

    def fn(r, t):
        out = []
        for m, p in ((m0, p0), (m1, p1)):
            st = odcfn.TrainState.create(params=p, model=m, optimizer=odcfn.sgd(0.0), transport=t)
            out.append((odcfn.log_probs(st, batch), odcfn.grad_step(st, batch)[1].loss))
        return out

    (lp0, loss0), (lp1, loss1) = odcfn.run_local(fn, 2, timeout=60)[0]
    for a, b in zip(lp0, lp1):
        assert torch.equal(a, b)  # log-probs: evaluation, no dropout
    assert abs(loss1 - loss0) > 1e-4 * abs(loss0)  # training drops
    stepped = odcfn.Batch(batch.samples, step=0)
    assert float(odcfn.reference_loss(m1, p1, stepped)) == pytest.approx(loss1, rel=1e-6)


def test_dropout_mask_is_keyed_and_has_rate_p():
    kw = dict(seed=0, step=3, sample=1, unit="layers.0", path="self_attn.q_proj", length=400, d_in=50)
    m = lora.dropout_mask(0.25, **kw)
    assert m.dtype == torch.bool and m.shape == (400, 50)
    assert abs(float(m.float().mean()) - 0.25) < 0.02  # 20,000 draws: 4 standard deviations
    assert torch.equal(m, lora.dropout_mask(0.25, **kw))
    for k, v in (("step", 4), ("sample", 2), ("seed", 1), ("unit", "layers.1"), ("path", "mlp.up_proj")):
        assert not torch.equal(m, lora.dropout_mask(0.25, **{**kw, k: v})), k
    with pytest.raises(TypeError, match="Batch.step"):
        odcfn.Batch(odcfn.random_batch([3], 5).samples, step="1")
