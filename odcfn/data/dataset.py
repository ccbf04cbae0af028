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
    # a dataset read from several files (a folder of shards, a mixture): (index of its first
    # sample, file) for each file, in order; ``lines`` are then per file
    files: tuple[tuple[int, str], ...] | None = None

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
        if self.files:  # as odcfn.data.sources.row_where names rows (not imported: it reads records)
            file, line = self.origin(i)  # type: ignore[misc]
            jsonl = str(file).lower().endswith((".jsonl", ".json"))
            return f"{file}:{line}" if jsonl else f"{file}: row {line}"
        if self.source.lower().endswith((".parquet", ".pq")):
            return f"{self.source}: row {self.lines[i]}"
        return f"{self.source}:{self.lines[i]}"

    def origin(self, i: int) -> tuple[str, int] | None:
        """Sample ``i``'s ``(file, line or row)``; None for a dataset made in memory."""
        if self.lines is None:
            return None
        if not self.files:
            return self.source, self.lines[i]
        import bisect

        k = bisect.bisect_right([start for start, _ in self.files], i) - 1
        return self.files[max(k, 0)][1], self.lines[i]

    @classmethod
    def from_origins(
        cls, samples: tuple[Sample, ...], source: str, origins: list[tuple[str, int] | None]
    ) -> TokenDataset:
        """A dataset whose sample ``i`` came from ``origins[i]`` (``origin``'s values): what a
        selection or a concatenation of datasets keeps of where its samples came from."""
        if any(o is None for o in origins):
            return cls(tuple(samples), source)
        files: list[tuple[int, str]] = []
        for i, (file, _) in enumerate(origins):  # type: ignore[misc]
            if not files or files[-1][1] != file:
                files.append((i, file))
        return cls(tuple(samples), source, tuple(line for _, line in origins), tuple(files))  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(s.length for s in self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)
