"""``odcfn train``'s ``[dpo]`` section (``train.task = "dpo"``): the preference loss's keys, and
the checks that tie them to the rest of the config. Its own module so that ``odcfn.sft.config``
stays one screenful per concern; ``config`` imports it, never the reverse."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from odcfn.sft.keys import check_key

__all__ = ["DpoSection", "check_task", "dpo_loss"]


@dataclass(frozen=True)
class DpoSection:
    """``[dpo]``: ``odcfn.losses.dpo``'s settings, with TRL's names and defaults."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    reference_free: bool = False
    simpo_gamma: float = 0.5
    sft_weight: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            check_key("dpo", f.name, getattr(self, f.name), f.type)
        if self.loss_type == "robust" and self.label_smoothing >= 0.5:  # robust divides by 1 - 2 ls
            raise ValueError(f"config: dpo.label_smoothing must be < 0.5 with dpo.loss_type = \"robust\", "
                             f"got {self.label_smoothing!r}")

    @property
    def uses_reference(self) -> bool:
        """Whether the loss reads reference log-probs (else no reference pass runs)."""
        return not (self.reference_free or self.loss_type == "simpo")


def check_task(cfg: Any) -> None:
    """What ``train.task`` asks of the other sections: a preference run reads its pairs through a
    tokenizer and cannot truncate an answer (that would change what is preferred); an SFT run
    with a ``[dpo]`` key set would silently ignore it."""
    d, p = cfg.data, cfg.dpo
    if cfg.train.task != "dpo":  # sft, or rl (its own checks: odcfn.sft.config_rl)
        changed = [f.name for f in fields(p) if getattr(p, f.name) != f.default]
        if changed:
            raise ValueError(f"config: dpo.{changed[0]} is set but train.task is \"{cfg.train.task}\", which "
                             "ignores [dpo]; set train.task = \"dpo\" for preference optimization")
        return
    if d.tokenizer is None:
        raise ValueError("config: train.task = \"dpo\" needs data.tokenizer (a local tokenizer directory: "
                         "data.path's prompt/chosen/rejected text is tokenized with it)")
    if d.long_samples == "truncate":
        raise ValueError("config: data.long_samples = \"truncate\" cannot serve train.task = \"dpo\" (a cut "
                         "answer is not the answer that was preferred); use \"error\" or \"drop\"")


def dpo_loss(cfg: Any) -> Any:
    """The run's loss for ``StepConfig(loss=...)``: None (cross-entropy) for SFT."""
    if cfg.train.task != "dpo":
        return None
    import odcfn

    p = cfg.dpo
    return odcfn.losses.dpo(beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing,
                            reference_free=p.reference_free, simpo_gamma=p.simpo_gamma,
                            sft_weight=p.sft_weight)
