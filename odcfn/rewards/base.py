"""What a reward function is, and ``score``: the one place rewards are computed and checked.

A reward function is ``fn(prompt, completion) -> float``: ``prompt`` an ``odcfn.rl.Prompt``
(``fields`` holds the dataset row's other columns, e.g. the ground truth) and ``completion`` an
``odcfn.rollout.Completion`` (``text`` set when the engine knows a tokenizer). A *batched* reward
(``@batched``, or any callable with a true ``batched`` attribute) is called as
``fn(prompts, completions) -> sequence of floats`` with two lists of equal length, ``prompts[k]``
being the prompt of ``completions[k]``: the form for a reward model or anything with a per-call
cost.

``score`` never turns a failure into a number: a reward that raises, or returns something that
is not a finite real number, is a ``RewardError`` naming the completion, its prompt (index and
text) and the reward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from numbers import Real
from typing import Any

import torch

from odcfn._check import ArgTypeError, check_int
from odcfn.data.prompt import Prompt
from odcfn.rollout.base import Completion

__all__ = [
    "GROUND_TRUTH_KEYS",
    "MissingTextError",
    "RewardError",
    "batched",
    "completion_text",
    "field",
    "ground_truth",
    "is_batched",
    "reward_name",
    "score",
]

# where a row keeps its reference answer: TRL-style datasets use ``answer``, verl's
# ``reward_model: {"ground_truth": ...}``
GROUND_TRUTH_KEYS = ("answer", "reward_model.ground_truth")

_MISSING = object()


class RewardError(ValueError):
    """A reward function failed on (or returned a bad value for) a completion; the message names
    the completion, its prompt and the reward, and the original exception is the ``__cause__``."""


class MissingTextError(ValueError):
    """A reward needs a completion's text but the engine gave none (it knows no tokenizer)."""


BatchedFn = Callable[[list[Prompt], list[Completion]], Sequence[float]]


def batched(fn: BatchedFn) -> BatchedFn:
    """Mark ``fn(prompts, completions) -> floats`` as a batched reward (a decorator). The
    returned callable calls ``fn`` unchanged and keeps its name and docstring."""
    if not callable(fn):
        raise ArgTypeError(f"batched() needs a callable, got {type(fn).__name__} {fn!r:.80}")

    @functools.wraps(fn)
    def wrapper(prompts: list[Prompt], completions: list[Completion]) -> Sequence[float]:
        return fn(prompts, completions)

    wrapper.batched = True  # type: ignore[attr-defined]
    return wrapper


def is_batched(fn: Any) -> bool:
    """Whether ``score`` calls ``fn`` on lists (``@batched``, or a ``batched = True`` attribute)."""
    return getattr(fn, "batched", False) is True


def reward_name(fn: Any) -> str:
    """A readable name for error messages: the function's qualified name, or the object's type."""
    if isinstance(fn, functools.partial):
        return f"partial({reward_name(fn.func)})"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def field(fields: Mapping[str, Any], key: str, default: Any = _MISSING) -> Any:
    """``fields[key]``, where a dotted ``key`` also reads nested mappings: ``"reward_model.ground_truth"``
    finds ``fields["reward_model.ground_truth"]`` (a flattened column, tried first) or
    ``fields["reward_model"]["ground_truth"]``. A ``KeyError`` naming the key and the fields
    present when it is missing and no ``default`` is given."""
    if key in fields:
        return fields[key]
    node: Any = fields
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            if default is not _MISSING:
                return default
            raise KeyError(f"the row has no field {key!r} (its fields: {sorted(fields)})")
        node = node[part]
    return node


def ground_truth(prompt: Prompt, key: str | None = None) -> Any:
    """The reference answer of ``prompt``'s row: ``fields[key]`` when ``key`` is given, else the
    first of ``GROUND_TRUTH_KEYS`` present (``answer``, then verl's
    ``reward_model.ground_truth``, nested or as a dotted column). A ``KeyError`` naming the keys
    tried when there is none."""
    if not isinstance(prompt, Prompt):
        raise ArgTypeError(f"prompt must be an odcfn.rl.Prompt, got {type(prompt).__name__}")
    keys = (key,) if key is not None else GROUND_TRUTH_KEYS
    for k in keys:
        v = field(prompt.fields, k, None)
        if v is not None:
            return v
    raise KeyError(
        f"the prompt's row has no ground truth under {' or '.join(map(repr, keys))} "
        f"(its fields: {sorted(prompt.fields)})"
    )


def completion_text(completion: Completion) -> str:
    """``completion.text``, or a ``MissingTextError`` when the engine decoded none."""
    text = getattr(completion, "text", None)
    if text is None:
        raise MissingTextError(
            "this reward reads the completion's text, but the completion has none: the engine "
            "knows no tokenizer. Give the engine one, or pass score(..., decode=tokenizer.decode)"
        )
    if not isinstance(text, str):
        raise ArgTypeError(f"Completion.text must be a str, got {type(text).__name__}")
    return text


def _describe(j: int, i: int, prompts: Sequence[Prompt]) -> str:
    text = prompts[i].text
    shown = f" {text!r:.120}" if text is not None else ""
    return f"completion {j} (of prompt {i}{shown})"


def _as_reward(v: Any) -> float | None:
    """``v`` as a float if it is a finite real number (a 0-d / one-element numeric tensor
    included), else None. A bool is refused: ``x == y`` is usually a forgotten ``float(...)``,
    and the house rule is that a bool is never a number."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1 or v.dtype == torch.bool or v.is_complex():
            return None
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, Real):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def score(
    reward_fn: Callable[..., Any],
    prompts: Sequence[Prompt],
    completions: Sequence[Completion],
    *,
    prompt_indices: Sequence[int] | None = None,
    decode: Callable[[list[int]], str] | None = None,
    batch_size: int | None = None,
    first_completion: int = 0,
) -> torch.Tensor:
    """The reward of every completion: a float32 vector, one entry per completion, in order.

    ``prompts``: the prompts the completions answer. ``prompt_indices``: the prompt of each
    completion (default: each completion's own ``prompt_index``). ``decode``: token ids -> text,
    used to fill in a completion's missing ``text`` (e.g. ``tokenizer.decode``). ``batch_size``:
    completions per call of a batched reward (default: all in one call). ``first_completion``:
    the position of ``completions[0]`` in a larger rollout, used only to name a bad completion.

    Any exception the reward raises, and any return that is not a finite real number, is a
    ``RewardError`` naming the completion, its prompt and the reward; never a silent 0.
    """
    if not callable(reward_fn):
        raise ArgTypeError(f"reward_fn must be callable, got {type(reward_fn).__name__} {reward_fn!r:.80}")
    for name, seq in (("prompts", prompts), ("completions", completions)):
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence):
            raise ArgTypeError(f"{name} must be a list, got {type(seq).__name__}")
    for i, p in enumerate(prompts):
        if not isinstance(p, Prompt):
            raise ArgTypeError(f"prompts[{i}] must be an odcfn.rl.Prompt, got {type(p).__name__}")
    comps = list(completions)
    for j, c in enumerate(comps):
        if not isinstance(c, Completion):
            raise ArgTypeError(
                f"completions[{j}] must be an odcfn.rollout.Completion, got {type(c).__name__}"
            )
        if c.text is None and decode is not None:
            text = decode(c.tokens.tolist())
            if not isinstance(text, str):
                raise ArgTypeError(f"decode must return a str, got {type(text).__name__} for completion {j}")
            comps[j] = replace(c, text=text)
    if prompt_indices is None:
        idx = [c.prompt_index for c in comps]
    else:
        if isinstance(prompt_indices, (str, bytes)) or not isinstance(prompt_indices, Sequence):
            raise ArgTypeError(
                f"prompt_indices must be a sequence of ints, got {type(prompt_indices).__name__}"
            )
        if len(prompt_indices) != len(comps):
            raise ValueError(
                f"prompt_indices has {len(prompt_indices)} entries for {len(comps)} completions: one each"
            )
        idx = [check_int(i, f"prompt_indices[{j}]", at_least=0) for j, i in enumerate(prompt_indices)]
    for j, i in enumerate(idx):
        if i >= len(prompts):
            raise ValueError(
                f"completion {j} belongs to prompt {i}, but there are only {len(prompts)} prompts"
            )
    check_int(batch_size, "batch_size", at_least=1, none_ok=True)

    name = reward_name(reward_fn)
    out: list[float] = []
    if not is_batched(reward_fn):
        for j, (c, i) in enumerate(zip(comps, idx)):
            try:
                v = reward_fn(prompts[i], c)
            except Exception as e:
                where = _describe(first_completion + j, i, prompts)
                raise RewardError(f"reward {name} raised on {where}: {type(e).__name__}: {e}") from e
            r = _as_reward(v)
            if r is None:
                where = _describe(first_completion + j, i, prompts)
                raise RewardError(f"reward {name} returned {v!r:.80} for {where}: a reward must be a finite "
                                  "real number (float)")
            out.append(r)
        return torch.tensor(out, dtype=torch.float32)

    step = batch_size or max(len(comps), 1)
    for a in range(0, len(comps), step):
        b = min(a + step, len(comps))
        span = f"completions {a}..{b - 1} (prompts {sorted(set(idx[a:b]))})"
        try:
            vs = reward_fn([prompts[i] for i in idx[a:b]], comps[a:b])
        except Exception as e:
            raise RewardError(f"batched reward {name} raised on {span}: {type(e).__name__}: {e}") from e
        if isinstance(vs, torch.Tensor):
            vs = vs.reshape(-1).tolist() if vs.dim() <= 1 else vs
        if isinstance(vs, (str, bytes, Mapping)) or not hasattr(vs, "__len__") or not hasattr(vs, "__iter__"):
            raise RewardError(
                f"batched reward {name} returned {type(vs).__name__} for {span}: it must return one "
                "float per completion (a list)"
            )
        vs = list(vs)
        if len(vs) != b - a:
            raise RewardError(
                f"batched reward {name} returned {len(vs)} values for {b - a} completions ({span})"
            )
        for k, v in enumerate(vs):
            r = _as_reward(v)
            if r is None:
                where = _describe(first_completion + a + k, idx[a + k], prompts)
                raise RewardError(
                    f"batched reward {name} returned {v!r:.80} for {where}: "
                    "a reward must be a finite real number (float)"
                )
            out.append(r)
    return torch.tensor(out, dtype=torch.float32)
