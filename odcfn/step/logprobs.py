"""What an RL loop asks of the trainer besides ``train_step``: log-probs and the full weights.

``log_probs(state, batch)``: a forward-only pass over the sharded model (old and reference
log-probs of PPO/GRPO). Every rank runs its share of the samples through a forward-only plan
(``compile_forward_plan``: each unit gathered once, every microbatch of the rank through it,
released; no scatter, no optimizer) and the per-token results ride the one sync: each rank adds
its samples' values into a zero vector holding every sample's slot, so the sum is every value on
every rank (an all-gather in all-reduce's clothes, fp64 so the sum of one value and zeros is exact).

``gather_params(state, dst=None)``: the full unsharded params on every rank (or on ``dst``), to
load into an inference engine (e.g. transformers' ``generate``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from odcfn._check import check_int
from odcfn.batch import Batch
from odcfn.kernels.quant import Wire
from odcfn.losses import LogProbs
from odcfn.schedule.balance import check_assignment
from odcfn.schedule.plan import Forward, compile_forward_plan
from odcfn.schedule.policy import policy_info, resolve_policy
from odcfn.sharding import make_layout
from odcfn.sharding.layout import check_shards
from odcfn.step import fingerprint, offload, stale
from odcfn.step.devices import state_device
from odcfn.step.execute import Executor
from odcfn.step.frozen_quant import frozen_format
from odcfn.step.prepare import check_inputs, minibatch_fingerprint, schedule_options
from odcfn.step.state import TrainState, check_fields
from odcfn.step.wire import begin_step, step_wire
from odcfn.trace import Event

__all__ = ["gather_params", "log_probs"]


class _ForwardOnly(Executor):
    """The runtime's executor with forwards that keep no graph; the head's per-token output
    ``[k, T]`` is kept per microbatch."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.head_out: dict[int, torch.Tensor] = {}

    def forward(self, s: Forward, mb: int) -> None:
        got = self._input(s, mb)
        if got is None:
            return
        data, x = got
        # its own params, those it reads (tied weights) and a mixture's expert source
        _, params, _, _ = self._inputs(replace(s, mb=mb))
        with torch.no_grad():
            y = self.units[s.unit].fwd(params, x, data)
        if s.unit == self.last:
            self.head_out[mb] = y
        else:
            self.outs[(s.unit, mb)] = y


def log_probs(
    state: TrainState, batch: Batch, *, temperature: float = 1.0, entropy: bool = False, head: str = "fused"
) -> tuple[torch.Tensor, ...] | tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Every sample's per-token log-probs (fp32, on every rank), aligned like ``Sample.extras``
    and ``loss_mask``: one value per token, ``[t]`` the log-prob of token ``t`` given tokens
    ``< t``, ``[0] = 0`` (nothing predicts the first token). So the result goes straight back as
    ``extras["old_logprobs"]`` / ``["ref_logprobs"]``. With ``entropy=True``:
    ``(log_probs, entropies)``, ``[t]`` the entropy of the distribution token ``t`` was drawn
    from (``[0] = 0``). The head is fused: no T×V tensor at any vocabulary (``head="unfused"``:
    the full-logits reference).

    Balanced like ``state.config`` says (work stealing falls back to LB-Mini's static lists; the
    forward-only cost is the training cost scaled, so the same partition); exactly one sync.
    """
    layout = check_inputs(state, batch)
    state = stale.consistent(state, "log_probs")  # under staleness: one version on every owner
    head = LogProbs(temperature=temperature, entropy=entropy, head=head)  # checks temperature
    cfg, model, transport, mesh = state.config, state.model, state.transport, state.mesh
    cap = cfg.max_tokens_per_microbatch or max(batch.lengths)
    info = policy_info(cfg.balance)
    balance = "lb_mini" if info is not None and not info.collective else cfg.balance
    assignment = resolve_policy(balance, cfg.comm, cfg.cost)(batch.lengths, mesh.world_size, cap)
    check_assignment(assignment, batch.lengths, mesh.world_size)
    options = schedule_options(cfg.options, model)  # with the model's tied-weight uses
    plan = compile_forward_plan(model.unit_names, assignment, mesh.rank, cfg.comm, options)
    dtype = cfg.compute_dtype or model.dtype
    shards = offload.shards(state)  # offloaded masters: their resident published copies
    device = next(iter(shards.values())).device
    k = 2 if entropy else 1
    offsets = [0]
    for n in batch.lengths:
        offsets.append(offsets[-1] + n)

    words, detail = minibatch_fingerprint(state, batch, layout, extra=head)
    wire = step_wire(cfg, pushes=False)  # gathers as training's
    begin_step(transport, layout, shards, dtype, wire, frozen_format(cfg))
    ex = _ForwardOnly(model, layout, batch, transport, dtype, torch.device(device), loss=head)
    ex.router_bias = state.router_bias  # route as training does
    ex.microbatches.extend(plan.microbatches)
    events: list[Event] = []
    t0 = time.perf_counter()
    ex.run_steps(plan.steps[:-1], 0, t0, events)  # all but the Sync: ours carries the values
    out = torch.zeros(k, offsets[-1], dtype=torch.float64, device=device)
    for mb, y in ex.head_out.items():
        at = 0
        for i, n in zip(plan.microbatches[mb], ex.packed[mb].seqlens):
            out[:, offsets[i] + 1: offsets[i + 1]] = y[:, at: at + n - 1].double()  # [0] stays 0
            at += n
    transport.flush()
    riders = fingerprint.encode(words, device)  # rides the same sync: no extra round trip
    summed = transport.sync(torch.cat([out.reshape(-1), riders]))
    fingerprint.check_agreement(summed[out.numel():], mesh.world_size, words, detail, call="log_probs")
    total = summed[: out.numel()].view(k, -1).float()
    rows = [tuple(total[j, offsets[i]: offsets[i + 1]].clone() for i in range(len(batch))) for j in range(k)]
    return (rows[0], rows[1]) if entropy else rows[0]


def gather_params(
    state: TrainState, dst: int | None = None, *, units: Sequence[str] | None = None,
    dtype: torch.dtype | None = None, **removed: Any,
) -> dict | None:
    """The full unsharded params (a fresh pytree) on every rank, or only on rank ``dst`` (the
    others get None). Every rank of the world must call it with the same arguments; one sync ends
    it (so no rank publishes newer shards while another still reads) and carries a fingerprint of
    the call, the layout and the step: ranks that disagree all raise the same ``ValueError``.
    ``units``: only these units.

    ``dtype``: the dtype the shards travel and arrive in; by default the one ``train_step``
    publishes (``StepConfig.compute_dtype``, else the model's), so an RL loop that alternates
    ``train_step`` and ``gather_params`` reuses the transport's publication instead of remapping
    it twice per iteration. ``dtype=state.model.dtype`` gives the full-precision params (another
    publication: the transport remaps).

    A LoRA state's adapters or merged weights: ``odcfn.lora.gather_adapters`` /
    ``odcfn.lora.gather_merged`` (the step does not know its callers' models)."""
    if removed:
        _refuse_lora_kwargs(removed)
    if not isinstance(state, TrainState):
        raise TypeError(f"state must be an odcfn.TrainState, got {type(state).__name__}")
    check_fields(state)
    state = stale.consistent(state, "gather_params")  # under staleness: one version on every owner
    mesh, transport, model = state.mesh, state.transport, state.model
    W = mesh.world_size
    rank = f"a rank in [0, {W}) or None"
    check_int(dst, "gather_params: dst", at_least=0, at_most=W - 1, none_ok=True, want=rank)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"gather_params: dtype must be a floating torch.dtype or None, got {dtype!r}")
    dtype = dtype or state.config.compute_dtype or model.dtype
    layout = make_layout(model, mesh)
    held = frozen_format(state.config)  # quantize_frozen: the base is held encoded
    check_shards(state.params, layout, model.dtype, frozen_dtype=state.config.compute_dtype,
                 one_device=False, frozen_format=held)
    device = state_device(state)  # offloaded masters may be host views (LoRA + offload on a GPU)
    if units is not None and (isinstance(units, str) or not set(units) <= set(layout.names)):
        raise ValueError(f"gather_params: units must be unit names of the model, got {units!r}")
    # offloaded masters: their resident copies when those are in the dtype asked for
    same = dtype == (state.config.compute_dtype or model.dtype)
    shards = offload.shards(state) if same else state.params
    request = (dst, None if units is None else sorted(units), dtype)
    key = fingerprint.layout_key(state, layout, state.step)
    words = fingerprint.gather_words(request, key)
    detail = [fingerprint.stable_repr(request)[:300], key[:300]]
    riders = fingerprint.encode(words, device)
    collective = state.config.comm == "collective"
    begin_step(transport, layout, shards, dtype, Wire(), held)  # unquantized (a held base: decoded)
    if collective:  # the agreement first: ranks asking for other units would issue other all-gathers
        _agree(transport.sync(riders), W, words, detail)
    want = dst is None or dst == mesh.rank
    out = {}
    for u in layout.units:
        if not (want or collective) or (units is not None and u.name not in units):
            continue
        buf = torch.empty(u.padded_numel, dtype=dtype, device=device)  # every unit where compute runs
        if collective:  # every rank joins every all-gather, whether it keeps the result or not
            transport.all_gather(u.name, buf)
        else:  # one-sided reads: a rank that asked for other units harms no peer before the sync
            transport.gather(u.name, buf).wait()
        out[u.name] = u.unflatten(buf)
    if not collective:  # the all-gathers above completed on every rank: nobody still reads
        transport.flush()
        _agree(transport.sync(riders), W, words, detail)
    return out if want else None


def _agree(summed: torch.Tensor, world_size: int, words: list[int], detail: list[str]) -> None:
    fingerprint.check_agreement(summed, world_size, words, detail, what=fingerprint.GATHER_WHAT,
                                subject="gather", call="gather_params")


def _refuse_lora_kwargs(removed: dict[str, Any]) -> None:
    """``adapters_only=`` / ``merged=`` moved to LoRA's own functions: the step wing must not
    import the LoRA wing above it, and a flag whose meaning lives elsewhere is a hidden import."""
    moved = {"adapters_only": "odcfn.lora.gather_adapters(state, dst)",
             "merged": "odcfn.lora.gather_merged(state, dst)"}
    for name in removed:
        if name in moved:
            raise TypeError(f"gather_params({name}=...) moved to LoRA: call {moved[name]}")
    raise TypeError(f"gather_params() got an unexpected keyword argument {next(iter(removed))!r}")
