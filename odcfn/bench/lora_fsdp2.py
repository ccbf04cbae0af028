"""LoRA samples/s: ODC + LB-Mini against torch FSDP2 + PEFT LoRA (LB-Micro), side by side in one
launched job, on the same base, adapters and minibatches.

The FSDP2 side is the ``nn.Module`` mirror of the same model with its projections as
``nn.Linear``, so that ``peft.get_peft_model`` injects its LoRA layers (PEFT's initialisation,
frozen base, trainable ``lora_A``/``lora_B``); each unit (embed, layer, head) and the root are
``fully_shard``-ed, the microbatches are LB-Micro's (equal counts, as FSDP2 needs), with
gradient accumulation and ``torch.optim.AdamW`` on the adapters. The unit functions are
odcfn's (``odcfn.models.qwen``), fed with PEFT's tensors: PEFT's ``W x + b + scale * B (A x)``
is the same expression, so both sides compute the same function and only the runtime differs.
ODC + LB-Mini runs ``odcfn.lora.apply`` on ``ShmTransport``; PEFT's A is set to odcfn's, so
the two train the same function from the same start (their losses agree: a correctness check).
The order of the two alternates every minibatch; each times its whole step, optimizer included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from odcfn.bench.fsdp2 import fsdp2_step

__all__ = ["LoraFsdp2Spec", "lora_fsdp2_worker", "peft_lora_module"]


@dataclass(frozen=True)
class LoraFsdp2Spec:
    workload: object  # bench.workload.Workload
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    steps: int = 3
    warmup: int = 1
    timeout: float = 300.0


class _Unit(nn.Module):
    """One unit's parameters under their pytree names; 2-D ``weight`` dicts named in
    ``linear`` become ``nn.Linear`` (what PEFT can adapt)."""

    def __init__(self, shapes: dict, fwd, linear: frozenset[str]) -> None:
        super().__init__()
        self.fwd = fwd
        self._build(self, shapes, linear)

    @staticmethod
    def _build(mod: nn.Module, shapes: dict, linear: frozenset[str]) -> None:
        for k, v in shapes.items():
            if isinstance(v, torch.Size):
                mod.register_parameter(k, nn.Parameter(torch.zeros(v)))
            elif k in linear and isinstance(v.get("weight"), torch.Size) and len(v["weight"]) == 2:
                d_out, d_in = v["weight"]
                mod.add_module(k, nn.Linear(d_in, d_out, bias="bias" in v))
            else:
                child = nn.Module()
                _Unit._build(child, v, linear)
                mod.add_module(k, child)

    @staticmethod
    def tree(mod: nn.Module) -> dict:
        """The params dict the unit function reads; a PEFT LoRA layer becomes odcfn's
        ``{weight, bias, lora_A, lora_B, lora_scale}``."""
        if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
            base = mod.base_layer
            out = {"weight": base.weight, "lora_A": mod.lora_A["default"].weight,
                   "lora_B": mod.lora_B["default"].weight, "lora_scale": mod.scaling["default"]}
            return out if base.bias is None else {**out, "bias": base.bias}
        out = dict(mod.named_parameters(recurse=False))
        for k, child in mod.named_children():
            out[k] = _Unit.tree(child)
        return out

    def forward(self, x, mb, used: dict | None = None):
        return self.fwd({**_Unit.tree(self), **(used or {})}, x, mb)


class _PeftQwen(nn.Module):
    def __init__(self, cfg, linear: frozenset[str]) -> None:
        from odcfn.models.qwen import block_fwd, embed_fwd, head_fwd, unit_shapes

        super().__init__()
        shapes = unit_shapes(cfg)
        self.embed = _Unit(shapes["embed"], partial(embed_fwd, pad=cfg.pad_token_id), linear)
        self.layers = nn.ModuleList(
            _Unit(shapes[f"layers.{i}"], partial(block_fwd, cfg=cfg), linear) for i in range(cfg.n_layers)
        )
        self.head = _Unit(shapes["head"], partial(head_fwd, cfg=cfg), linear)
        self.tied = cfg.tie_embeddings

    def load(self, params: dict) -> None:
        from odcfn.tree import tree_named_leaves

        with torch.no_grad():
            for unit, mod in (("embed", self.embed), *((f"layers.{i}", m) for i, m in enumerate(self.layers)),
                              ("head", self.head)):
                for path, t in tree_named_leaves(params[unit]):
                    mod.get_parameter(path).copy_(t)

    def forward(self, mb):
        x = self.embed(None, mb)
        for layer in self.layers:
            x = layer(x, mb)
        return self.head(x, mb, {"embed": _Unit.tree(self.embed)} if self.tied else None)


def peft_lora_module(cfg, model, params: dict) -> nn.Module:
    """PEFT's LoRA (``peft.get_peft_model``) on the ``nn.Module`` mirror of ``cfg`` with
    ``nn.Linear`` projections, the base and adapters set to ``params`` of the LoRA ``model``
    (``odcfn.lora.apply``'s), so both train the same function from the same start. Called
    with a ``Microbatch``, its base model returns the summed token loss, as the head unit does."""
    import peft

    from odcfn.lora import adapter_units, spec

    s = spec(model)
    module = _PeftQwen(cfg, frozenset(s.targets))
    module.load(params)
    conf = peft.LoraConfig(r=s.rank, lora_alpha=s.alpha, target_modules=list(s.targets),
                           lora_dropout=0.0, use_rslora=s.use_rslora)
    pm = peft.get_peft_model(module, conf)  # freezes the base, adds PEFT-initialised adapters
    with torch.no_grad():
        for name, ad in adapter_units(model).items():
            layer = module.get_submodule(ad.base)
            for path in ad.paths:
                src, proj = params[name], layer.get_submodule(path)
                for k in path.split("."):
                    src = src[k]
                proj.lora_A["default"].weight.copy_(src["lora_A"])
                proj.lora_B["default"].weight.copy_(src["lora_B"])
    return pm


def _peft_fsdp2(w, dmesh, model, params: dict) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    pm = peft_lora_module(w.model, model, params)
    module = pm.get_base_model()
    for unit in (module.embed, *module.layers, module.head):
        fully_shard(unit, mesh=dmesh)
    fully_shard(module, mesh=dmesh)
    return pm


def lora_fsdp2_worker(spec: LoraFsdp2Spec) -> list[dict]:
    """One launched rank: ODC + LB-Mini LoRA and FSDP2 + PEFT LoRA, alternating minibatches."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import odcfn
    from odcfn.bench.workload import make_batch
    from odcfn.models import init_params, qwen_model
    from odcfn.schedule.balance import get_balancer
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    w = spec.workload
    mesh = odcfn.Mesh.from_env()
    b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01  # odcfn.optim.adamw's defaults
    with ShmTransport(mesh, timeout=spec.timeout) as tr:  # (creates the default gloo group)
        model, params = odcfn.lora.apply(qwen_model(w.model), init_params(w.model, seed=w.seed),
                                         rank=spec.rank, alpha=spec.alpha, targets=spec.targets)
        pm = _peft_fsdp2(w, init_device_mesh("cpu", (mesh.world_size,)), model, params)
        trained = [p for p in pm.parameters() if p.requires_grad]
        topt = torch.optim.AdamW(trained, lr=w.lr, betas=(b1, b2), eps=eps, weight_decay=wd)
        state = odcfn.TrainState.create(
            params=params, model=model, transport=tr,
            optimizer=odcfn.adamw(w.lr, b1=b1, b2=b2, eps=eps, weight_decay=wd),
            config=odcfn.StepConfig(balance="lb_mini", max_tokens_per_microbatch=w.max_tokens_per_microbatch),
        )
        lb_micro = get_balancer("lb_micro")
        cap = w.max_tokens_per_microbatch
        out = []
        for step in range(spec.warmup + spec.steps):
            batch = make_batch(w, step)
            order = ("odc", "fsdp2") if step % 2 == 0 else ("fsdp2", "odc")
            for which in order:
                dist.barrier()
                t0 = time.perf_counter()
                if which == "odc":
                    state, m = odcfn.train_step(state, batch)
                    loss = m.loss
                else:
                    assignment = lb_micro(batch.lengths, mesh.world_size, cap)
                    n_max = max(len(a) for a in assignment)
                    loss = fsdp2_step(pm.get_base_model(), topt, batch, assignment[mesh.rank], n_max)
                out.append({"impl": which, "step": step, "warmup": step < spec.warmup, "rank": mesh.rank,
                            "wall": time.perf_counter() - t0, "loss": loss, "samples": len(batch),
                            "tokens": sum(batch.lengths)})
        dist.barrier()
        return out
