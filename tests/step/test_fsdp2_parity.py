"""torch FSDP2 (``fully_shard`` per layer + root, gloo, CPU) on the ``nn.Module`` mirror versus
odcfn's collective (over gloo and over /dev/shm) and ODC modes on the same ranks and data:
gradients of the first step and parameters after several AdamW steps, leaf by leaf by name."""

from __future__ import annotations

import pytest
import torch

import odcfn
from odcfn.batch import pack
from odcfn.models import QwenConfig, QwenModule, RopeScaling, init_params, qwen_model
from odcfn.transport.shm import ShmTransport
from odcfn.tree import tree_named_leaves
from tests.mp_pool import mp_pool  # noqa: F401 - the session fixture

CFG = QwenConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=24)
# the mirror's newer features: Qwen3 q/k norms, free head_dim, o_proj bias, llama3 RoPE, tied head
FEATURES = QwenConfig(
    vocab_size=29, d_model=12, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=20, head_dim=8,
    qk_norm=True, o_bias=True, tie_embeddings=True,
    rope_scaling=RopeScaling("llama3", 4.0, 8, low_freq_factor=1.0, high_freq_factor=4.0),
)  # fmt: skip
LR, STEPS = 1e-2, 3


def _named(tree):
    return {f"{u}.{n}": t.detach().clone() for u, sub in tree.items() for n, t in tree_named_leaves(sub)}


def parity_worker(lengths, seed, cfg=CFG):
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, full = qwen_model(cfg), init_params(cfg, seed=seed)
    batch = odcfn.random_batch(lengths, cfg.vocab_size, seed=seed)
    mesh = odcfn.Mesh.from_env()
    w, r = mesh.world_size, mesh.rank
    out = {}
    with ShmTransport(mesh, timeout=60) as tr, ShmTransport(mesh, timeout=60, collectives="shm") as shm:
        # (the first also initialises the default gloo group); the second runs the collectives
        # over /dev/shm: the same-wire baseline must give the same gradients
        for key, comm, t in (("collective", "collective", tr), ("odc", "odc", tr),
                             ("collective_shm", "collective", shm)):
            state = odcfn.TrainState.create(
                params=full, model=model, optimizer=odcfn.adamw(LR), transport=t,
                config=odcfn.StepConfig(comm=comm, balance="round_robin"),
            )
            for step in range(STEPS):
                state, _ = odcfn.train_step(state, batch)
                if step == 0:
                    grads = {k: v.clone() for k, v in t.grad_shards().items()}
            out[key] = (grads, {k: v.clone() for k, v in state.params.items()})

    module = QwenModule(cfg)
    module.load_params(full)
    dmesh = init_device_mesh("cpu", (w,))
    for layer in module.layers:
        fully_shard(layer, mesh=dmesh)
    fully_shard(module, mesh=dmesh)
    topt = torch.optim.AdamW(module.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    mine = range(r, len(lengths), w)  # the round-robin split odcfn's default balancer uses
    for step in range(STEPS):
        topt.zero_grad()
        for i in mine:  # one sample per forward/backward: FSDP2 reduce-scatters each backward
            # FSDP2 averages gradients over ranks; our loss is the minibatch sum / loss tokens
            loss = module(pack(batch, [i])) * (w / batch.num_loss_tokens)
            loss.backward()
        if step == 0:
            fsdp_grads = {n: p.grad.full_tensor().clone() for n, p in module.named_parameters()}
        topt.step()
    fsdp_params = {n: p.detach().full_tensor().clone() for n, p in module.named_parameters()}
    return out, fsdp_grads, fsdp_params


@pytest.mark.parametrize(("world", "cfg"), [(2, CFG), (3, CFG), (3, FEATURES)], ids=["2", "3", "3-features"])
def test_fsdp2_matches_odcfn_collective_and_odc(mp_pool, world, cfg):  # noqa: F811
    lengths = [9, 4, 7, 3, 6, 5][: 2 * world]  # every rank gets samples: FSDP2 needs all to join
    out = mp_pool.run(parity_worker, world, args=(lengths, 3, cfg), timeout=180)
    model = qwen_model(cfg)
    mesh = odcfn.Mesh(world, 0)
    fsdp_grads, fsdp_params = out[0][1], out[0][2]
    for comm in ("collective", "odc", "collective_shm"):
        grads = _named(odcfn.unshard([o[0][comm][0] for o in out], model, mesh))
        params = _named(odcfn.unshard([o[0][comm][1] for o in out], model, mesh))
        assert grads.keys() == fsdp_grads.keys() == params.keys() == fsdp_params.keys()
        for name in grads:
            close = torch.testing.assert_close
            close(grads[name], fsdp_grads[name], rtol=1e-5, atol=1e-7, msg=f"{comm} grad {name}")
            close(params[name], fsdp_params[name], rtol=1e-4, atol=1e-5, msg=f"{comm} param {name}")
    # the step really moved the parameters (a parity test of a no-op would prove nothing)
    init = _named(init_params(cfg, seed=3))
    assert max((fsdp_params[k] - init[k]).abs().max().item() for k in init) > LR / 2
