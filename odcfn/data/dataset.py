"""A dataset of token-id samples, in memory: what ``odcfn.data.records`` and ``odcfn.data.chat`` read
files into."""

from __future__ import annotations

from dataclasses import dataclass

from odcfn.batch import Sample

__all__ = ["TokenDataset"]


@dataclass(frozen=True)
class TokenDataset:
    samples: tuple[Sample, ...]
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        if not self.samples:
            raise ValueError(f"dataset {self.source or '(in memory)'} has no samples")

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(s.length for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)
