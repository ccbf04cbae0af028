"""Synthetic sample-length samplers shaped like the paper's datasets.

Each sampler is deterministic in ``seed`` (pure-Python ``random.Random``, identical on every
platform) and returns a tuple of ints. The target statistics come from the ODC paper
("Revisiting Parameter Server in LLM Post-Training", ICLR 2026) as summarised in this project's
issue 4; the distribution *shapes* (log-normal bodies, truncation rules, the RL correctness mix)
are our assumptions, chosen to hit those statistics, and are documented in docs/simulation.md.

- ``longalign``: LongAlign long-context SFT. Paper: 8K-64K tokens, mean ~16.5K, long tail.
  Ours: 8192 + LogNormal(mu=8.6, sigma=1.0), resampled above 65536. Mean ~16.5K.
- ``swe_smith``: SWE-smith agent trajectories (SFT). Paper: mean ~34.7K.
  Ours: LogNormal(mu=10.3, sigma=0.6) resampled outside [2048, 131072]. Mean ~34.7K.
- ``aime_rl``: RL rollouts on AIME-style maths. Paper: mean ~9K; wrong answers ~3x longer than
  correct ones; a spike of truncated responses at the generation cap.
  Ours: prompt ~ U[100, 400] tokens; half the responses correct, LogNormal(mu=8.32, sigma=0.5),
  the other half wrong with a 3x larger median; responses clipped at 20480 tokens (the spike).
  Mean ~9K.

``scale`` shrinks every length (for CPU runs of the real runtime; DESIGN.md uses 1/16).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DATASETS", "Dataset", "aime_rl", "get_dataset", "longalign", "swe_smith"]


def _check(n: int, scale: float) -> None:
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"number of samples must be an int >= 0, got {n!r}")
    if not (isinstance(scale, (int, float)) and 0 < scale <= 1):
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")


def _scaled(x: float, scale: float) -> int:
    return max(1, int(round(x * scale)))


def _lognormal_in(rng: random.Random, mu: float, sigma: float, lo: float, hi: float) -> float:
    while True:  # rejection keeps the body's shape (no spike at the bounds)
        x = rng.lognormvariate(mu, sigma)
        if lo <= x <= hi:
            return x


LONGALIGN_MIN, LONGALIGN_MAX = 8192, 65536
SWE_MIN, SWE_MAX = 2048, 131072
AIME_RESPONSE_CAP = 20480


def longalign(n: int, *, seed: int = 0, scale: float = 1.0) -> tuple[int, ...]:
    """LongAlign-like SFT lengths: 8K-64K tokens, mean ~16.5K, long right tail."""
    _check(n, scale)
    rng = random.Random(f"longalign/{seed}")
    tail = LONGALIGN_MAX - LONGALIGN_MIN
    return tuple(_scaled(LONGALIGN_MIN + _lognormal_in(rng, 8.6, 1.0, 0.0, tail), scale) for _ in range(n))


def swe_smith(n: int, *, seed: int = 0, scale: float = 1.0) -> tuple[int, ...]:
    """SWE-smith-like agent-trajectory lengths: mean ~34.7K, 2K-128K."""
    _check(n, scale)
    rng = random.Random(f"swe_smith/{seed}")
    return tuple(_scaled(_lognormal_in(rng, 10.3, 0.6, SWE_MIN, SWE_MAX), scale) for _ in range(n))


def aime_rl(n: int, *, seed: int = 0, scale: float = 1.0, p_correct: float = 0.5) -> tuple[int, ...]:
    """AIME-RL-like rollout lengths (prompt + response): mean ~9K, wrong answers ~3x longer than
    correct ones, truncated responses piling up at the 20480-token cap."""
    _check(n, scale)
    if not 0 <= p_correct <= 1:
        raise ValueError(f"p_correct must be in [0, 1], got {p_correct!r}")
    rng = random.Random(f"aime_rl/{seed}")
    out = []
    for _ in range(n):
        prompt = rng.randint(100, 400)
        mu = 8.32 if rng.random() < p_correct else 8.32 + math.log(3.0)
        response = min(rng.lognormvariate(mu, 0.5), AIME_RESPONSE_CAP)
        out.append(_scaled(prompt + response, scale))
    return tuple(out)


@dataclass(frozen=True)
class Dataset:
    name: str
    sample: Callable[..., tuple[int, ...]]  # (n, *, seed, scale) -> lengths
    max_tokens: int  # the longest sample it can produce: the natural microbatch token cap
    paper_mean: float  # the paper's reported mean length (tokens)


DATASETS: dict[str, Dataset] = {
    "longalign": Dataset("longalign", longalign, LONGALIGN_MAX, 16.5e3),
    "swe-smith": Dataset("swe-smith", swe_smith, SWE_MAX, 34.7e3),
    "aime-rl": Dataset("aime-rl", aime_rl, AIME_RESPONSE_CAP + 400, 9.0e3),
}


def get_dataset(name: str) -> Dataset:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(DATASETS)}") from None
