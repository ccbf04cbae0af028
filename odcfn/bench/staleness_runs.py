"""Bounded staleness side by side over processes: the launched side of ``odcfn bench --only
staleness`` (the section, its summary and its table: ``odcfn.bench.staleness_section``;
``python -m odcfn.bench.staleness`` runs the section).

W processes (``odcfn.launch`` + ``ShmTransport``) train one model with ODC + LB-Mini at τ = 0
(the synchronous step), 1 and 2 on the same minibatches, in three variants:

- ``long_tail``: LongAlign-like lengths (``odcfn.bench.workload``), nobody slow;
- ``noisy``: the same data; on a random ``fraction`` of the minibatches one random rank is
  ``factor`` x slower (``slow_model``; the draw is seeded and the same for every τ);
- ``equal``: every sample of the mean length, nobody slow (nothing for staleness to hide).

A slowdown that always hits the same rank cannot be hidden at any τ: that rank's own work is the
critical path, staleness only lets the others run up to τ minibatches ahead and then wait. One
that moves between ranks can be: at τ >= 1 the rank slow on minibatch j catches up while its
peer runs ahead, so a run nears the largest per-rank sum of step times instead of the sum over
minibatches of the slowest rank's step time.

Each run is one fresh transport: minibatch 0 untimed (it maps the segments, starts the applier),
a barrier, minibatches 1..steps timed, ``stale.drain`` inside the timed region (every step
applied everywhere), then the loss of the drained params on a fixed held-out minibatch. Runs are
interleaved (repeat, variant, τ in a rotating order) so load from other jobs falls on all alike.

Tokens are Zipf-distributed rather than uniform: a model can learn their frequencies in a few
steps, so the held-out loss moves and shows what stale reads cost (uniform tokens sit at ln V).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from odcfn.bench.workload import Workload, make_lengths

__all__ = ["VARIANTS", "StaleSpec", "noisy_draw", "run_order", "stale_worker", "zipf_batch"]

VARIANTS = ("long_tail", "noisy", "equal")  # the (a), (b), (c)
EVAL_STEP = 1_000_003  # the held-out minibatch's (seed, step): never one a run trains on
ZIPF_S = 1.1


@dataclass(frozen=True)
class StaleSpec:
    workload: Workload
    taus: tuple[int, ...] = (0, 1, 2)
    variants: tuple[str, ...] = VARIANTS
    steps: int = 6  # timed minibatches per run (after one untimed)
    repeats: int = 3
    factor: float = 1.5  # the noisy neighbour's slowdown
    fraction: float = 1 / 3  # of the minibatches that have one
    cost: object | None = None  # LB-Mini's cost model (the bench's calibrated one); None: default
    timeout: float = 120.0
    threads_per_rank: int = 1

    def __post_init__(self) -> None:
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ValueError(f"StaleSpec.variants must be among {VARIANTS}, got {self.variants}")
        if not self.taus or 0 not in self.taus or min(self.taus) < 0:
            raise ValueError(f"StaleSpec.taus needs τ = 0 (the baseline) and no negative τ, got {self.taus}")
        if self.steps < 1 or self.repeats < 1:
            raise ValueError(f"StaleSpec needs steps >= 1 and repeats >= 1, got {self.steps}, {self.repeats}")


def noisy_draw(n: int, world: int, fraction: float, seed: int) -> list[int]:
    """Per minibatch, the rank that is slow on it, or -1: ``round(fraction * (n - 1))`` of the
    timed minibatches 1..n-1 drawn at random (exactly that many, so a short run is not left with
    none or most), their ranks a shuffled balanced sequence (each rank slow equally often, +-1, in
    random order). Independent ranks would put every slow minibatch of a short run on one rank
    half the time (2 of 6 at W = 2): a fixed straggler, which no τ can hide, instead of the
    moving neighbour a long run sees. Seeded: every τ sees the same draw."""
    rng = random.Random(seed * 7919 + 17)
    slow = sorted(rng.sample(range(1, n), round(fraction * (n - 1))))
    ranks = [i % world for i in range(len(slow))]
    rng.shuffle(ranks)
    who = dict(zip(slow, ranks))
    return [who.get(j, -1) for j in range(n)]


def run_order(spec: StaleSpec) -> list[tuple[int, str, int]]:
    """(repeat, variant, τ) in the order every rank runs them: τ rotates per (repeat, variant),
    so no τ always runs first (right after another variant's) or last."""
    out = []
    for r in range(spec.repeats):
        for i, v in enumerate(spec.variants):
            k = (r + i) % len(spec.taus)
            out += [(r, v, t) for t in spec.taus[k:] + spec.taus[:k]]
    return out



def zipf_batch(lengths: tuple[int, ...], vocab_size: int, seed: int):
    """Samples of the given lengths with token ids drawn from Zipf(``ZIPF_S``) over the vocabulary
    (a random permutation of it, so the frequent ids are not the low ones)."""
    from odcfn.batch import Batch, Sample

    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = ranks.pow(-ZIPF_S)
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(12345))
    return Batch(tuple(Sample(ids[torch.multinomial(probs, int(n), replacement=True, generator=g)])
                       for n in lengths))


def _batch(w: Workload, step: int):
    return zipf_batch(make_lengths(w, step), w.model.vocab_size, w.seed * 100_003 + step)


def _eval_loss(state: Any, batch: Any) -> float:
    """Token cross-entropy of ``state``'s params on ``batch`` (mean over loss tokens): the
    per-token log-probs of every rank's share, summed in the one sync of ``log_probs``."""
    from odcfn.step.logprobs import log_probs

    lps = log_probs(state, batch)
    total = sum(float(lp[1:].double().sum()) for lp in lps)  # [0]: nothing predicts token 0
    return -total / sum(len(lp) - 1 for lp in lps)


def _run(spec: StaleSpec, mesh: Any, model: Any, slow: Any, full: Any, batches: list, noisy: list[int],
         tau: int, held_out: Any) -> dict:
    """One run on a fresh transport; this rank's figures."""
    from odcfn.optim import adamw
    from odcfn.sharding import shard
    from odcfn.step import stale
    from odcfn.step.state import StepConfig, TrainState
    from odcfn.step.train import train_step
    from odcfn.transport.shm import ShmTransport

    w = spec.workload
    config = StepConfig(comm="odc", balance="lb_mini", cost=spec.cost, staleness=tau,
                        max_tokens_per_microbatch=w.max_tokens_per_microbatch)
    with ShmTransport(mesh, timeout=spec.timeout) as tr:
        st = TrainState.create(params=shard(full, model, mesh), model=model, optimizer=adamw(w.lr),
                               transport=tr, config=config)
        steps, losses = [], {}
        t0 = c0 = 0.0
        for j, b in enumerate(batches):
            if j == 1:  # minibatch 0 mapped the segments and started the applier: time from here
                tr.collectives.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
            ts = time.perf_counter()
            st, m = train_step(st.replace(model=slow if noisy[j] == mesh.rank else model), b)
            sync = sum(e.end - e.start for e in m.events if e.kind == "sync")
            steps.append({"wall": time.perf_counter() - ts, "slow": noisy[j] == mesh.rank, "sync_s": sync,
                          "version_wait_s": m.extra.get("version_wait_s", 0.0),
                          "lag": m.extra.get("staleness_max", 0), "syncs": m.counters.syncs,
                          "samples": m.num_samples, "microbatches": len(m.plan.microbatches)})
            if tau == 0:
                losses[j] = m.loss
            for k, fig in m.extra.get("reports", {}).items():
                losses[k] = fig["loss"]
        td = time.perf_counter()
        st, late = stale.drain(st.replace(model=model))
        end, cpu = time.perf_counter(), time.process_time() - c0
        losses.update({k: fig["loss"] for k, fig in late.items()})
        # cpu: this process's CPU seconds (all its threads, the applier's included) while timed
        return {"elapsed": end - t0 if len(batches) > 1 else 0.0, "cpu_s": cpu, "drain_s": end - td,
                "steps": steps[1:],
                "warm_step": steps[0] if steps else None, "eval_loss": _eval_loss(st, held_out),
                "train_losses": [losses.get(k) for k in range(len(batches))]}


def stale_worker(spec: StaleSpec, progress: bool = False) -> dict:
    """Entry point of one launched rank: every (repeat, variant, τ) run of ``run_order``, after
    one short untimed run per τ (first-use costs: allocator, kernels, segment mapping)."""
    from odcfn.models import init_params, qwen_model
    from odcfn.models.slow import slow_model
    from odcfn.sharding import Mesh

    torch.set_num_threads(spec.threads_per_rank)
    mesh = Mesh.from_env()
    w = spec.workload
    model = qwen_model(w.model)
    slow = slow_model(model, spec.factor)
    full = init_params(w.model, seed=w.seed)
    n = spec.steps + 1
    data = {"long_tail": [_batch(w, s) for s in range(n)]}
    data["noisy"] = data["long_tail"]  # the same data: (b) differs from (a) by the slow ranks only
    data["equal"] = [_batch(w.with_(balanced=True), s) for s in range(n)]
    noisy = {v: noisy_draw(n, w.world_size, spec.fraction, w.seed) if v == "noisy" else [-1] * n
             for v in VARIANTS}
    held_out = _batch(w, EVAL_STEP)
    out: dict = {"rank": mesh.rank, "noisy": noisy["noisy"], "runs": []}
    # the initial params' held-out loss: where every run starts
    out["eval_loss_init"] = _run(spec, mesh, model, slow, full, [], [], 0, held_out)["eval_loss"]
    for t in spec.taus:
        _run(spec, mesh, model, slow, full, data["long_tail"][:2], [-1, -1], t, held_out)
    order = run_order(spec)
    for i, (r, v, t) in enumerate(order):
        res = _run(spec, mesh, model, slow, full, data[v], noisy[v], t, held_out)
        out["runs"].append({"repeat": r, "variant": v, "tau": t, **res})
        if progress and mesh.rank == 0:
            sys.stderr.write(f"\r   run {i + 1}/{len(order)}: {v} τ={t} repeat {r + 1} "
                             f"{res['elapsed']:.1f}s      ")
            sys.stderr.flush()
    if progress and mesh.rank == 0:
        sys.stderr.write("\n")
    return out

