"""The RL iteration's figures, under the names users already read in verl's dashboards
(``critic/score/mean``, ``response_length/clip_ratio``, ``timing_s/gen``, ``perf/throughput``),
and the one-line progress report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RLMetrics", "logprob_diff", "progress_line", "rollout_metrics", "summary", "update_metrics"]


@dataclass(frozen=True)
class RLMetrics:
    """One iteration: ``extra`` (name -> float, verl's names), the ``train_step`` metrics of its
    updates, and every completion's reward (penalties included) in rollout order."""

    extra: dict[str, float] = field(default_factory=dict)
    updates: tuple[Any, ...] = ()
    rewards: torch.Tensor | None = None

    @property
    def reward_mean(self) -> float:
        return self.extra["critic/score/mean"]


def summary(name: str, x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    return {f"{name}/mean": float(x.mean()), f"{name}/max": float(x.max()), f"{name}/min": float(x.min())}


def rollout_metrics(prompts: Sequence[Any], shared: Sequence[Any], rewards: torch.Tensor,
                    penalties: torch.Tensor, config: Any, step: int, world_size: int) -> dict[str, float]:
    n = config.group_size
    resp = torch.tensor([s.tokens.numel() for s in shared], dtype=torch.float64)
    prompt = torch.tensor([len(prompts[i // n]) for i in range(len(shared))], dtype=torch.float64)
    out = {**summary("critic/score", torch.tensor([s.reward for s in shared])),
           **summary("critic/rewards", rewards), **summary("response_length", resp),
           **summary("prompt_length", prompt)}
    out["response_length/clip_ratio"] = float(sum(not s.stopped for s in shared)) / len(shared)
    out["critic/overlong_penalty/mean"] = float(penalties.mean())
    lag = torch.tensor([step - s.version for s in shared], dtype=torch.float64)
    out["rollout/staleness/mean"], out["rollout/staleness/max"] = float(lag.mean()), float(lag.max())
    out["perf/total_num_tokens"] = float(resp.sum() + prompt.sum())
    return out


def logprob_diff(trainer: Sequence[torch.Tensor], engine: Sequence[torch.Tensor],
                 samples: Sequence[Any]) -> dict[str, float]:
    """|trainer - engine| log-prob over the response tokens: how far the engine's numerics (or,
    asynchronously, its weights) are from the trainer's."""
    d = torch.cat([(t - e).abs()[s.loss_mask] for t, e, s in zip(trainer, engine, samples)]).double()
    if not d.numel():
        return {}
    return {"rollout/logprob_diff/mean": float(d.mean()), "rollout/logprob_diff/max": float(d.max())}


def update_metrics(updates: Sequence[Any]) -> dict[str, float]:
    """The actor's figures averaged over the iteration's ``train_step`` calls (verl's
    ``actor/`` names; the policy-gradient loss's own figures keep their names under it). Under
    bounded staleness a step's loss arrives late (NaN in its own metrics): such values are left
    out of the means, and a figure with none is left out."""
    out: dict[str, float] = {"actor/num_updates": float(len(updates))}
    values: dict[str, list[float]] = {"actor/loss": [m.loss for m in updates],
                                      "actor/grad_norm": [m.grad_norm for m in updates]}
    for m in updates:
        for k, v in m.extra.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                values.setdefault(f"actor/{k}", []).append(float(v))
    for k, vs in values.items():
        finite = [v for v in vs if math.isfinite(v)]
        if finite:
            out[k] = sum(finite) / len(finite)
    return out


def progress_line(it: int, total: int | None, m: dict[str, float], elapsed: float) -> str:
    """``iter 3/50  reward 0.42  resp 31.0 tok  gen 1.2s upd 0.8s sync 0.0s  ETA 1m05s``."""
    eta = ""
    if total and it:
        left = elapsed / it * (total - it)
        eta = f"  ETA {int(left // 60)}m{int(left % 60):02d}s"
    t = lambda k: m.get(f"timing_s/{k}", 0.0)
    return (f"iter {it}{f'/{total}' if total else ''}  reward {m['critic/score/mean']:.3f}  "
            f"resp {m['response_length/mean']:.1f} tok  gen {t('gen'):.1f}s upd {t('update_actor'):.1f}s "
            f"sync {t('weight_sync'):.1f}s{eta}")
