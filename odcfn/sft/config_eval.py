"""``odcfn train``'s ``[eval]`` section: the held-out evaluation during training
(``odcfn.sft.evaluate``), and the checks that tie it to ``[data]`` and ``[train]``. Its own
module so that ``odcfn.sft.config`` stays one screenful per concern; ``config`` imports it,
never the reverse."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from odcfn.sft.keys import check_key

__all__ = ["EvalSection", "check_eval"]


@dataclass(frozen=True)
class EvalSection:
    """``[eval]``: the held-out loss every ``every`` steps (0: never)."""

    every: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            check_key("eval", f.name, getattr(self, f.name), f.type)


def check_eval(cfg: Any) -> None:
    """What ``eval.every`` needs: a held-out set (``data.eval_path``), a task that has one, and a
    synchronous run (the evaluation reads one version of the params on every owner)."""
    every = cfg.eval.every
    if not every:
        return
    if cfg.data.eval_path is None:
        raise ValueError(f"config: eval.every = {every} needs data.eval_path (the held-out set to "
                         "evaluate); give one, or set eval.every = 0")
    from odcfn.step.stale_config import max_staleness

    if max_staleness(cfg.train.staleness):
        raise ValueError(f"config: eval.every = {every} cannot be combined with train.staleness >= 1 yet "
                         "(the evaluation needs the params of one step on every owner); set "
                         "eval.every = 0 or train.staleness = 0")
