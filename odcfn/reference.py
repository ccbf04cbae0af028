"""Single-process references every sharded path is tested against.

``reference_value_and_grad``: ``torch.func`` on the unsharded pytree over the whole minibatch
(the SFT loss). ``reference_rl_loss``: the RL losses written a second time, independently of
``odcfn.losses``: per sample, unpacked, on a padded ``[samples, max_len - 1]`` response matrix
the way verl-style trainers compute them, from logits any function gives per sample.
``replay``: a bounded-staleness run (``StepConfig.staleness``) recomputed from its record, each
step's gradients taken at the parameter versions every rank read, applied in order; with
``exact=True`` through the runtime's own executor and summation order (bit-identical to a
``deterministic=True`` run), otherwise independently of it (to fp32 summation order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from odcfn import trainable
from odcfn.batch import Batch, pack
from odcfn.model import Model, reference_loss
from odcfn.optim import Optimizer
from odcfn.sharding import Mesh, make_layout, shard, unshard
from odcfn.step.stale_replay import replay_exact
from odcfn.tree import PyTree

__all__ = ["reference_rl_loss", "reference_value_and_grad", "replay"]

# [step][rank] = (sample ids, or the Plan that ran, {unit: version read}): odcfn.step.stale.record
Record = Sequence[Sequence[tuple[Any, Mapping[str, int]]]]


def reference_value_and_grad(model: Model, params: PyTree, batch: Batch) -> tuple[torch.Tensor, PyTree]:
    grads, loss = torch.func.grad_and_value(lambda p: reference_loss(model, p, batch))(params)
    return loss, grads


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(r.numel() for r in rows), dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def reference_rl_loss(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    batch: Batch,
    *,
    kind: str = "policy_gradient",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    kl_loss_coef: float = 0.0,
    kl_loss_type: str = "low_var_kl",
    entropy_coeff: float = 0.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    temperature: float = 1.0,
    decoupled: bool = False,
    behav_imp_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The minibatch loss (differentiable through ``logits_fn``) and its metrics.

    ``decoupled``: the proximal-anchored objective, per token
    ``w * max(-A r, -A clip(r))`` (dual-clipped) with ``r = pi / pi_prox`` and the constant
    ``w = pi_prox / pi_behav`` (zeroed where it exceeds ``behav_imp_weight_cap``).

    ``logits_fn(tokens_L) -> logits_LxV`` runs the model on one unpacked sample. ``kind`` is
    ``"policy_gradient"`` or ``"cross_entropy"`` (the latter ignores the policy parameters).
    """
    logp_rows, ent_rows, mask_rows = [], [], []
    ex_rows: dict[str, list[torch.Tensor]] = {
        k: [] for k in ("advantages", "old_logprobs", "ref_logprobs", "prox_logprobs")}
    for s in batch.samples:
        logits = logits_fn(s.tokens.long()).float()[:-1] / temperature  # position t predicts t+1
        logprobs = torch.log_softmax(logits, dim=-1)
        logp_rows.append(logprobs.gather(-1, s.tokens.long()[1:, None])[:, 0])
        ent_rows.append(-(logprobs.exp() * logprobs).sum(-1))
        mask = torch.ones(s.length - 1) if s.loss_mask is None else s.loss_mask[1:].float()
        mask_rows.append(mask)
        for k in ex_rows:
            ex_rows[k].append(s.extras[k][1:] if k in s.extras else torch.zeros(s.length - 1))
    logp, ent, mask = _padded(logp_rows), _padded(ent_rows), _padded(mask_rows)
    ex = {k: _padded(v) for k, v in ex_rows.items()}

    def agg(x: torch.Tensor) -> torch.Tensor:
        per_seq = (x * mask).sum(-1)
        n_seq = mask.sum(-1)
        live = n_seq > 0
        if loss_agg_mode == "token-mean":
            return (x * mask).sum() / mask.sum()
        if loss_agg_mode == "seq-mean-token-mean":
            return (per_seq[live] / n_seq[live]).mean()
        if loss_agg_mode == "seq-mean-token-sum":
            return per_seq[live].mean()
        if loss_agg_mode == "seq-mean-token-sum-norm":
            return per_seq.sum() / loss_scale_factor
        raise ValueError(loss_agg_mode)

    def token_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * mask).sum() / mask.sum()

    if kind == "cross_entropy":
        return agg(-logp), {}
    adv, old, ref = ex["advantages"], ex["old_logprobs"], ex["ref_logprobs"]
    prox = ex["prox_logprobs"] if decoupled else old
    neg_kl = torch.clamp(logp - prox, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_max = torch.max(pg1, pg2)
    pg3 = -adv * clip_ratio_c
    pg = torch.where(adv < 0, torch.min(pg3, pg_max), pg_max)
    if decoupled:
        behav = torch.exp(torch.clamp(prox - old, -20.0, 20.0))
        if behav_imp_weight_cap is not None:
            behav = behav * (behav <= behav_imp_weight_cap)
        pg = pg * behav
    if kl_loss_type in ("kl", "k1"):
        kl = logp - ref
    elif kl_loss_type == "abs":
        kl = (logp - ref).abs()
    elif kl_loss_type in ("mse", "k2"):
        kl = 0.5 * (logp - ref) ** 2
    elif kl_loss_type in ("low_var_kl", "k3"):
        d = torch.clamp(ref - logp, -20.0, 20.0)
        kl = torch.clamp(torch.exp(d) - d - 1, -10.0, 10.0)
    else:
        raise ValueError(kl_loss_type)
    pg_loss, kl_loss, entropy = agg(pg), agg(kl), agg(ent)
    loss = pg_loss - entropy_coeff * entropy + (kl_loss_coef * kl_loss if kl_loss_coef else 0.0)
    metrics = {
        "pg_loss": pg_loss,
        "pg_clipfrac": token_mean((pg2 > pg1).float()),
        "pg_clipfrac_lower": token_mean(((pg_max > pg3) & (adv < 0)).float()),
        "ppo_kl": token_mean(-neg_kl),
        "kl_loss": kl_loss if kl_loss_coef else torch.zeros(()),
        "entropy": entropy,
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def replay(
    model: Model, params: PyTree, optimizer: Optimizer, batches: Sequence[Batch], record: Record,
    *, start: int = 0, exact: bool = False, config: Any = None, router_bias: Any = None,
) -> PyTree:
    """The params a bounded-staleness run ends with, recomputed on one process from its record.

    ``record[k][r] = (sample ids, {unit: version})``: what rank ``r`` ran in step ``start + k``
    and the parameter version each unit was gathered at (``odcfn.step.stale.record(metrics)``).
    Version ``v`` is the params after the updates of steps ``< v`` (``params`` is version
    ``start``). Step ``k``'s gradient is the sum over ranks, in rank order, of the gradient of
    the rank's samples' share of the minibatch loss at the unsharded params mixing, unit by
    unit, the versions that rank read; the optimizer then applies it to version ``k``. Every
    shard-wise operation of the run is elementwise, so the result equals the run's params up to
    fp32 summation order (the run sums microbatches and ranks in arrival order): see
    docs/staleness.md. Dense models with the default cross-entropy loss.

    ``exact=True`` (``odcfn.step.stale_replay``): each rank's share is the runtime's executor
    running the plan that rank ran (``stale.record(metrics, plans=True)``) at the recorded
    versions, its pushes summed per rank and then in rank order, each owner updated on its own:
    bit-identical to a run with ``StepConfig(deterministic=True)``; ``config``: the run's
    ``StepConfig`` (its loss and compute dtype; default ``StepConfig()``); ``router_bias``: a
    mixture's fixed router bias (the run's ``TrainState.router_bias``).
    """
    if exact:
        return replay_exact(model, params, optimizer, batches, record, start=start, config=config,
                            router_bias=router_bias)
    if config is not None:
        raise ValueError("replay: config is read by the exact replay only (exact=True)")
    if router_bias is not None:  # the independent replay covers dense models only (below)
        raise ValueError("replay: router_bias is read by the exact replay only (exact=True)")
    if model.router is not None:
        raise ValueError("replay covers dense models (a mixture's aux loss is not split by rank here)")
    mesh = Mesh(1, 0)
    layout = make_layout(model, mesh)
    opt = optimizer.for_layout(layout)
    history = {start: shard(params, model, mesh)}  # version -> {unit: flat fp32}
    opt_state = opt.init(trainable.split(model, history[start]))
    names = trainable.trainable_names(model)
    for k, (batch, ranks) in enumerate(zip(batches, record, strict=True), start):
        batch = copy.copy(batch)
        object.__setattr__(batch, "step", k)  # as train_step keys training-time randomness
        grads = {u: torch.zeros_like(history[k][u]) for u in names}
        for samples, versions in ranks:
            if hasattr(samples, "microbatches"):  # a record with plans (stale.record(plans=True))
                samples = [i for mb in samples.microbatches for i in mb]
            if not samples:  # nothing run on that rank: no gradient
                continue
            point = {u: history[versions[u]][u].detach().requires_grad_(u in names) for u in model.unit_names}
            tree = {u: layout[u].unflatten(point[u]) for u in model.unit_names}
            total = sum(model.apply(tree, pack(batch, [i])) for i in samples) / batch.num_loss_tokens
            got = torch.autograd.grad(total, [point[u] for u in names], allow_unused=True)
            for u, g in zip(names, got):
                if g is not None:
                    grads[u] += g
        new, opt_state = opt.update(grads, opt_state, trainable.split(model, history[k]))
        history[k + 1] = {**history[k], **new}
    return unshard([history[max(history)]], model, mesh)
