"""Outcome advantages: one scalar per sample from the rewards of its group, with verl's estimator
names and formulas, and the per-token ``extras["advantages"]`` a ``Sample`` carries.

Samples are grouped contiguously: with ``group_size`` n, group g is rows ``g*n .. g*n+n-1`` (the
order ``Engine.generate`` returns ``n`` completions per prompt in). For group g with rewards r,
mean m, torch's unbiased std s (Bessel: divides by n - 1) and ``epsilon`` e:

- ``grpo``: (r - m) / (s + e); with ``norm_adv_by_std_in_grpo=False`` (Dr. GRPO): r - m.
- ``rloo``: r minus the mean of the group's *other* rewards, = (r - m) * n / (n - 1).
- ``reinforce_plus_plus`` (also ``reinforce_plus_plus_baseline``): r - m, whitened over the batch.
- ``reinforce_plus_plus_no_baseline``: r itself, whitened over the batch.

A naming caution for configs ported from verl: verl calls the group-baseline variant
``reinforce_plus_plus_baseline`` and uses ``reinforce_plus_plus`` for the one without a baseline.
Here ``reinforce_plus_plus`` is the group-baseline form (the one an outcome reward with groups
calls for, and what odcfn's RL loop documents); verl's baseline-free form is
``reinforce_plus_plus_no_baseline``, and ``reinforce_plus_plus_baseline`` keeps verl's meaning.

Whitening is verl's ``masked_whiten`` over the response tokens of the whole batch: a sample's
value counts once per response token, with the Bessel-corrected variance over the token count
N = sum of the response lengths:

    mean = sum_i L_i x_i / N,   var = sum_i L_i (x_i - mean)^2 / (N - 1),
    out_i = (x_i - mean) / sqrt(var + 1e-8)

(verl divides by ``N + 1e-8`` in its means: a guard against N = 0 that float32, verl's dtype,
rounds away for any N >= 1, so it is left out). Means are taken relative to one of the values,
so that a flat group or batch gives exactly 0 rather than rounding noise divided by a tiny
std. Without ``response_lengths`` every sample counts once (L_i = 1): whitening over samples.
Pass the lengths to match verl when they differ. verl's baseline-free ``reinforce_plus_plus``
discounts with ``gamma`` (default 1.0); only gamma = 1 gives every response token the same
value, which is what a per-sample scalar can express.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from odcfn._check import ArgTypeError, check_int, check_number, is_number

__all__ = ["ESTIMATORS", "GROUP_ESTIMATORS", "advantages", "token_advantages"]

# the estimators that compare a sample with the rest of its group
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
ESTIMATORS = (*GROUP_ESTIMATORS, "reinforce_plus_plus_no_baseline")
_WITH_BASELINE = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")

_WHITEN_EPS = 1e-8  # verl's masked_whiten: rsqrt(var + 1e-8)


def _as_vector(x: object, name: str) -> torch.Tensor:
    """``x`` (a 1-D tensor or a sequence of real numbers) as a float64 vector."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one value per sample), got shape {tuple(x.shape)}")
        if x.dtype == torch.bool or x.is_complex():
            raise ArgTypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
        return x.detach().to("cpu", torch.float64)
    if hasattr(x, "__array__") and not isinstance(x, Sequence):  # a numpy array
        return _as_vector(torch.as_tensor(x), name)
    if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
        raise ArgTypeError(f"{name} must be a 1-D tensor or a sequence of numbers, got {type(x).__name__}")
    for i, v in enumerate(x):
        if not is_number(v):
            raise ArgTypeError(f"{name}[{i}] must be a real number, got {type(v).__name__} {v!r}")
    return torch.tensor([float(v) for v in x], dtype=torch.float64)


def _whiten(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    n = weights.sum()
    if n <= 1:
        # verl's masked_var refuses a single response token too: the unbiased variance is 0/0
        raise ValueError(
            "whitening over the batch needs at least 2 response tokens "
            f"(got {int(n)}): give the estimator more samples"
        )
    mean = x[0] + ((x - x[0]) * weights).sum() / n
    var = ((x - mean) ** 2 * weights).sum() / (n - 1)
    return (x - mean) * torch.rsqrt(var + _WHITEN_EPS)


def advantages(
    rewards: torch.Tensor | Sequence[float],
    group_size: int,
    estimator: str = "grpo",
    *,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    response_lengths: torch.Tensor | Sequence[int] | None = None,
    allow_group_of_one: bool = False,
) -> torch.Tensor:
    """One advantage per sample (a float32 vector shaped like ``rewards``); see the module's
    docstring for the formulas.

    ``rewards``: one per sample, groups contiguous. ``group_size``: samples per prompt (the
    engine's ``n``). ``estimator``: one of ``ESTIMATORS``. ``norm_adv_by_std_in_grpo``: ``grpo``
    only; False is Dr. GRPO. ``epsilon``: added to the group std (verl's 1e-6).
    ``response_lengths``: response tokens per sample, for the whitened estimators (verl weights
    each sample by its length); ignored by the others. ``allow_group_of_one``: a group estimator
    refuses ``group_size`` 1 (nothing to compare a sample with) unless this is True, which gives
    verl's rule for a one-sample group: baseline 0 and std 1, so ``grpo`` is r / (1 + epsilon),
    ``rloo`` is r and ``reinforce_plus_plus`` whitens the raw rewards.
    """
    if not isinstance(estimator, str) or estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}: known ones are {', '.join(ESTIMATORS)}")
    n = check_int(group_size, "group_size", at_least=1)
    eps = check_number(epsilon, "epsilon", at_least=0.0)
    for flag, name in ((norm_adv_by_std_in_grpo, "norm_adv_by_std_in_grpo"),
                       (allow_group_of_one, "allow_group_of_one")):
        if not isinstance(flag, bool):
            raise ArgTypeError(f"{name} must be a bool, got {type(flag).__name__} {flag!r}")
    if n < 2 and estimator in GROUP_ESTIMATORS and not allow_group_of_one:
        raise ValueError(
            f"estimator {estimator!r} compares each sample with its group, so group_size (the "
            f"engine's n) must be >= 2, got {n}"
        )
    r = _as_vector(rewards, "rewards")
    if r.numel() == 0:
        raise ValueError("rewards is empty: advantages need at least one group")
    if r.numel() % n:
        raise ValueError(
            f"{r.numel()} rewards do not divide into groups of group_size={n} "
            f"({r.numel() // n} full groups and {r.numel() % n} left over)"
        )
    bad = (~torch.isfinite(r)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(
            f"rewards[{i}] is {r[i].item()} (sample {i % n} of group {i // n}): rewards must be finite"
        )

    groups = r.view(-1, n)
    if n == 1:  # verl's one-sample group: baseline 0, std 1
        mean, std = torch.zeros_like(groups), torch.ones_like(groups)
    else:
        mean = groups[:, :1] + (groups - groups[:, :1]).mean(dim=1, keepdim=True)
        std = groups.std(dim=1, keepdim=True)  # unbiased, as torch.std (and verl) default to

    if estimator == "grpo":
        out = (groups - mean) / (std + eps) if norm_adv_by_std_in_grpo else groups - mean
    elif estimator == "rloo":
        out = (groups - mean) * (n / (n - 1)) if n > 1 else groups.clone()
    else:
        x = (groups - mean if estimator in _WITH_BASELINE else groups).reshape(-1)
        w = torch.ones_like(x) if response_lengths is None else _lengths(response_lengths, x.numel())
        out = _whiten(x, w)
    return out.reshape(-1).to(torch.float32)


def _lengths(lengths: torch.Tensor | Sequence[int], count: int) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ArgTypeError(f"response_lengths must be a 1-D integer tensor, got {lengths!r:.80}")
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Sequence):
        raise ArgTypeError(f"response_lengths must be a sequence of ints, got {type(lengths).__name__}")
    if len(lengths) != count:
        raise ValueError(f"response_lengths has {len(lengths)} entries for {count} rewards: one per sample")
    for i, v in enumerate(lengths):
        check_int(v, f"response_lengths[{i}]", at_least=1)
    return torch.tensor([float(v) for v in lengths], dtype=torch.float64)


def token_advantages(
    advantages: torch.Tensor | Sequence[float],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
) -> list[torch.Tensor]:
    """Each sample's scalar advantage as its per-token ``extras["advantages"]``: a float32 tensor
    of length prompt + response, aligned as ``odcfn.Sample``'s float extras (row t belongs to
    token t as a prediction target), so the prompt's rows are 0 and every response token's row
    holds the sample's advantage."""
    adv = _as_vector(advantages, "advantages")
    for name, seq in (("prompt_lengths", prompt_lengths), ("response_lengths", response_lengths)):
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
            raise ArgTypeError(f"{name} must be a sequence of ints, got {type(seq).__name__}")
        if len(seq) != adv.numel():
            raise ValueError(f"{name} has {len(seq)} entries for {adv.numel()} advantages: one per sample")
    out = []
    for i, (a, p, n) in enumerate(zip(adv.tolist(), prompt_lengths, response_lengths)):
        p = check_int(p, f"prompt_lengths[{i}]", at_least=1)
        n = check_int(n, f"response_lengths[{i}]", at_least=1)
        if not math.isfinite(a):
            raise ValueError(f"advantages[{i}] is {a}: advantages must be finite")
        row = torch.zeros(p + n, dtype=torch.float32)
        row[p:] = a
        out.append(row)
    return out
