"""The RL section of ``odcfn bench`` (the data and the loss are in ``odcfn.bench.rl``): the three
contenders side by side, ``log_probs`` against ``train_step`` on the same minibatches, and the
simulator at 8-1024 devices."""

from __future__ import annotations

import torch

from odcfn.bench.rl import RL_POLICIES, rl_loss

__all__ = ["log_prob_cost", "section", "simulate_rl"]


def _logprob_loop(w, steps: int, warmup: int, cost, mesh, transport, barrier) -> list[dict]:
    """One rank: train_step and log_probs on the same minibatch, alternately, both timed."""
    import time

    from odcfn.bench.workload import make_batch
    from odcfn.models import init_params, qwen_model
    from odcfn.optim import adamw
    from odcfn.step.logprobs import log_probs
    from odcfn.step.state import StepConfig, TrainState
    from odcfn.step.train import train_step

    config = StepConfig(comm="odc", balance="lb_mini", cost=cost, loss=w.loss,
                        max_tokens_per_microbatch=w.max_tokens_per_microbatch)
    state = TrainState.create(params=init_params(w.model, seed=w.seed), model=qwen_model(w.model),
                              optimizer=adamw(w.lr), transport=transport, config=config)
    out = []
    for step in range(warmup + steps):
        batch = make_batch(w, step)
        barrier()
        t0 = time.perf_counter()
        state, _ = train_step(state, batch)
        t1 = time.perf_counter()
        barrier()
        t2 = time.perf_counter()
        log_probs(state, batch)
        t3 = time.perf_counter()
        if step >= warmup:
            out.append({"step": step, "train_s": t1 - t0, "log_probs_s": t3 - t2})
    return out


def _logprob_process_worker(w, steps: int, warmup: int, cost) -> list[dict]:
    import torch.distributed as dist

    from odcfn.sharding import Mesh
    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(1)
    mesh = Mesh.from_env()
    with ShmTransport(mesh, timeout=300.0) as tr:
        return _logprob_loop(w, steps, warmup, cost, mesh, tr, dist.barrier)


def log_prob_cost(w, steps: int, warmup: int, cost, backend: str) -> dict:
    """Median over minibatches of the slowest rank's log_probs time / its train_step time."""
    import statistics
    import threading

    W = w.world_size
    if backend == "process":
        from odcfn.launch import launch

        per_rank = launch(_logprob_process_worker, W, args=(w, steps, warmup, cost), timeout=1200.0)
    else:
        from odcfn.sharding import Mesh
        from odcfn.transport.local import run_local

        b = threading.Barrier(W)
        per_rank = run_local(
            lambda r, tr: _logprob_loop(w, steps, warmup, cost, Mesh(W, r), tr, lambda: b.wait(300)), W,
            timeout=300.0,
        )
    train = [max(recs[i]["train_s"] for recs in per_rank) for i in range(steps)]
    lp = [max(recs[i]["log_probs_s"] for recs in per_rank) for i in range(steps)]
    return {"train_step_s": train, "log_probs_s": lp,
            "log_probs_over_train_step": statistics.median(a / b for a, b in zip(lp, train)),
            "policy": "odc+lb-mini", "definition": "median over minibatches of (slowest rank's "
            "log_probs time) / (slowest rank's train_step time) on the same minibatch"}


def section(ctx, sim_devices=(8, 64, 1024)) -> dict:
    """GRPO updates on AIME-RL-like rollouts: the three contenders side by side, the log-prob
    pass against a train step on the same minibatches, and the simulator at scale."""
    from odcfn.bench.sections import compare_policies

    w = ctx.workload.with_(dataset="aime-rl", length_scale=max(1, ctx.workload.length_scale // 2))
    ctx.log(f"   AIME-RL-like lengths / {w.length_scale}, groups of {w.group_size}, "
            f"{w.samples_per_rank} samples per rank, loss {rl_loss()}")
    from odcfn.bench.runner import step_records

    res, per_rank = compare_policies(ctx, w, RL_POLICIES)
    # verl's constraint, visible: samples each rank ran, per timed minibatch
    res["samples_per_rank_by_step"] = {
        p: [[sum(len(mb) for mb in r["microbatches"]) for r in recs] for recs in step_records(per_rank, p)]
        for p in RL_POLICIES
    }
    lengths = [n for s in range(ctx.warmup, ctx.warmup + ctx.steps) for n in _totals(w, s)]
    res["lengths"] = {"length_scale": w.length_scale, "group_size": w.group_size,
                      "mean": sum(lengths) / len(lengths), "max": max(lengths),
                      "max_tokens_per_microbatch": w.max_tokens_per_microbatch}
    res["loss"] = repr(rl_loss())
    ctx.log("   log_probs vs train_step on the same minibatches")
    res["log_probs"] = log_prob_cost(w, ctx.steps, ctx.warmup, ctx.cost, ctx.backend)
    ctx.log(f"   simulator at {list(sim_devices)} devices")
    res["simulated"] = [r for spd in (2, 4) for r in simulate_rl(sim_devices, spd)]
    return res


def _totals(w, step: int) -> tuple[int, ...]:
    from odcfn.bench.workload import make_lengths

    return make_lengths(w, step)


def simulate_rl(devices=(8, 64, 1024), samples_per_device: int = 4, minibatches: int = 4) -> list[dict]:
    """The same three contenders at scale, in the simulator (``odcfn simulate``'s model: a 7B
    model at 45% MFU of an A100, its communication model, 8 ranks per node, full AIME-RL
    lengths): samples/s relative to collective+lb-micro, with and without equal counts."""
    from odcfn.schedule.balance import lb_micro, lb_mini
    from odcfn.schedule.lengths import get_dataset
    from odcfn.schedule.simcells import MODEL_PARAMS, RANKS_PER_NODE, default_cost
    from odcfn.schedule.simulate import A100_COMM, compile_plans, simulate
    from odcfn.schedule.simulate import Workload as SimWorkload
    from odcfn.sharding import Mesh

    ds, cost = get_dataset("aime-rl"), default_cost()
    work = SimWorkload.uniform(8, model_bytes=2 * MODEL_PARAMS)
    rows = []
    for d in devices:
        mesh = Mesh(d, 0, RANKS_PER_NODE if d % RANKS_PER_NODE == 0 else None)
        acc = {p: [0.0, 0.0] for p in RL_POLICIES}  # samples, step time
        for k in range(minibatches):
            lengths = ds.sample(d * samples_per_device, seed=k)
            equal = lb_micro(lengths, d, ds.max_tokens, cost=cost)
            free = lb_mini(lengths, d, ds.max_tokens, cost=cost)
            plans = {
                "collective+lb-micro": compile_plans(work.units, equal, "collective"),
                "odc+lb-micro": compile_plans(work.units, equal, "odc"),
                "odc+lb-mini": compile_plans(work.units, free, "odc"),
            }
            for p, pl in plans.items():
                res = simulate(pl, lengths, workload=work, cost=cost, comm=A100_COMM, mesh=mesh, record=False)
                acc[p][0] += res.num_samples
                acc[p][1] += res.makespan
        base = acc["collective+lb-micro"][0] / acc["collective+lb-micro"][1]
        rows.append({"devices": d, "samples_per_device": samples_per_device,
                     **{p: (n / t) / base for p, (n, t) in acc.items()}})
    return rows
