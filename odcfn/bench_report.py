"""Turn raw per-rank records (``bench_runner.run``) into figures, tables and trace files."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from odcfn.bench_runner import step_records
from odcfn.bench_workload import POLICIES
from odcfn.trace import Event

__all__ = [
    "losses_match",
    "policy_summary",
    "ratio",
    "table",
    "write_chrome_trace",
    "write_timeline_png",
]

# Emulated slow compute ("straggle") is busy time of the slow device, not a bubble.
BUSY_KINDS = ("forward", "backward", "straggle")


def _events(rec: dict) -> list[Event]:
    return [Event(rec["rank"], k, n, s, e, mb) for k, n, s, e, mb in rec["events"]]


def step_bubble_rate(recs: Sequence[dict]) -> float:
    """1 - busy compute / (ranks x step makespan), from the runtime's per-rank traces."""
    per_rank = [_events(r) for r in recs]
    span = max((max(e.end for e in evs) for evs in per_rank if evs), default=0.0)
    if span <= 0:
        return float("nan")
    busy = sum(e.duration for evs in per_rank for e in evs if e.kind in BUSY_KINDS)
    return 1.0 - busy / (len(per_rank) * span)


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
    return {
        "policy": policy,
        "comm": POLICIES[policy].comm,
        "balancer": steps[-1][0]["balancer"],
        "balancer_is_fallback": any(r["balancer_is_fallback"] for recs in steps for r in recs),
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
    }


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


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


# --- trace files --------------------------------------------------------------------------


def chrome_trace(per_rank: Sequence[Sequence[dict]], policies: Sequence[str], step: int) -> dict:
    """Chrome/Perfetto trace of minibatch ``step``: one process per policy, one thread per rank."""
    out = []
    for pid, pol in enumerate(policies):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": pol}})
        for recs in per_rank:
            for r in recs:
                if r["policy"] != pol or r["step"] != step:
                    continue
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": r["rank"],
                            "args": {"name": f"rank {r['rank']}"}})
                for kind, name, s, e, mb in r["events"]:
                    out.append({
                        "ph": "X", "pid": pid, "tid": r["rank"], "cat": kind,
                        "name": f"{kind} {name}" + (f" mb{mb}" if mb >= 0 else ""),
                        "ts": s * 1e6, "dur": max(0.0, e - s) * 1e6,
                    })
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: Path, per_rank, policies: Sequence[str], step: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(per_rank, policies, step)))
    return path


_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "straggle": "#937860",
           "gather": "#55a868", "scatter": "#8172b3", "collective": "#c44e52", "sync": "#000000"}


def write_timeline_png(path: Path, per_rank, policies: Sequence[str], step: int) -> Path | None:
    """One panel per policy, one lane per rank (white = idle); None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return None
    W = len(per_rank)
    fig, axes = plt.subplots(len(policies), 1, figsize=(11, 1.0 + 0.9 * W * len(policies)),
                             squeeze=False, sharex=True)
    for ax, pol in zip(axes[:, 0], policies, strict=True):
        for recs in per_rank:
            for r in recs:
                if r["policy"] != pol or r["step"] != step:
                    continue
                for kind, _, s, e, _ in r["events"]:
                    if kind in _COLORS and e > s:
                        ax.barh(r["rank"], e - s, left=s, height=0.8, color=_COLORS[kind], lw=0)
        ax.set_yticks(range(W), [f"rank {i}" for i in range(W)])
        ax.invert_yaxis()
        ax.set_title(pol, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds since the start of the minibatch")
    fig.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], ncol=len(_COLORS),
               loc="lower center", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
