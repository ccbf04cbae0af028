"""Several datasets mixed by weight (``[[data.sources]]``), one minibatch per step as a pure
function of the step, like a single dataset's (``odcfn.data.records.batch_at``).

Step ``s`` takes from each source its share of the run so far: the ``b`` samples of the step
are apportioned among the sources by how far each lags ``w_i * b * (s + 1)`` (``w`` normalised)
after the steps before (largest remainder, ties to the first source). No random numbers are
involved, and after any number of steps every source holds within one sample of its share,
also with small minibatches. Within a source the draws walk its own epochs, each a permutation
seeded by ``(seed, source, epoch)``, so a source's samples are all seen once before any is seen
twice, and a small source is repeated rather than exhausted.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from functools import lru_cache

from odcfn.data.records import epoch_order

__all__ = ["Mixture"]


@lru_cache(maxsize=64)
def _order(n: int, epoch: int, seed: int, shuffle: bool) -> tuple[int, ...]:
    return tuple(epoch_order(n, epoch, seed, shuffle))


class Mixture:
    """Sources of ``sizes`` samples mixed by ``weights`` (> 0; normalised here), ``batch_size``
    samples a step."""

    def __init__(
        self, sizes: Sequence[int], weights: Sequence[float], batch_size: int, *, seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"a mixture needs one weight per source, got {len(sizes)} sizes and "
                             f"{len(weights)} weights")
        if any(n < 1 for n in sizes):
            raise ValueError(f"every mixed source needs samples, got sizes {list(sizes)}")
        if any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be > 0, got {list(weights)}")
        total = float(sum(weights))
        self.sizes, self.weights = tuple(int(n) for n in sizes), tuple(w / total for w in weights)
        self.offsets = tuple(sum(self.sizes[:i]) for i in range(len(self.sizes)))
        self.batch_size, self.seed, self.shuffle = int(batch_size), seed, shuffle
        self._cum = [[0] * len(self.sizes)]  # each source's draws before step s, for s = 0, 1, ...
        self._lock = threading.Lock()  # ranks that are threads share one mixture

    def _extend(self, steps: int) -> None:
        with self._lock:
            b, w = self.batch_size, self.weights
            for s in range(len(self._cum) - 1, steps):
                c = self._cum[-1]
                lag = [w[i] * b * (s + 1) - c[i] for i in range(len(w))]  # sums to b
                take = [max(0, math.floor(x)) for x in lag]
                by_rest = sorted(range(len(w)), key=lambda i: (-(lag[i] - take[i]), i))
                while sum(take) > b:  # only when a source is ahead (negative lag): trim the others
                    i = next(i for i in reversed(by_rest) if take[i] > 0)
                    take[i] -= 1
                for i in by_rest[: b - sum(take)]:
                    take[i] += 1
                self._cum.append([ci + t for ci, t in zip(c, take)])

    def draws(self, step: int) -> list[tuple[int, int]]:
        """``(source, index within the source)`` of step ``step``'s samples."""
        self._extend(step + 1)
        before, after = self._cum[step], self._cum[step + 1]
        out = []
        for i, n in enumerate(self.sizes):
            # each source its own seed stream: mixing in a source does not reorder the others
            seed = self.seed * 1_000_003 + 7919 * (i + 1)
            for j in range(before[i], after[i]):
                epoch, k = divmod(j, n)
                out.append((i, _order(n, epoch, seed, self.shuffle)[k]))
        return out

    def indices(self, step: int) -> list[int]:
        """Step ``step``'s minibatch as indices into the sources' concatenation."""
        return [self.offsets[i] + k for i, k in self.draws(step)]
