"""Automatic hybrid synchronisation: measure each unit's gradient sensitivity, keep the most
sensitive units synchronous (docs/staleness.md, "Automatic hybrid synchronisation").

``measure(state, batches)`` runs synchronous ``grad_step``s on a few minibatches and scores each
trained unit ``u`` by how much its gradient changes from one minibatch to the next, relative to
its size (HAT's S(l)); with ``g_t(u)`` the full (unsharded) gradient of ``u`` for minibatch
``t`` at ``state``'s parameters and ``T = len(batches)``:

    S(u) = 1/(T-1) * sum_{t=1}^{T-1}  ||g_t(u) - g_{t-1}(u)||_2 / (||g_{t-1}(u)||_2 + eps)

A unit whose gradient swings a lot between minibatches is the one a stale read hurts most, so
``hybrid(scores, tau)`` turns the scores into a ``StepConfig(staleness=...)`` dict: the most
sensitive units at τ = 0, the rest at τ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from odcfn.batch import Batch
from odcfn.step import stale
from odcfn.step.state import TrainState
from odcfn.step.train import grad_step
from odcfn.trainable import trainable_names
from odcfn.transport.base import world_group

__all__ = ["hybrid", "measure"]


def _check_counts(state: TrainState, n: int) -> None:
    """Every rank passed the same number of minibatches, else a ``ValueError`` on every rank.

    The fingerprint inside ``grad_step`` catches ranks that disagree on a minibatch's content,
    but a rank with fewer minibatches would enter the final all-reduce while its peers start
    another step, and they would only meet the world's timeout; one small all-reduce of the
    counts first turns that into a clear error naming each rank's count.
    """
    mesh = state.mesh
    mine = torch.zeros(mesh.world_size, dtype=torch.float64)
    mine[mesh.rank] = n
    counts = [int(c) for c in state.transport.collectives.all_reduce(world_group(mesh), mine).tolist()]
    if len(set(counts)) > 1:
        raise ValueError(
            "sensitivity.measure is collective: every rank must pass the same minibatches, but the "
            f"ranks passed {dict(enumerate(counts))} minibatches (rank: count)"
        )


def measure(state: TrainState, batches: Iterable[Batch], *, eps: float = 1e-12) -> dict[str, float]:
    """Each trained unit's gradient sensitivity ``S(u)`` (the module's docstring has the formula).

    Collective: every rank calls it with the same ``batches`` (at least 2). It runs one
    synchronous ``grad_step`` (τ = 0, whatever ``state.config.staleness`` says) per minibatch at
    ``state``'s parameters, without optimizer steps, so ``S(u)`` is the relative change of the
    unit's gradient from one minibatch to the next. Ranks that disagree on a minibatch raise in
    ``grad_step`` (its fingerprint); ranks that pass different numbers of minibatches raise
    before the first one. The per-unit squared norms of the owners' gradient shards are summed
    over the ranks in one all-reduce of the transport's collectives at the end, so every rank
    returns the same scores. Frozen units have no gradient and get no score. ``state`` is not
    changed. On a state a stale run returned (not drained), each owner's newest applied version
    may trail ``state.step`` by a different amount, so the scores are taken at the version every
    owner reaches after all ``state.step`` updates (``stale.consistent``, what ``log_probs``
    reads): never a mix of versions across owners.

    Returns ``{unit: S(u)}`` in the model's unit order.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"sensitivity.measure: state must be an odcfn.TrainState, got {type(state).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"sensitivity.measure: eps must be a finite float > 0, got {eps!r}")
    batches = list(batches)
    if len(batches) < 2:
        raise ValueError(
            f"sensitivity.measure needs at least 2 minibatches (S(u) compares consecutive gradients), "
            f"got {len(batches)}"
        )
    # under staleness: one version on every owner (waits for the slowest), before any gradient
    state = stale.consistent(state, "sensitivity.measure")
    if stale.active(state.config):  # the measurement is of the synchronous gradients
        state = state.replace(config=state.config.replace(staleness=0))
    _check_counts(state, len(batches))
    names = trainable_names(state.model)
    mesh = state.mesh
    # under hybrid sharding every replica holds the same (all-reduced) shard: one of them counts
    owns = mesh.rank == mesh.replica_group[0]
    rows = []  # per pair (t-1, t): [||g_t - g_{t-1}||² by unit, ||g_{t-1}||² by unit], this shard's share
    prev: dict[str, torch.Tensor] | None = None
    for batch in batches:
        grads, _ = grad_step(state, batch)  # copies: the next step does not overwrite them
        grads = {u: grads[u].to(torch.float64) for u in names}  # fp64 sums: tiny differences survive
        if prev is not None:
            diff = [(grads[u] - prev[u]).square().sum() for u in names]
            norm = [prev[u].square().sum() for u in names]
            rows.append(torch.stack(diff + norm))
        prev = grads
    local = torch.stack(rows).cpu()
    if not owns:
        local.zero_()
    # the shards of a unit partition its flat vector, so squared norms add up across owners
    total = state.transport.collectives.all_reduce(world_group(mesh), local).cpu()
    diff2, norm2 = total[:, : len(names)], total[:, len(names) :]
    scores = (diff2.clamp_min(0).sqrt() / (norm2.clamp_min(0).sqrt() + eps)).mean(0)
    return {u: float(s) for u, s in zip(names, scores)}


def hybrid(
    scores: Mapping[str, float], tau: int, *, keep: float | None = None, n: int | None = None
) -> dict[str, int]:
    """A ``StepConfig(staleness=...)`` dict from ``measure``'s scores: the most sensitive units at
    0 (synchronous), every other scored unit at ``tau``.

    ``keep``: the fraction of units kept synchronous, in (0, 1]; ``ceil(keep * len(scores))``
    units, so any ``keep > 0`` keeps at least one (default 0.25 when ``n`` is not given). ``n``:
    the number of units kept synchronous instead, ``0 <= n <= len(scores)``. Ties in score are
    broken by unit name, so every rank builds the same dict. Keys are exact unit names (an exact
    name wins over patterns in ``StepConfig.staleness``); units without a score (frozen ones)
    are not named and stay at 0 unless the caller adds a pattern such as ``"*"`` after them.
    """
    if not isinstance(scores, Mapping) or not scores:
        raise ValueError(
            f"sensitivity.hybrid: scores must be a non-empty dict of unit -> S(u), got {scores!r}"
        )
    for u, s in scores.items():
        if not isinstance(u, str) or not u:
            raise ValueError(f"sensitivity.hybrid: unit name {u!r} must be a non-empty str")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise ValueError(f"sensitivity.hybrid: score of {u!r} must be a finite number >= 0, got {s!r}")
    # bool is an int subclass: True would silently mean τ = 1
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
        raise ValueError(
            "sensitivity.hybrid: tau must be an int >= 1 (the τ of the units not kept synchronous), "
            f"got {tau!r}"
        )
    if keep is not None and n is not None:
        raise ValueError("sensitivity.hybrid: pass keep (a fraction) or n (a count), not both")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(scores):
            raise ValueError(f"sensitivity.hybrid: n must be an int in [0, {len(scores)}], got {n!r}")
        count = n
    else:
        keep = 0.25 if keep is None else keep
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < keep <= 1:
            raise ValueError(f"sensitivity.hybrid: keep must be a fraction in (0, 1], got {keep!r}")
        count = math.ceil(round(keep * len(scores), 9))  # 0.3 * 10 is 3.0000000000000004 in floats
    ranked = sorted(scores, key=lambda u: (-scores[u], u))
    kept = set(ranked[:count])
    return {u: 0 if u in kept else tau for u in scores}
