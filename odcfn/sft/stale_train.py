"""``odcfn train`` under bounded staleness (``[train] staleness``, docs/staleness.md).

Three things differ from the synchronous loop; the config lives here, the metrics lines and
consistent points in ``odcfn.sft.steplog``, so that the loop reads the same either way:

- **The config.** ``train.staleness`` is an int τ >= 0 or a table ``{unit pattern = τ}``
  (``StepConfig.staleness``). What ``odcfn.step.stale.check`` refuses at the first step is
  refused here when the file is read, naming the keys: a user learns it before any rank starts,
  from one line that says which key to change. A pattern that matches no unit needs the model,
  so ``check_model`` runs where the model is known (``config.check_inputs``, the launcher and
  each rank's setup), still before any communication.
- **The metrics lines.** A stale step's loss arrives late (``metrics.extra["reports"]``): the
  line of step ``k`` is held until its figures are complete and then written with them, so
  ``metrics.jsonl`` still has one line per step, in order, each with its own loss.
- **Consistent points.** The state a stale step returns may trail ``state.step`` by up to
  τ + 1 updates on some owner. Before every checkpoint (disk or memory tier, and so at the last
  step, which is always saved) every rank calls ``stale.drain``: the saved params are exactly
  ``state.step`` updates, so a resume (or a restart after a killed rank) continues from a
  consistent version, and the version ring restarts at the resumed step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["active", "check_config", "check_model", "check_train"]

# [train] keys that odcfn.step.stale.check refuses next to τ >= 1, with why (the same reasons)
_REFUSED = (
    ("max_grad_norm", lambda t: t.max_grad_norm is not None,
     "clipping by the global norm makes every owner wait for every other owner's gradient before "
     "its update (a global barrier per step); unset it or use staleness = 0"),
    ("comm", lambda t: t.comm == "collective",
     "a collective step makes every rank meet at every unit, so no rank can run ahead; use comm = \"odc\""),
    ("expert_bias_rate", lambda t: bool(t.expert_bias_rate),
     "the bias update needs the minibatch's summed expert loads, which no rank waits for under "
     "staleness; use expert_bias_rate = 0"),
    ("task", lambda t: t.task == "dpo", "preference pairs do not run stale yet; use task = \"sft\""),
)


def _max_tau(value: Any) -> int:
    return max(value.values()) if isinstance(value, Mapping) else int(value)


def active(train: Any) -> bool:
    """Whether the ``[train]`` section asks for bounded staleness (some unit with τ >= 1)."""
    return _max_tau(train.staleness) > 0


def check_train(t: Any) -> None:
    """``train.staleness``'s table entries and the ``[train]`` keys it cannot be combined with: a
    ``ValueError`` naming them (the type of a plain value is checked by ``keys.check_key``)."""
    value = t.staleness
    if isinstance(value, Mapping):
        if not value:
            raise ValueError("config: train.staleness must be an integer >= 0 or a table of unit patterns "
                             "to integers >= 0, got an empty table (it names no unit)")
        for pattern, tau in value.items():
            # bool is an int to Python: true would silently mean τ = 1
            if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
                raise ValueError(f"config: train.staleness[{pattern!r}] must be an integer >= 0 "
                                 f"(0: synchronous), got {type(tau).__name__} {tau!r}")
    if not active(t):
        return
    for key, refused, why in _REFUSED:
        if refused(t):
            raise ValueError(f"config: train.staleness = {value!r} cannot be combined with "
                             f"train.{key} = {getattr(t, key)!r}: {why}")


def check_config(cfg: Any) -> None:
    """What ``train.staleness`` asks of the other sections."""
    if active(cfg.train) and cfg.data.skip_empty_minibatches:
        # a skipped step advances the step without an update, but a stale owner's version ring
        # counts every step it applies: the two would no longer agree
        raise ValueError(f"config: train.staleness = {cfg.train.staleness!r} cannot be combined with "
                         "data.skip_empty_minibatches = true (a step without an update has no version); "
                         "use staleness = 0 or leave the minibatches without loss tokens out of the data")


def check_model(cfg: Any, model: Any) -> None:
    """The keys that need the model: every ``train.staleness`` pattern matches a unit, and
    ``train.expert_bias_rate`` > 0 has routers to bias. Before any communication."""
    import fnmatch

    t, units = cfg.train, list(model.unit_names)
    if isinstance(t.staleness, Mapping):
        for pattern in t.staleness:
            if pattern not in units and not fnmatch.filter(units, pattern):
                shown = ", ".join(units[:8]) + (f", ... ({len(units)} units)" if len(units) > 8 else "")
                raise ValueError(f"config: train.staleness[{pattern!r}] matches no unit of the model "
                                 f"(units: {shown}); a pattern is an fnmatch pattern over unit names")
    if t.expert_bias_rate and model.router is None:
        raise ValueError(f"config: train.expert_bias_rate = {t.expert_bias_rate!r} needs a mixture of "
                         "experts (a model.hf_path of a Qwen3-MoE / Qwen2-MoE checkpoint); this model is "
                         "dense: use expert_bias_rate = 0")
