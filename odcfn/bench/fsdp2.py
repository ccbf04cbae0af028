"""torch FSDP2 vs odcfn's collective mode and ODC+LB-Mini on the same data, side by side in one
launched job (torch FSDP2 with LB-Micro's microbatches is what a user would otherwise run).

FSDP2 (``torch.distributed.fsdp.fully_shard``) wraps the ``nn.Module`` mirror of the same model,
one FSDP unit per odcfn unit (embed, each layer, head) plus the root, and runs exactly the
microbatches odcfn's collective mode runs (the same balancer's assignment), with gradient
accumulation and ``torch.optim.AdamW`` using odcfn's AdamW hyper-parameters. Both reshard after
forward. ODC+LB-Mini runs on ``ShmTransport`` (the collective mode on the same transport, its
collectives over gloo as FSDP2's). The order of the three rotates every minibatch; each times the
whole step, optimizer included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from odcfn.bench.workload import Workload, make_batch

__all__ = ["Fsdp2Spec", "dummy_microbatch", "fsdp2_step", "fsdp2_worker"]


@dataclass(frozen=True)
class Fsdp2Spec:
    workload: Workload
    steps: int = 3
    warmup: int = 1
    timeout: float = 120.0
    cost: object | None = None  # CostModel for LB-Micro (None: the schedule layer's default)


def dummy_microbatch():
    """One token with no loss: a rank with fewer microbatches still joins every collective."""
    from odcfn.batch import Microbatch

    z = torch.zeros(1, dtype=torch.long)
    return Microbatch(z, z, torch.zeros(1), z, (1,), ())


def _fsdp2_model(w: Workload, mesh):
    from torch.distributed.fsdp import fully_shard

    from odcfn.models import QwenModule, init_params

    module = QwenModule(w.model)
    module.load_params(init_params(w.model, seed=w.seed))
    for unit in (module.embed, *module.layers, module.head):
        fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def fsdp2_step(module, opt, batch, microbatches, n_max: int, loss_fn=None) -> float:
    """One FSDP2 minibatch with gradient accumulation; ``loss_fn(module, mb)`` the microbatch's
    summed token loss (default ``module(mb)``: odcfn's module mirror)."""
    from odcfn.batch import pack

    loss_sum = torch.zeros((), dtype=torch.float64)
    for i in range(n_max):  # a rank with fewer microbatches still joins every collective
        mb = pack(batch, microbatches[i]) if i < len(microbatches) else dummy_microbatch()
        loss = module(mb) if loss_fn is None else loss_fn(module, mb)
        (loss / batch.num_loss_tokens).backward()
        loss_sum += loss.detach().double()
    opt.step()
    opt.zero_grad(set_to_none=True)
    import torch.distributed as dist

    dist.all_reduce(loss_sum)  # the loss to report, like odcfn's one sync
    return float(loss_sum) / batch.num_loss_tokens


def fsdp2_worker(spec: Fsdp2Spec) -> list[dict]:
    """One launched rank: alternate odcfn collective and FSDP2 minibatch by minibatch."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from odcfn.models import init_params, qwen_model
    from odcfn.optim import adamw
    from odcfn.schedule.balance import get_balancer
    from odcfn.sharding import Mesh
    from odcfn.step.state import StepConfig, TrainState
    from odcfn.step.train import train_step
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    w = spec.workload
    mesh = Mesh.from_env()
    with ShmTransport(mesh, timeout=spec.timeout) as tr:  # (creates the default gloo group)
        dmesh = init_device_mesh("cpu", (mesh.world_size,))
        module = _fsdp2_model(w, dmesh)
        b1, b2, eps, wd = 0.9, 0.999, 1e-8, 0.01  # odcfn.optim.adamw's defaults
        topt = torch.optim.AdamW(module.parameters(), lr=w.lr, betas=(b1, b2), eps=eps,
                                 weight_decay=wd)
        model = qwen_model(w.model)
        states = {
            impl: TrainState.create(
                params=init_params(w.model, seed=w.seed), model=model, transport=tr,
                optimizer=adamw(w.lr, b1=b1, b2=b2, eps=eps, weight_decay=wd),
                config=StepConfig(comm=comm, balance=balance, cost=spec.cost,
                                  max_tokens_per_microbatch=w.max_tokens_per_microbatch),
            )
            for impl, comm, balance in (("odcfn", "collective", "lb_micro"), ("odc", "odc", "lb_mini"))
        }
        lb_micro = get_balancer("lb_micro", cost=spec.cost)  # FSDP2 runs odcfn's microbatches
        cap = w.max_tokens_per_microbatch
        out = []
        for step in range(spec.warmup + spec.steps):
            batch = make_batch(w, step)
            impls = ("odcfn", "fsdp2", "odc")
            k = step % len(impls)
            for which in impls[k:] + impls[:k]:
                dist.barrier()
                t0 = time.perf_counter()
                if which in states:
                    states[which], m = train_step(states[which], batch)
                    loss = m.loss
                else:
                    assignment = lb_micro(batch.lengths, mesh.world_size, cap)
                    n_max = max(len(a) for a in assignment)
                    loss = fsdp2_step(module, topt, batch, assignment[mesh.rank], n_max)
                out.append({"impl": which, "step": step, "warmup": step < spec.warmup,
                            "rank": mesh.rank, "wall": time.perf_counter() - t0, "loss": loss,
                            "samples": len(batch), "tokens": sum(batch.lengths)})
        dist.barrier()
        return out


def summarize(per_rank: list[list[dict]], impl: str) -> dict:
    steps: dict[int, list[dict]] = {}
    for recs in per_rank:
        for r in recs:
            if r["impl"] == impl and not r["warmup"]:
                steps.setdefault(r["step"], []).append(r)
    walls = [max(r["wall"] for r in v) for _, v in sorted(steps.items())]
    samples = sum(v[0]["samples"] for v in steps.values())
    tokens = sum(v[0]["tokens"] for v in steps.values())
    return {"impl": impl, "minibatches": len(walls), "time_s": sum(walls), "step_time_s": walls,
            "samples_per_s": samples / sum(walls), "tokens_per_s": tokens / sum(walls),
            "losses": [v[0]["loss"] for _, v in sorted(steps.items())]}
