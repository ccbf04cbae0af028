"""Repeated ``odcfn bench`` runs and their spread: each headline ratio as a median with its range
(min-max) over the runs (``python bench/run_all.py --repeat N``).

One run interleaves its contenders minibatch by minibatch, so load from other jobs falls on all
of them alike within a run; across runs the load differs, and the range says how far one run's
ratio can be from another's. The aggregation is pure (``aggregate``, ``render``): the runs are
JSON reports of schema ``odcfn.bench/1``."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["DEFAULT_ARGS", "HEADLINE", "SCHEMA", "aggregate", "bench_args", "render", "spread"]

SCHEMA = "odcfn.bench.repeat/1"

# what one repeat runs unless told otherwise: the headline sections (long-tail end to end, equal
# lengths, a 1.5x straggler), on a model of 3.4M parameters (d_model 256, 4 layers; the single-run
# figures before used 0.92M) so that the units' GEMMs, not per-call overheads, make a step's time;
# 196 s per repeat with about a core per rank (685 s at 0.15 of a core)
DEFAULT_ARGS = ("--only", "end_to_end", "balanced", "straggler", "--samples-per-rank", "4",
                "--steps", "6")
DEFAULT_MODEL = ("--d-model", "256", "--n-layers", "4")

# (key of report["ratios"], what it compares)
HEADLINE = (
    ("odc_lb_mini_over_collective_lb_micro", "ODC+LB-Mini / Collective+LB-Micro over gloo (long-tail)"),
    ("collective_shm_over_collective_gloo", "same-wire collective / gloo collective: the wire alone"),
    ("odc_lb_mini_over_collective_shm_lb_micro", "ODC+LB-Mini / same-wire collective: ODC's own effect"),
    ("balanced_odc_over_collective_shm", "the same on equal lengths (nothing to balance)"),
    ("odc_work_stealing_over_odc_lb_mini", "work stealing / LB-Mini, no rank slow"),
    ("straggler_odc_work_stealing_over_odc_lb_mini", "work stealing / LB-Mini, rank 1 1.5x slower"),
    ("straggler_odc_lb_mini_over_collective_shm_lb_micro",
     "ODC+LB-Mini / same-wire collective, rank 1 1.5x slower"),
)


def bench_args(rest: Sequence[str]) -> list[str]:
    """The ``odcfn bench`` arguments of one repeat: ``rest`` as given, or the headline sections
    when empty; the default model unless ``rest`` names a width or a depth."""
    args = list(rest) or list(DEFAULT_ARGS)
    if "--d-model" not in args and "--n-layers" not in args:
        args += DEFAULT_MODEL
    return args


def spread(values: Sequence[float | None]) -> dict:
    """Median, min, max and count of the values that are numbers (a run whose section crashed
    or was not run gives None and is left out, and ``n`` says so)."""
    xs = [float(v) for v in values if isinstance(v, (int, float)) and v == v]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def aggregate(reports: Sequence[dict], keys: Sequence[str] | None = None) -> dict:
    """``{key: spread of report["ratios"][key] over reports, plus "runs": each run's value}``
    for the headline keys (or ``keys``)."""
    out = {}
    for key in keys or [k for k, _ in HEADLINE]:
        runs = [(r.get("ratios") or {}).get(key) for r in reports]
        out[key] = spread(runs) | {"runs": runs}
    return out


def fmt(s: dict) -> str:
    """``1.08x [1.02-1.12]`` (median [min-max]); one run: just the value; none: ``-``."""
    if not s["n"]:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.3f}x (one run)"
    return f"{s['median']:.3f}x [{s['min']:.3f}-{s['max']:.3f}]"


def render(agg: dict, n_runs: int) -> str:
    labels = dict(HEADLINE)
    width = max(len(labels.get(k, k)) for k in agg)
    lines = [f"median [min-max] over {n_runs} runs:"]
    for key, s in agg.items():
        missing = f"  ({n_runs - s['n']} runs without it)" if s["n"] < n_runs else ""
        lines.append(f"  {labels.get(key, key):<{width}}  {fmt(s)}{missing}")
    return "\n".join(lines)
