"""The LoRA bench's torch FSDP2 + PEFT side (``odcfn.bench.lora_fsdp2``) computes the function
ODC trains: PEFT's LoRA layers on the ``nn.Module`` mirror, A and B set to odcfn's, give the same
loss and adapter gradients as the single-process reference of the LoRA model (its FSDP2
wrapping is torch's; the bench also reports that both sides' losses agree step by step)."""

from __future__ import annotations

import peft  # noqa: F401  (the baseline is PEFT's LoRA)
import pytest
import torch

import odcfn
from odcfn import lora
from odcfn.batch import pack
from odcfn.bench.lora_fsdp2 import peft_lora_module
from odcfn.models import QwenConfig, init_params, qwen_model


@pytest.mark.parametrize("tied", [False, True])
def test_the_fsdp2_side_s_peft_module_computes_odcfn_s_lora_function(tied):
    cfg = QwenConfig(vocab_size=29, d_model=12, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=20,
                     tie_embeddings=tied)
    model, params = lora.apply(qwen_model(cfg), init_params(cfg, seed=1), rank=3, alpha=5,
                               targets=("q_proj", "o_proj", "up_proj"))
    g = torch.Generator().manual_seed(2)
    for name in lora.adapter_units(model):  # non-zero B: A gets a gradient
        params[name] = odcfn.tree_map(lambda x: torch.randn(x.shape, generator=g) * 0.3, params[name])
    batch = odcfn.random_batch([7, 4, 9], cfg.vocab_size, seed=3)
    p = odcfn.tree_map(lambda x: x.detach().clone().requires_grad_(), params)
    want = odcfn.reference_loss(model, p, batch)
    want.backward()
    pm = peft_lora_module(cfg, model, params)
    loss = pm.get_base_model()(pack(batch, [0, 1, 2])) / batch.num_loss_tokens  # packed, one microbatch
    loss.backward()
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want))
    trained = {n for n, q in pm.named_parameters() if q.requires_grad}
    assert trained and all("lora_" in n for n in trained)  # PEFT froze the base
    for name, ad in lora.adapter_units(model).items():
        for path in ad.paths:
            proj = pm.get_base_model().get_submodule(f"{ad.base}.{path}")
            ref = p[name]
            for k in path.split("."):
                ref = ref[k]
            for leaf in ("lora_A", "lora_B"):
                got, exp = getattr(proj, leaf)["default"].weight.grad, ref[leaf].grad
                assert float((got - exp).norm()) <= 1e-5 * float(exp.norm()), (name, path, leaf)
