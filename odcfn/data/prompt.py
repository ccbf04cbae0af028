"""A prompt of an RL dataset (``odcfn.rl.Prompt``): its token ids, its text when known, and the
row's other fields (the ground truth a reward reads, for example). It lives with the data, below
the readers that make it, the engines, the rewards and the loop that read it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from odcfn._check import is_int

__all__ = ["Prompt"]


@dataclass(frozen=True)
class Prompt:
    """``tokens``: the prompt's token ids (stored as a tuple of ints; a list or a 1-D integer
    tensor is accepted). ``text``: the prompt as text, when a tokenizer made it. ``fields``: the
    dataset row's other fields (e.g. ``{"answer": "42"}``), read-only."""

    tokens: tuple[int, ...]
    text: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.tokens
        if isinstance(t, torch.Tensor):
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise TypeError(f"Prompt.tokens must be a 1-D integer tensor or a list of ints, got {t!r}")
            t = t.tolist()
        if isinstance(t, (str, bytes)) or not isinstance(t, Sequence) or not all(is_int(x) for x in t):
            raise TypeError(f"Prompt.tokens must be a list of token ids (ints), got {t!r:.80}")
        if not t:
            raise ValueError("Prompt.tokens is empty: a prompt needs at least one token")
        if any(x < 0 for x in t):
            raise ValueError(f"Prompt.tokens holds a negative id: {min(t)}")
        object.__setattr__(self, "tokens", tuple(int(x) for x in t))
        if self.text is not None and not isinstance(self.text, str):
            raise TypeError(f"Prompt.text must be a str or None, got {type(self.text).__name__}")
        if not isinstance(self.fields, Mapping):
            raise TypeError(f"Prompt.fields must be a mapping, got {type(self.fields).__name__}")
        object.__setattr__(self, "fields", dict(self.fields))  # a copy: picklable, unshared

    def __len__(self) -> int:
        return len(self.tokens)
