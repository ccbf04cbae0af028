"""Run several policies side by side on the same minibatches, W ranks, and collect raw records.

Each policy trains its own copy of the same initial parameters; minibatch ``i`` is run by every
policy before minibatch ``i + 1`` (the order rotates each step), so machine noise (other jobs on
the cores) falls on all policies alike. Ranks meet at a barrier before each timed step; a step's
wall time is the slowest rank's ``train_step`` time, optimizer update included.

Backends: ``process`` (``odcfn.launch`` + ``ShmTransport``: real processes, shared memory and
gloo; the same-wire baseline on a second ``ShmTransport(collectives="shm")``) and ``thread``
(``odcfn.run_local``: W threads in one process, the reference transport for every policy).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from odcfn.bench.workload import Workload, collectives_of, make_batch
from odcfn.models import init_params, qwen_model
from odcfn.optim import adamw
from odcfn.schedule.policy import SCHEDULES, Schedule
from odcfn.sharding import Mesh, shard

__all__ = ["RunSpec", "available_backends", "pick_backend", "process_worker", "run"]


@dataclass(frozen=True)
class RunSpec:
    workload: Workload
    policies: tuple[str, ...]  # keys of SCHEDULES
    steps: int = 3  # timed minibatches per policy
    warmup: int = 1  # untimed minibatches per policy first (allocations, first-touch of shm)
    slowdown: tuple[float, ...] = ()  # per-rank compute slowdown (1.5 = a 1.5x slower device)
    keep_events: bool = True
    progress: bool = False
    timeout: float = 120.0
    threads_per_rank: int = 1
    cost: object | None = None  # a CostModel (picklable) for every balancer; None: the default

    def __post_init__(self) -> None:
        unknown = [p for p in self.policies if p not in SCHEDULES]
        if unknown:
            raise ValueError(f"unknown policies {unknown}; known: {sorted(SCHEDULES)}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(
                f"RunSpec needs steps >= 1 and warmup >= 0, got {self.steps}, {self.warmup}"
            )
        if self.slowdown and len(self.slowdown) != self.workload.world_size:
            raise ValueError(
                f"RunSpec.slowdown has {len(self.slowdown)} entries for "
                f"world_size={self.workload.world_size}"
            )

    def slowdown_of(self, rank: int) -> float:
        return self.slowdown[rank] if self.slowdown else 1.0


@dataclass
class _Progress:
    total: int
    label: str = ""
    done: int = 0
    t0: float = field(default_factory=time.perf_counter)

    def tick(self, what: str) -> None:
        self.done += 1
        width = 24
        fill = width * self.done // max(1, self.total)
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        sys.stderr.write(
            f"\r{self.label}[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
            f"{what:<28} {el:5.0f}s elapsed, ~{eta:4.0f}s left "
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _rank_loop(spec: RunSpec, mesh: Mesh, transport, barrier: Callable[[], None]) -> list[dict]:
    """One rank's side of a run: returns one record per (minibatch, policy). ``transport``: one
    transport for every policy, or a function of the policy's name returning its transport."""
    from odcfn.models.slow import slow_model
    from odcfn.step import train
    from odcfn.step.state import StepConfig, TrainState

    w = spec.workload
    model = slow_model(qwen_model(w.model), spec.slowdown_of(mesh.rank))
    full = init_params(w.model, seed=w.seed)
    state, wire = {}, {}
    for name in spec.policies:
        pol = SCHEDULES[name]
        # every rank binds the same cost model, so every rank computes the same assignment
        # (static balancers) or the same work-stealing lists
        config = StepConfig(
            comm=pol.comm, balance=pol.balance, cost=spec.cost,
            max_tokens_per_microbatch=w.max_tokens_per_microbatch, loss=w.loss,
        )
        tr = transport(name) if callable(transport) else transport
        wire[name] = getattr(tr, "collectives_kind", "in-process")  # what its collectives ran over
        state[name] = TrainState.create(
            params=shard(full, model, mesh), model=model, optimizer=adamw(w.lr), transport=tr,
            config=config,
        )
    total = (spec.warmup + spec.steps) * len(spec.policies)
    bar = _Progress(total) if spec.progress and mesh.rank == 0 else None
    records: list[dict] = []
    for step in range(spec.warmup + spec.steps):
        batch = make_batch(w, step)
        k = step % len(spec.policies)
        for name in spec.policies[k:] + spec.policies[:k]:
            pol: Schedule = SCHEDULES[name]
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            state[name], m = train.train_step(state[name], batch)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            records.append({
                "policy": name,
                "balancer": pol.balance,
                "step": step,
                "warmup": step < spec.warmup,
                "rank": mesh.rank,
                "collectives": wire[name],
                "wall": wall,
                "cpu": cpu,  # this process's CPU seconds (all its threads) during the step
                "loss": m.loss,
                "grad_norm": m.grad_norm,
                "samples": m.num_samples,
                "tokens": m.num_tokens,
                "lengths": list(batch.lengths),
                "microbatches": [list(mb) for mb in m.plan.microbatches],
                "counters": m.counters.as_dict(),
                "events": [
                    (e.kind, e.name, e.start, e.end, e.mb) for e in m.events
                ] if spec.keep_events else [],
            })
            if bar is not None:
                bar.tick(f"{name} mb{step}{' (warmup)' if step < spec.warmup else ''}")
    return records


def process_worker(spec: RunSpec) -> list[dict]:
    """Entry point of one launched rank (also runs unchanged under torchrun)."""
    import torch.distributed as dist

    from odcfn.transport.shm import ShmTransport

    torch.set_num_threads(spec.threads_per_rank)
    mesh = Mesh.from_env()
    kinds = sorted({collectives_of(p) for p in spec.policies})  # the same order on every rank
    with contextlib.ExitStack() as stack:
        trs = {k: stack.enter_context(ShmTransport(mesh, timeout=spec.timeout, collectives=k))
               for k in kinds}
        return _rank_loop(spec, mesh, lambda name: trs[collectives_of(name)], dist.barrier)


def available_backends() -> list[str]:
    """The backends, preferred first."""
    return ["process", "thread"]


def pick_backend(requested: str = "auto") -> str:
    have = available_backends()
    if requested == "auto":
        return have[0]
    if requested not in have:
        raise ValueError(f"backend {requested!r} is not available here; available: {have}")
    return requested


def run(spec: RunSpec, backend: str = "auto") -> list[list[dict]]:
    """Records per rank (index = rank)."""
    backend = pick_backend(backend)
    W = spec.workload.world_size
    if backend == "process":
        from odcfn.launch import launch

        return launch(process_worker, W, args=(spec,), timeout=spec.timeout * 10)
    from odcfn.transport.local import run_local

    b = threading.Barrier(W)
    # W threads share this process: give each rank its share of the intra-op threads
    prev = torch.get_num_threads()
    torch.set_num_threads(spec.threads_per_rank)
    try:
        out = run_local(
            lambda rank, tr: _rank_loop(spec, Mesh(W, rank), tr, lambda: b.wait(spec.timeout)), W
        )
    finally:
        torch.set_num_threads(prev)
    for recs in out:  # process CPU time covers every rank's thread here: not per rank
        for r in recs:
            r["cpu"] = None
    return out


def step_records(per_rank: Sequence[Sequence[dict]], policy: str) -> list[list[dict]]:
    """Timed records of ``policy``, grouped by minibatch: [[rank0, rank1, ...], ...]."""
    by_step: dict[int, list[dict]] = {}
    for recs in per_rank:
        for r in recs:
            if r["policy"] == policy and not r["warmup"]:
                by_step.setdefault(r["step"], []).append(r)
    return [sorted(v, key=lambda r: r["rank"]) for _, v in sorted(by_step.items())]
