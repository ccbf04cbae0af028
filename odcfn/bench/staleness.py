"""Bounded staleness side by side: samples/s of τ = 0, 1, 2 with a noisy neighbour.

W in-process ranks (``LocalWorld`` threads) train the same model on the same minibatches; on a
random ``fraction`` of the minibatches one random rank is ``factor`` x slower (``slow_model``;
the same draw for every τ). A noisy neighbour that always hits the same rank cannot be hidden
(that rank's own work is the critical path at any τ); one that moves can: at τ >= 1 a rank slow
on step j catches up while the others run ahead, so the total nears max over ranks of the sum
of their step times instead of the sum over steps of the slowest rank's.
Each configuration runs ``repeats`` times, interleaved so that drifting load
hits all alike; reported: median samples/s with its range, the mean wait for versions, the
largest lag read (each run ends with ``drain``: every step applied).

``python -m odcfn.bench.staleness`` prints the table (docs/staleness.md has one).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import odcfn
from odcfn.bench.slow import slow_model
from odcfn.models import QwenConfig, init_params, qwen_model
from odcfn.step import stale

__all__ = ["bench_staleness", "main"]


def _once(tau: int, world: int, batches: list, noisy: list[int], factor: float, lr: float) -> dict[str, Any]:
    cfg = QwenConfig(vocab_size=64, d_model=96, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192)
    base, full = qwen_model(cfg), init_params(cfg, seed=0)
    slow = slow_model(base, factor)

    def fn(rank: int, tr: Any) -> dict[str, Any]:
        st = odcfn.TrainState.create(params=full, model=base, optimizer=odcfn.sgd(lr), transport=tr,
                                     config=odcfn.StepConfig(staleness=tau))
        waits, lags, t0 = [], [], time.perf_counter()
        for j, b in enumerate(batches):
            st = st.replace(model=slow if noisy[j] == rank else base)
            st, m = odcfn.train_step(st, b)
            waits.append(m.extra.get("version_wait_s", 0.0))
            lags.append(m.extra.get("staleness_max", 0))
        st, _ = stale.drain(st.replace(model=base))
        elapsed = time.perf_counter() - t0
        return {"elapsed": elapsed, "wait": sum(waits), "lag": max(lags)}

    out = odcfn.run_local(fn, world, timeout=120)
    return {"elapsed": max(o["elapsed"] for o in out), "wait": sum(o["wait"] for o in out) / world,
            "lag": max(o["lag"] for o in out)}


def bench_staleness(
    taus: tuple[int, ...] = (0, 1, 2), *, world: int = 2, steps: int = 12, samples: int = 8,
    factor: float = 1.5, fraction: float = 1 / 3, repeats: int = 3, seed: int = 0, lr: float = 0.05,
) -> dict[int, dict[str, float]]:
    """Per τ: median samples/s, its min and max over ``repeats``, mean version wait per rank (s),
    the largest lag read."""
    rng = random.Random(seed)
    lengths = [[rng.randint(32, 256) for _ in range(samples)] for _ in range(steps)]
    batches = [odcfn.random_batch(ls, 64, seed=seed + i) for i, ls in enumerate(lengths)]
    noisy = [rng.randrange(world) if rng.random() < fraction else -1 for _ in range(steps)]
    runs: dict[int, list[dict[str, Any]]] = {t: [] for t in taus}
    for t in taus:  # warm-up: first calls pay one-time costs (allocator, kernels' first use)
        _once(t, world, batches[:2], noisy[:2], factor, lr)
    for _ in range(repeats):
        for t in taus:  # interleaved: a load spike on the shared machine hits every τ alike
            runs[t].append(_once(t, world, batches, noisy, factor, lr))
    out = {}
    for t, rs in runs.items():
        rates = [steps * samples / r["elapsed"] for r in rs]
        out[t] = {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
                  "wait_s": statistics.median(r["wait"] for r in rs), "lag": max(r["lag"] for r in rs)}
    return out


def main() -> None:
    res = bench_staleness()
    base = res[0]["median"]
    print("| τ | samples/s (median, range) | vs τ=0 | version wait per rank (s) | max lag |")
    print("|---|---|---|---|---|")
    for t, r in res.items():
        print(f"| {t} | {r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f}) | {r['median'] / base:.2f}x "
              f"| {r['wait_s']:.2f} | {r['lag']} |")


if __name__ == "__main__":
    main()
