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
    # where each sample came from: its 1-based line in a JSONL file, its 0-based row in a
    # parquet file (None: in memory), so that errors found later can still name the data line
    lines: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(self.samples))
        if not self.samples:
            raise ValueError(f"dataset {self.source or '(in memory)'} has no samples")
        if self.lines is not None:
            object.__setattr__(self, "lines", tuple(int(x) for x in self.lines))
            if len(self.lines) != len(self.samples):
                n, m = len(self.lines), len(self.samples)
                raise ValueError(f"dataset {self.source}: {n} lines for {m} samples")

    def where(self, i: int) -> str:
        """Sample ``i``'s origin as ``file:line`` (``file: row r`` for parquet)."""
        if self.lines is None:
            return f"{self.source or 'dataset'}[{i}]"
        if self.source.lower().endswith((".parquet", ".pq")):
            return f"{self.source}: row {self.lines[i]}"
        return f"{self.source}:{self.lines[i]}"

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(s.length for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)
