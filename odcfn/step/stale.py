"""``train_step`` under bounded staleness (``StepConfig(staleness=τ)``, τ >= 1; docs/staleness.md).

The synchronous step ends in one global sync and every rank updates what it owns. Here a rank
runs minibatch ``j`` against parameter versions ``>= j - τ(unit)``, pushes its gradients into
the owners' accumulator slot for ``j``, deposits its stats and returns without waiting for
anyone (``odcfn.transport.versions``). Each owner applies step ``k`` (this module's ``_Owner.apply``:
the optimizer on its shards) once every rank's pushes for ``k`` have reached it, at its next wait
or step boundary, and publishes version ``k + 1``.

So the state a step returns holds the owner's newest applied version, which may trail
``state.step`` by up to τ + 1 updates, and the loss and gradient norm of a step arrive late: a
step's metrics report every earlier step whose figures became complete
(``metrics.extra["reports"]``). ``drain(state)`` waits until every step below ``state.step`` is
applied everywhere: the consistent point for checkpoints, evaluation and the end of training.

What each gather read is recorded (``metrics.extra["versions_read"]``), so the run is a
deterministic function of its record: ``odcfn.reference.replay`` recomputes it on one process.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from odcfn import trainable
from odcfn.batch import Batch
from odcfn.losses import check_loss, loss_metrics
from odcfn.model import Model
from odcfn.optim import Optimizer
from odcfn.schedule.policy import prepare_program
from odcfn.schedule.program import Piece, assemble_plan
from odcfn.sharding import Layout
from odcfn.step import fingerprint
from odcfn.step.agree import check_trained_units
from odcfn.step.execute import Executor
from odcfn.step.experts import expert_load_metrics
from odcfn.step.ordered_push import check_head
from odcfn.step.prepare import check_inputs, minibatch_fingerprint, recording, schedule_options
from odcfn.step.stale_config import max_staleness, unit_staleness
from odcfn.step.state import StepMetrics, TrainState

__all__ = ["active", "check", "consistent", "drain", "record", "train_step"]


def active(config: Any) -> bool:
    """Whether ``config`` asks for bounded staleness (some unit with τ >= 1)."""
    return max_staleness(config.staleness) > 0


def check(state: TrainState) -> dict[str, int]:
    """Each unit's τ, or a ``ValueError``/``TypeError`` naming what cannot run stale, before any
    communication and alike on every rank."""
    cfg, tr = state.config, state.transport
    taus = unit_staleness(cfg.staleness, state.model.unit_names)  # a pattern matching nothing
    if not callable(getattr(tr, "versions", None)):
        raise TypeError(
            f"StepConfig.staleness={cfg.staleness!r} needs a transport with parameter versions "
            f"(LocalWorld's in-process ranks, ShmTransport's processes); {type(tr).__name__} has none: "
            "use staleness=0"
        )
    if len(state.mesh.replica_group) > 1:
        raise ValueError(
            "StepConfig.staleness >= 1 with hybrid sharding: the replica all-reduce is a collective "
            "every rank joins at every step, so no rank can run ahead (use sharding='full')"
        )
    if cfg.max_grad_norm is not None:
        # the global norm of step k needs every owner's share of k: each owner would wait for all
        # the others before applying k, which is the barrier staleness removes
        raise ValueError(
            "StepConfig.max_grad_norm cannot be combined with StepConfig.staleness >= 1: clipping by "
            "the global norm makes every owner wait for every other owner's gradient before its "
            "update (a global barrier per step); use staleness=0 to clip"
        )
    if cfg.nonfinite != "raise":
        raise ValueError(
            "StepConfig.nonfinite='skip' cannot be combined with StepConfig.staleness >= 1: owners "
            "apply a step independently, so a skip seen by one owner would not be seen by the others"
        )
    if cfg.donate:
        raise ValueError(
            "StepConfig.donate=True cannot be combined with StepConfig.staleness >= 1: older versions "
            "stay readable by peers, so updates are never made in place"
        )
    if cfg.expert_bias_rate:
        raise ValueError(
            "StepConfig.expert_bias_rate > 0 cannot be combined with StepConfig.staleness >= 1 yet: the "
            "bias update needs the minibatch's summed expert loads, which no rank waits for under staleness"
        )
    if cfg.deterministic:
        # each owner sums a step's pushes in rank order (odcfn.transport.versions_det): the transport
        # must keep one buffer per rank, and the head's own gradient must be reproducible
        if not getattr(tr, "ordered_versions", False):
            raise TypeError(
                f"StepConfig(deterministic=True) with StepConfig.staleness >= 1 needs a transport whose "
                f"versions sum in rank order (LocalWorld's in-process ranks, ShmTransport); "
                f"{type(tr).__name__} has none: use deterministic=False or staleness=0"
            )
        check_head(cfg.loss, next(iter(state.params.values())).device)
    return taus


@dataclass
class _Owner:
    """This rank as an owner: its newest applied shards and optimizer state, and what it needs to
    check and report each step it applies."""

    model: Model
    optimizer: Optimizer
    # (params, optimizer state) of the newest applied version, swapped as one: a peer's thread may
    # apply this owner's step (odcfn.transport.versions) while this rank reads it
    current: tuple[dict[str, torch.Tensor], Any]
    next_step: int  # the minibatch this rank runs next
    world_size: int
    handed: Any = None  # the params dict the last returned state holds (the caller must pass it back)
    at_step: Any = None  # the params dict ``consistent`` gave at ``next_step`` (may be passed back too)
    words: dict[int, tuple[list[int], list[str]]] = field(default_factory=dict)  # step -> fingerprint
    reported: int = 0  # the next step whose loss this rank has not reported
    last: tuple[int, float, float] | None = None  # (step, loss, grad norm) newest reported
    # step -> (metric count, loss tokens, a mixture's expert-load shape): how to read its stats
    layout_info: dict[int, tuple[int, int, tuple[int, ...] | None]] = field(default_factory=dict)

    def apply(self, k: int, grads: dict[str, torch.Tensor], stats: torch.Tensor) -> dict[str, torch.Tensor]:
        """Step ``k``'s update of this owner's shards; raises like the synchronous step would."""
        words, detail = self.words.pop(k)  # the fingerprint rode the stats: 2 values per word
        fingerprint.check_agreement(stats[-2 * len(words):], self.world_size, words, detail)
        finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
        if not (finite and math.isfinite(float(stats[0]))):
            raise FloatingPointError(
                f"step {k}: the minibatch's loss sum is {float(stats[0])} or this owner's gradient is not "
                "finite: refusing the step (staleness runs with nonfinite='raise')"
            )
        params, opt_state = self.current
        ours = trainable.split(self.model, grads)
        new, opt_state = self.optimizer.update(ours, opt_state, trainable.split(self.model, params))
        params = {**params, **new} if self.model.frozen else new
        self.current = (params, opt_state)
        return params


class _StaleExecutor(Executor):
    """The runtime's executor whose Sync is the per-owner completion: pushes land, this rank's
    stats are deposited for the owners, and nobody is waited for."""

    def sync(self) -> torch.Tensor:
        for h in self.pushes:
            h.wait()
        s = self.loss_sum.reshape(-1)  # the synchronous layout: [loss, norm², metrics, loads, riders]
        stats = torch.cat([s[:1], torch.zeros(1, dtype=s.dtype, device=s.device), s[1:]])
        if self.loads is not None:
            stats = torch.cat([stats, self.loads.reshape(-1).to(stats.device)])
        if self.riders is not None:
            stats = torch.cat([stats, self.riders.to(stats.device, torch.float64)])
        self.t.complete(stats)
        return stats


def _owner_of(state: TrainState, layout: Layout, dtype: torch.dtype, ring: int) -> tuple[Any, _Owner]:
    ordered = {"ordered": True} if state.config.deterministic else {}  # rank-order sums (versions_det)
    view = state.transport.versions(ring, state.step, **ordered)
    owner = view.owner
    if owner is None:
        owner = _Owner(state.model, state.optimizer.for_layout(layout), (dict(state.params), state.opt_state),
                       state.step, state.mesh.world_size, reported=state.step)
        view.owner = owner
        view.start(layout, state.params, dtype, owner.apply)
    elif state.step != owner.next_step or not _ours(owner, state):
        raise ValueError(
            f"bounded staleness: pass the TrainState the last train_step (or drain) returned, at step "
            f"{owner.next_step}; got one at step {state.step}"
            + ("" if state.step != owner.next_step else " holding other params")
        )
    return view, owner


def dealt(rank: int, step: int, world_size: int) -> int:
    """Which of the balancer's per-rank work lists ``rank`` runs in minibatch ``step``: a
    permutation drawn from the step, the same on every rank. Balancers hand their heaviest list to
    the same rank every minibatch (LB-Mini's first), which makes that rank the critical path at
    any τ; dealt afresh each step, a rank that drew a heavy list catches up on lighter ones while
    its peers run ahead, which is what staleness can hide (``odcfn simulate --staleness``
    measures both). Without staleness every rank meets at each step, so the deal is not made."""
    order = list(range(world_size))
    random.Random(step).shuffle(order)  # Python's Mersenne Twister: identical in every process
    return order[rank]


def _ours(owner: _Owner, state: TrainState) -> bool:
    return state.params is owner.handed or (owner.at_step is not None and state.params is owner.at_step)


def _reports(view: Any, owner: _Owner, loss: Any, upto: int) -> dict[int, dict[str, float]]:
    """The figures of every step from ``owner.reported`` on that became complete, in order."""
    out: dict[int, dict[str, float]] = {}
    while owner.reported < upto:
        got = view.report(owner.reported)
        if got is None:
            break
        stats, norm2 = got
        k = owner.reported
        m, tokens, loads = owner.layout_info.pop(k)
        fig: dict[str, Any] = {"loss": float(stats[0]), "grad_norm": math.sqrt(max(norm2, 0.0))}
        fig.update(loss_metrics(loss, tuple(float(x) for x in stats[2:2 + m]), tokens))
        if loads is not None:  # the minibatch's tokens per expert, summed over ranks as the sync would
            n = math.prod(loads)
            fig.update(expert_load_metrics(owner.model, stats[2 + m:2 + m + n].reshape(loads).float().cpu()))
        out[k] = fig
        owner.last = (k, fig["loss"], fig["grad_norm"])
        owner.reported += 1
    return out


def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, StepMetrics]:
    """``odcfn.train_step`` for τ >= 1 (``train_step`` dispatches here)."""
    t0 = time.perf_counter()
    layout = check_inputs(state, batch)
    taus = check(state)
    cfg, model, mesh = state.config, state.model, state.mesh
    check_loss(cfg.loss).validate(batch)
    if batch.pairs:
        raise ValueError("StepConfig.staleness >= 1 does not run preference pairs yet: use staleness=0")
    if batch.step != state.step:  # training-time randomness is keyed on the step (as train_step does)
        batch = copy.copy(batch)
        object.__setattr__(batch, "step", state.step)
    dtype = cfg.compute_dtype or model.dtype
    device = next(iter(state.params.values())).device
    check_trained_units(state.transport, layout, mesh)  # before any push (odcfn.step.agree)
    view, owner = _owner_of(state, layout, dtype, max(taus.values()) + 1)
    j = state.step
    view.service()  # whatever completed since this rank's last step
    view.open(j, taus)
    seen: list = []
    cap = cfg.max_tokens_per_microbatch or max(batch.lengths)
    program = prepare_program(
        recording(cfg.balance, seen), batch.lengths, units=model.unit_names, world_size=mesh.world_size,
        rank=dealt(mesh.rank, j, mesh.world_size), max_tokens=cap, comm="odc",
        options=schedule_options(cfg.options, model, cfg.remat), cost=cfg.cost, fetch_add=view.fetch_add,
        max_counters=view.max_counters,
    )
    words, detail = minibatch_fingerprint(state, batch, layout, seen[-1] if seen else None)
    owner.words[j] = (words, detail)
    before = view.counters.copy()
    ex = _StaleExecutor(model, layout, batch, view, dtype, device, cfg.loss)
    ex.riders, ex.t0 = fingerprint.encode(words, device), t0
    ran: list[Piece] = []
    synced = False
    for piece in program:
        offset = len(ex.microbatches)
        ex.microbatches.extend(piece.microbatches)
        ran.append(piece)
        synced = ex.run_steps(piece.steps, offset, t0, ex.events) is not None or synced
    if not synced:
        raise ValueError("the program has no Sync step")
    owner.layout_info[j] = (len(cfg.loss.metric_names), batch.num_loss_tokens,
                            None if ex.loads is None else tuple(ex.loads.shape))
    owner.next_step = j + 1
    view.service()
    lags = [j - v for _, v in view.reads]
    reports = _reports(view, owner, cfg.loss, j + 1)
    last = owner.last
    metrics = StepMetrics(
        loss=last[1] if last else math.nan, grad_norm=last[2] if last else math.nan,
        num_samples=len(batch), num_tokens=sum(batch.lengths), num_loss_tokens=batch.num_loss_tokens,
        step_time=time.perf_counter() - t0, plan=assemble_plan(mesh.rank, "odc", model.unit_names, ran),
        counters=view.counters - before, events=ex.events,
        extra={
            "staleness_max": max(lags, default=0),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "versions_read": dict(view.pinned),
            "version_wait_s": view.wait_s,
            "version_applied": view.applied,
            "metrics_step": last[0] if last else None,  # the step metrics.loss / grad_norm are of
            "reports": reports,
        },
    )
    params, opt_state = owner.current
    owner.handed = params
    return state.replace(params=params, opt_state=opt_state, step=j + 1), metrics


def drain(state: TrainState) -> tuple[TrainState, dict[int, dict[str, float]]]:
    """Wait until every owner has applied every step below ``state.step`` (every rank calls it);
    returns the state at that version (params of exactly ``state.step`` updates: the consistent
    point to save, evaluate or stop) and the figures of the steps not yet reported. A state that
    never ran stale is returned as is."""
    view = getattr(state.transport, "_stale", None)
    if view is None or view.owner is None:
        return state, {}
    owner = view.owner
    if state.step != owner.next_step or not _ours(owner, state):
        raise ValueError(f"drain: pass the TrainState the last train_step returned (step {owner.next_step})")
    n = state.step
    view.wait_applied(n)
    reports = _reports(view, owner, state.config.loss, n)
    params, opt_state = owner.current
    owner.handed = params
    return state.replace(params=params, opt_state=opt_state), reports


def consistent(state: TrainState, who: str = "this call") -> TrainState:
    """``state`` at the version every owner has applied all its steps to (params of exactly
    ``state.step`` updates), without taking the reports ``drain`` hands out: what ``odcfn.save``,
    ``log_probs`` and ``gather_params`` read, so a snapshot or a rollout never mixes versions
    across owners. Every rank calls it (it waits for the slowest owner). A state that never ran
    stale is returned as is; the result may be passed back to ``train_step``."""
    view = getattr(state.transport, "_stale", None)
    if view is None or view.owner is None:
        return state
    owner = view.owner
    if state.step != owner.next_step or not _ours(owner, state):
        raise ValueError(
            f"{who} under bounded staleness: pass the TrainState the last train_step (or drain) "
            f"returned, at step {owner.next_step}; got one at step {state.step}"
        )
    view.wait_applied(state.step)
    params, opt_state = owner.current  # nobody applies step state.step before this rank ran it
    owner.at_step = params
    return state.replace(params=params, opt_state=opt_state)


def record(
    metrics: list[list[StepMetrics]], *, plans: bool = False
) -> list[list[tuple[Any, dict[str, int]]]]:
    """The schedule of a stale run for ``odcfn.reference.replay``: ``metrics[rank][i]`` (the
    ranks' metrics of consecutive steps) -> ``[step][rank] = (sample ids, {unit: version read})``.
    ``plans=True``: the plan that ran (its microbatches and steps, ``metrics.plan``) in place of
    the sample ids, as the exact replay (``replay(..., exact=True)``) needs."""
    steps = len(metrics[0])
    if any(len(m) != steps for m in metrics):
        raise ValueError("record: every rank needs the metrics of the same steps")
    return [
        [(m[s].plan if plans else tuple(i for mb in m[s].plan.microbatches for i in mb),
          dict(m[s].extra["versions_read"]))
         for m in metrics]
        for s in range(steps)
    ]
