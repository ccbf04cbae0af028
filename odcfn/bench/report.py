"""Turn raw per-rank records (``odcfn.bench.runner.run``) into figures, tables and trace files."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from odcfn.bench.runner import step_records
from odcfn.schedule.policy import SCHEDULES
from odcfn.trace import Event, bubble_rate

__all__ = [
    "shared_cores_warning",
    "losses_match",
    "paired_median_speedup",
    "policy_summary",
    "ratio",
    "table",
    "write_chrome_trace",
    "write_timeline_png",
]

def _events(rec: dict) -> list[Event]:
    return [Event(rec["rank"], k, n, s, e, mb) for k, n, s, e, mb in rec["events"]]


def step_bubble_rate(recs: Sequence[dict]) -> float:
    """``odcfn.trace.bubble_rate`` of one minibatch from the runtime's per-rank traces, over
    the step's span (every rank's clock starts at its step's start)."""
    per_rank = [_events(r) for r in recs]
    span = max((max(e.end for e in evs) for evs in per_rank if evs), default=0.0)
    if span <= 0:
        return float("nan")
    return bubble_rate(per_rank, span)


def policy_summary(per_rank: Sequence[Sequence[dict]], policy: str) -> dict:
    """Raw figures of one policy over its timed minibatches."""
    steps = step_records(per_rank, policy)
    if not steps:
        raise ValueError(f"no timed records for policy {policy!r}")
    walls = [max(r["wall"] for r in recs) for recs in steps]
    samples = sum(recs[0]["samples"] for recs in steps)
    tokens = sum(recs[0]["tokens"] for recs in steps)
    bubbles = [step_bubble_rate(recs) for recs in steps if recs[0]["events"]]
    mbs = [[len(r["microbatches"]) for r in recs] for recs in steps]
    busy = sum(e[3] - e[2] for recs in steps for r in recs for e in r["events"]
               if e[0] in ("forward", "backward"))
    return {
        "policy": policy,
        "comm": SCHEDULES[policy].comm,
        "balancer": steps[-1][0]["balancer"],
        "minibatches": len(steps),
        "samples": samples,
        "tokens": tokens,
        "time_s": sum(walls),
        "samples_per_s": samples / sum(walls),
        "tokens_per_s": tokens / sum(walls),
        "step_time_s": walls,
        "bubble_rate": sum(bubbles) / len(bubbles) if bubbles else None,
        "losses": [recs[0]["loss"] for recs in steps],
        "microbatches_per_rank": mbs,
        "syncs_per_minibatch": _mean([r["counters"]["syncs"] for recs in steps for r in recs]),
        "collectives_per_minibatch": _mean(
            [r["counters"]["collectives"] for recs in steps for r in recs]
        ),
        "gathers_per_minibatch": _mean([r["counters"]["gathers"] for recs in steps for r in recs]),
        # CPU seconds the ranks got per second of (trace) compute: ~1 when each rank has a
        # core to itself, well below 1 when other processes share the cores
        "core_share": _core_share(steps, busy),
    }


def _core_share(steps, busy: float) -> float | None:
    cpus = [r.get("cpu") for recs in steps for r in recs]
    if busy <= 0 or any(c is None for c in cpus):
        return None
    return sum(cpus) / busy


SHARED_CORES_WARNING = (
    "warning: the ranks got {share:.2f} CPU-seconds per second of compute (about 1 when each "
    "rank has a core to itself): other processes share these cores, they absorb the ranks' idle "
    "time, and the speedups of removing it are understated (docs/benchmarks.md, noise section)"
)


def shared_cores_warning(summaries, threshold: float = 0.8) -> str | None:
    shares = [s["core_share"] for s in summaries if s.get("core_share") is not None]
    if shares and min(shares) < threshold:
        return SHARED_CORES_WARNING.format(share=min(shares))
    return None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def paired_median_speedup(a: dict, base: dict) -> float | None:
    """Median over minibatches of base step time / ``a``'s step time on the same minibatch: a
    noise-robust companion of the samples/s ratio (a burst of load from other jobs hits a few
    minibatches, not the median)."""
    xs = sorted(b / t for t, b in zip(a["step_time_s"], base["step_time_s"], strict=True) if t > 0)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def losses_match(summaries: Sequence[dict], rtol: float = 1e-4) -> tuple[bool, float]:
    """Every policy saw the same minibatches from the same init: its losses must agree step by
    step up to floating-point summation order (which AdamW then carries a little further)."""
    worst = 0.0
    ref = summaries[0]["losses"]
    for s in summaries[1:]:
        if len(s["losses"]) != len(ref):
            return False, float("inf")
        for a, b in zip(ref, s["losses"], strict=True):
            worst = max(worst, abs(a - b) / max(abs(a), 1e-12))
    return worst <= rtol, worst


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    for r in cells:
        pairs = enumerate(zip(r, widths, strict=True))
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in pairs))
    return "\n".join(out)


def _fmt(x: object) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"
    return str(x)


# --- trace files (odcfn.trace's formats, one block per policy) ---------------------------


def _step_events(per_rank, policy: str, step: int) -> list[list[Event]]:
    out = []
    for recs in per_rank:
        out += [_events(r) for r in recs if r["policy"] == policy and r["step"] == step]
    return out


def chrome_trace(per_rank: Sequence[Sequence[dict]], policies: Sequence[str], step: int) -> dict:
    """Chrome/Perfetto trace of minibatch ``step``: ``odcfn.trace.chrome_trace`` per policy,
    its processes renumbered and named "<policy> / rank r" so the policies stack in one view."""
    from odcfn import trace

    out: list[dict] = []
    W = len(per_rank)
    for k, pol in enumerate(policies):
        for e in trace.chrome_trace(_step_events(per_rank, pol, step), label=pol)["traceEvents"]:
            e = dict(e, pid=e["pid"] + k * W)
            if e.get("name") == "process_name":
                e["args"] = {"name": f"{pol} / {e['args']['name']}"}
            if e.get("name") == "process_sort_index":
                e["args"] = {"sort_index": e["pid"]}
            out.append(e)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"step": step}}


def write_chrome_trace(path: Path, per_rank, policies: Sequence[str], step: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(per_rank, policies, step)))
    return path


def write_timeline_png(path: Path, per_rank, policies: Sequence[str], step: int) -> Path | None:
    """``odcfn.trace.plot_timeline`` of each policy, stacked; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from odcfn import trace

    W = len(per_rank)
    fig, axes = plt.subplots(len(policies), 1, figsize=(11, (0.45 * W + 1.9) * len(policies)),
                             squeeze=False)
    for ax, pol in zip(axes[:, 0], policies, strict=True):
        trace.plot_timeline(_step_events(per_rank, pol, step), ax=ax, title=pol)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
