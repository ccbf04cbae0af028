"""``StepConfig`` (how a minibatch is run) and ``TrainState`` (what a step transforms).

``TrainState`` is a frozen dataclass registered as a pytree: its children are the arrays a step
changes (``params``, ``opt_state``, ``step``), its static fields the things it runs with
(``model``, ``optimizer``, ``transport``, ``config``). ``train_step(state, batch)`` returns a
new state; nothing is mutated but the transport's buffers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from odcfn._check import check_int, check_number
from odcfn.losses import check_loss, cross_entropy
from odcfn.model import Model, check_params
from odcfn.optim import Optimizer
from odcfn.schedule.cost import CostModel
from odcfn.schedule.plan import Comm, Plan, ScheduleOptions
from odcfn.schedule.policy import Policy, WorkStealing, policy_info, resolve_policy
from odcfn.sharding import Mesh, make_layout, shard
from odcfn.sharding.layout import check_shards
from odcfn.step.frozen_quant import frozen_format, is_resident, keep
from odcfn.step.offload_config import Offload
from odcfn.step.offload_store import place
from odcfn.step.stale_config import Staleness, check_staleness, max_staleness
from odcfn.step.wire import check_wire_config
from odcfn.trace import Event
from odcfn.trainable import freeze, split
from odcfn.transport.base import Counters, Transport
from odcfn.tree import register_dataclass, tree_flatten_with_path

__all__ = [
    "StepConfig", "StepMetrics", "TrainState", "check_fields", "check_live", "check_opt_state", "donate",
]


@dataclass(frozen=True)
class StepConfig:
    """How ``train_step`` runs a minibatch. Every rank must use the same config.

    ``comm``: "odc" (point-to-point, one sync) or "collective" (the FSDP baseline).
    ``balance``: a policy name (``odcfn.schedule.POLICIES``), a balancer callable or
    ``odcfn.WorkStealing(...)``. ``max_tokens_per_microbatch``: the packing cap (None: the
    longest sample of each minibatch). ``compute_dtype``: what gathers deliver and units compute
    in (master shards and accumulators stay fp32; frozen units' shards, only ever gathered, are kept
    in the compute dtype alone when it is narrower). ``max_grad_norm``: clip by the global norm the
    one sync carries. ``cost``: the cost model balancers use. ``loss``: the per-token loss the
    head unit applies (default ``cross_entropy()``; None means the same). ``nonfinite``: a
    minibatch whose loss or gradient norm is NaN/inf raises ``FloatingPointError`` on every rank
    ("raise"), or is skipped ("skip": params, optimizer state and step unchanged,
    ``metrics.extra["skipped_nonfinite"]``). ``remat``: True recomputes every unit's forward
    inside its backward (only each unit's input is kept between them: activation memory O(T)
    per unit, about 1/3 more compute); ``options.remat`` names units one by one instead.
    ``deterministic``: ODC gradients reduced in a fixed order, so equal inputs give bit-identical
    results run after run (restarts, debugging): every owner adds the pushes in the fixed
    order (microbatch slot, rank), each microbatch's gradient pushed when its turn comes and
    staged until then (at most ``ordered_push.WINDOW_BYTES`` plus one gradient per rank; see
    docs/reliability.md). On CUDA it needs ``torch.use_deterministic_algorithms(True)`` (torch's
    attention backward sums with atomics otherwise); both heads are reproducible.
    The default adds each microbatch's push as it arrives (faster; runs then differ in the last
    bits when a rank has several microbatches). Collective mode
    is always in a fixed order. Work stealing decides the split at run time: not deterministic.
    Under ``staleness`` >= 1 each owner instead sums every rank's own pushes (in its plan's
    order) and then the ranks in rank order, so a run equals the exact replay of its record bit
    for bit, with any balancer, work stealing included (docs/staleness.md).
    ``donate``: ``train_step`` updates the params and optimizer moments in place (JAX's buffer
    donation) and returns a state holding the same tensors; the state passed in is used up, and
    handing it to ``train_step``, ``grad_step``, ``log_probs``, ``gather_params`` or ``odcfn.save``
    again raises ``ValueError``. It saves the update's new copy of every trained shard and of
    its moments (three fp32 copies of a 151,936 × 4,096 head: 7 GiB). Shards given to
    ``TrainState.create`` as tensors are updated in place too.
    ``staleness``: bounded staleness τ (docs/staleness.md): 0 (default) is the synchronous step;
    τ >= 1 lets a rank run up to τ minibatches ahead of the slowest, each gather reading a
    parameter version >= step - τ; a dict of unit patterns -> τ (``{"head": 0, "*": 1}``) keeps
    some units synchronous. τ >= 1 needs ``comm="odc"`` and a transport with versions.
    ``expert_bias_rate``: a mixture of experts' auxiliary-loss-free balancing (docs/moe.md): each
    router adds a per-expert bias (``TrainState.router_bias``) to its scores for the top-k choice
    only, and after every step the bias moves by this rate toward the under-loaded experts of
    the minibatch (loads summed in the one sync: every rank computes the same bias). 0: off.
    ``offload``: ``odcfn.Offload(path, budget_gib, prefetch)`` keeps each owner's fp32 master
    shards and optimizer state in a slower tier (files under ``path``; host memory when None)
    and streams the update through a bounded budget, bit-identical to the in-memory step; the
    update is then in place, as with ``donate`` (docs/memory.md). None: all in memory.
    ``gather_format``: what gathers move (docs/memory.md): None (default) the compute dtype, as
    always; "bf16", "fp8_e4m3" or "int8" block-quantized by the owner right after its update, one
    fp32 scale per ``quant_block`` values, dequantized into the compute dtype by the gatherer.
    ``push_format``: what gradient pushes move: None (default) the gradient in the compute dtype;
    "fp32", "bf16" or "int8" (block-quantized; owners accumulate in fp32; point-to-point only).
    ``push_error_feedback``: carry each push's rounding error into this rank's next push of the
    same unit (kept by the transport across steps; not in checkpoints).
    ``quantize_frozen``: keep the frozen units (a LoRA base) resident only in ``gather_format``
    (ZeRO++'s MixZ++; docs/memory.md): each owner encodes its frozen shards once, when the state
    is created, and drops their full-precision copy; training and ``log_probs`` are unchanged bit
    for bit, ``gather_params`` / ``odcfn.lora.gather_merged`` return the dequantized base.
    """

    comm: Comm = "odc"
    balance: Policy = "lb_mini"
    max_tokens_per_microbatch: int | None = None
    options: ScheduleOptions = field(default_factory=ScheduleOptions)
    compute_dtype: torch.dtype | None = None
    max_grad_norm: float | None = None
    cost: CostModel | None = None
    loss: Any = field(default_factory=cross_entropy)
    nonfinite: str = "raise"
    deterministic: bool = False
    remat: bool = False
    donate: bool = False
    staleness: Staleness = 0
    expert_bias_rate: float = 0.0
    offload: Offload | None = None
    gather_format: str | None = None
    push_format: str | None = None
    push_error_feedback: bool = False
    quant_block: int = 128
    quantize_frozen: bool = False

    def __post_init__(self) -> None:
        if self.comm not in ("odc", "collective"):
            raise ValueError(f"StepConfig.comm must be 'odc' or 'collective', got {self.comm!r}")
        policy_info(self.balance)  # a TypeError/ValueError naming a bad policy
        resolve_policy(self.balance, self.comm)  # work stealing cannot serve collectives
        cap = self.max_tokens_per_microbatch
        check_int(cap, "StepConfig.max_tokens_per_microbatch", at_least=1, none_ok=True)
        if self.options is None:
            object.__setattr__(self, "options", ScheduleOptions())
        elif not isinstance(self.options, ScheduleOptions):
            raise TypeError(
                f"StepConfig.options must be a ScheduleOptions, got {type(self.options).__name__}"
            )
        dt = self.compute_dtype
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise TypeError(f"StepConfig.compute_dtype must be a floating torch.dtype or None, got {dt!r}")
        check_number(self.max_grad_norm, "StepConfig.max_grad_norm", positive=True, none_ok=True)
        if self.nonfinite not in ("raise", "skip"):
            raise ValueError(f"StepConfig.nonfinite must be 'raise' or 'skip', got {self.nonfinite!r}")
        if not isinstance(self.remat, bool):
            got = f"{type(self.remat).__name__} {self.remat!r}"
            raise TypeError(f"StepConfig.remat must be a bool (True: every unit), got {got}")
        if self.loss is None:  # the one place None means anything: the default loss
            object.__setattr__(self, "loss", cross_entropy())
        if not isinstance(self.donate, bool):
            raise TypeError(f"StepConfig.donate must be a bool, got {type(self.donate).__name__}")
        if not isinstance(self.deterministic, bool):
            got = type(self.deterministic).__name__
            raise TypeError(f"StepConfig.deterministic must be a bool, got {got}")
        r = self.expert_bias_rate
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < math.inf:
            raise ValueError(f"StepConfig.expert_bias_rate must be a finite number >= 0, got {r!r}")
        check_staleness(self.staleness)
        if self.offload is not None and not isinstance(self.offload, Offload):
            got = type(self.offload).__name__
            raise TypeError(f"StepConfig.offload must be an odcfn.Offload or None, got {got}")
        if self.offload is not None and max_staleness(self.staleness):
            raise ValueError("StepConfig.offload cannot be combined with staleness >= 1 yet: the stale "
                             "step's owners update asynchronously, outside the streamed update")
        # under staleness the order is each rank's own plan order, then rank order, whoever ran
        # which microbatch (the record says which): work stealing keeps it a function of the record
        if (self.deterministic and not max_staleness(self.staleness)
                and isinstance(resolve_policy(self.balance, self.comm), WorkStealing)):
            raise ValueError(
                "StepConfig(deterministic=True) cannot use work stealing: which rank runs which "
                "microbatch is decided at run time, so the summation order is not fixed"
            )
        if isinstance(self.staleness, Mapping):  # a private copy: the caller's dict may change later
            object.__setattr__(self, "staleness", dict(self.staleness))
        if max_staleness(self.staleness) and self.comm != "odc":
            raise ValueError(
                f"StepConfig.staleness={self.staleness!r} needs comm='odc': a collective step makes every "
                "rank meet at every unit, so no rank can run ahead (use staleness=0)"
            )
        check_loss(self.loss)  # a TypeError naming what a non-loss lacks, at construction
        check_wire_config(self)  # an unknown format, fp8 without the dtype, bad combinations
        if self.cost is not None and not callable(self.cost):
            raise TypeError(
                f"StepConfig.cost must be a cost model (length -> cost), got {type(self.cost).__name__}"
            )

    def replace(self, **changes: Any) -> StepConfig:
        return dataclasses.replace(self, **changes)


_MODEL: Any = object()  # TrainState.create(trainable=...) not given: the model's Model.frozen


@dataclass(frozen=True)
class TrainState:
    """This rank's training state. Build it with ``TrainState.create``."""

    params: dict[str, torch.Tensor]  # this rank's flat fp32 shards, one per unit
    opt_state: Any
    step: int
    model: Model
    optimizer: Optimizer
    transport: Transport
    config: StepConfig
    # a mixture of experts' aux-loss-free balancing bias, sparse layers x E, replicated on every
    # rank (``StepConfig.expert_bias_rate``); None: none
    router_bias: torch.Tensor | None = None

    @classmethod
    def create(
        cls,
        *,
        params: Mapping[str, Any],
        model: Model,
        optimizer: Optimizer,
        transport: Transport,
        config: StepConfig | None = None,
        opt_state: Any = None,
        step: int = 0,
        trainable: Any = _MODEL,
        router_bias: torch.Tensor | None = None,
    ) -> TrainState:
        """``params``: this rank's shards (``odcfn.shard``), or the full unsharded params tree,
        which is sharded here for ``transport.mesh``. ``opt_state``: None calls
        ``optimizer.init`` (pass one to resume). ``trainable``: which leaves are trained
        (``odcfn.trainable``: a predicate on leaf names, fnmatch patterns, None for all);
        by default the model's own ``Model.frozen`` (a LoRA model freezes its base). The
        optimizer state covers the trained units only."""
        if not isinstance(model, Model):
            raise TypeError(f"TrainState.create: model must be an odcfn.Model, got {type(model).__name__}")
        if trainable is not _MODEL:
            model = freeze(model, trainable)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"TrainState.create: optimizer must be an odcfn.Optimizer (odcfn.adamw, odcfn.sgd), "
                f"got {type(optimizer).__name__}"
            )
        mesh = getattr(transport, "mesh", None)
        if not isinstance(mesh, Mesh):
            raise TypeError(
                "TrainState.create: transport must be an odcfn transport with a .mesh, "
                f"got {type(transport).__name__}"
            )
        config = StepConfig() if config is None else config
        if not isinstance(config, StepConfig):
            raise TypeError(
                f"TrainState.create: config must be an odcfn.StepConfig, got {type(config).__name__}"
            )
        check_int(step, "TrainState.create: step", at_least=0)
        if not isinstance(params, Mapping):
            raise TypeError(
                f"TrainState.create: params must be a dict keyed by unit name, got {type(params).__name__}"
            )
        if not all(isinstance(v, torch.Tensor) for v in params.values()):
            check_params(model, params)  # the full tree: shard it for this rank
            params = shard(params, model, mesh)
        params = dict(params)
        dt, held = config.compute_dtype, frozen_format(config)
        layout = make_layout(model, mesh)
        check_shards(params, layout, model.dtype, frozen_dtype=dt, frozen_format=held)
        if dt is not None and model.frozen and dt.itemsize < model.dtype.itemsize:
            # a frozen unit is only ever gathered in the compute dtype: keep just that (no master)
            params.update({u.name: params[u.name].to(dt) for u in layout.units
                           if u.frozen and not is_resident(params[u.name], held, u.shard_size)})
        params = keep(params, layout, held)  # quantize_frozen: the base in its gather format alone
        device = next(iter(params.values())).device  # where compute runs (offloaded shards are host views)
        trained = split(model, params)
        if config.offload is not None:  # the fresh state's shapes only: it is built unit by unit
            trained = {k: v.to("meta") for k, v in trained.items()}
        fresh = optimizer.init(trained)
        if opt_state is None and (config.offload is None or not trained):
            opt_state = fresh
        elif opt_state is not None:  # a resumed state from another optimizer or mesh fails here
            check_opt_state(opt_state, fresh)
        if config.offload is not None and trained:  # into the slow tier (odcfn.step.offload_store)
            params, opt_state = place(config.offload, params, list(trained), optimizer.init, opt_state,
                                      dt or model.dtype)
        return cls(params, opt_state, step, model, optimizer, transport, config,
                   _router_bias(model, config, router_bias, device))

    @property
    def mesh(self) -> Mesh:
        return self.transport.mesh

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)


def check_opt_state(given: Any, fresh: Any, where: str = "TrainState.create: opt_state") -> None:
    names, leaves, treedef = tree_flatten_with_path(given)
    want_names, want_leaves, want_def = tree_flatten_with_path(fresh)
    if treedef != want_def:
        raise ValueError(
            f"{where} does not match optimizer.init(params): leaves "
            f"{sorted(set(names) ^ set(want_names))[:8] or names[:8]} differ"
        )
    for name, a, b in zip(names, leaves, want_leaves):
        if isinstance(b, torch.Tensor) and (not isinstance(a, torch.Tensor) or a.shape != b.shape):
            got = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(
                f"{where} leaf {name!r} is {got}, optimizer.init(params) "
                f"gives shape {tuple(b.shape)}"
            )


def donate(state: TrainState) -> None:
    """Mark ``state`` used up: ``train_step`` (``StepConfig(donate=True)``) updated its tensors in
    place for the state it returned."""
    object.__setattr__(state, "_donated_at", state.step)


def check_live(state: TrainState, where: str) -> None:
    """A ValueError if ``state`` was donated to ``train_step`` (its tensors are the next state's)."""
    at = state.__dict__.get("_donated_at")
    if at is not None:
        raise ValueError(
            f"{where}: this TrainState was donated to train_step at step {at} "
            "(StepConfig(donate=True) updates params and optimizer state in place): use the state "
            "train_step returned"
        )


def check_fields(state: TrainState) -> None:
    """The static fields of a state that ``replace`` (or a pytree rebuild) may have changed: a
    TypeError naming the field, before any communication (``create`` checks the same); a
    ValueError for a donated state."""
    check_live(state, "train_step/grad_step/log_probs")
    want = (("model", Model), ("optimizer", Optimizer), ("config", StepConfig))
    for name, cls in want:
        v = getattr(state, name)
        if not isinstance(v, cls):
            raise TypeError(f"TrainState.{name} must be an odcfn.{cls.__name__}, got {type(v).__name__}")
    if not isinstance(getattr(state.transport, "mesh", None), Mesh):
        raise TypeError(
            "TrainState.transport must be an odcfn transport with a .mesh, "
            f"got {type(state.transport).__name__}"
        )


def _router_bias(model: Model, config: StepConfig, given: Any, device: torch.device) -> torch.Tensor | None:
    """The aux-loss-free bias a state starts with: ``given`` (a resumed run's) or zeros."""
    if not config.expert_bias_rate:
        if given is not None:
            raise ValueError("TrainState.create: router_bias given but StepConfig.expert_bias_rate is 0")
        return None
    if model.router is None:
        raise ValueError("StepConfig.expert_bias_rate > 0 needs a mixture of experts (no router here)")
    shape = (model.router.num_layers, model.router.num_experts)
    if given is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    if not isinstance(given, torch.Tensor) or tuple(given.shape) != shape:
        raise ValueError(f"TrainState.create: router_bias must be a tensor of shape {shape} (sparse layers x "
                         f"experts), got {getattr(given, 'shape', type(given).__name__)}")
    return given.to(device, torch.float32)


register_dataclass(
    TrainState, children=("params", "opt_state", "step", "router_bias"),
    static=("model", "optimizer", "transport", "config")
)


@dataclass
class StepMetrics:
    """What ``train_step`` / ``grad_step`` report for one minibatch on one rank."""

    loss: float
    grad_norm: float
    num_samples: int
    num_tokens: int
    num_loss_tokens: int
    step_time: float  # this rank's wall time for the step, sync included
    plan: Plan  # the plan this rank ran (under work stealing: as it was decided)
    counters: Counters  # what the transport did during this step
    events: list[Event] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the loss's own figures

    @property
    def samples_per_s(self) -> float:
        return self.num_samples / self.step_time

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.step_time
